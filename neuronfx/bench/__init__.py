"""Benchmarks, one module per ``neuronfx bench <name>``, each exporting ``BENCHMARK`` (a
:class:`~neuronfx.bench.types.Benchmark`: its options and its run function). Adding one is a
module and an entry in :data:`BENCHMARKS`. Shared: ``timing`` (one greedy case, vLLM's metric
definitions), ``rounds`` (alternating rounds and their report), ``bandwidth`` (memory figures),
``workload`` (the serving benchmarks' requests), ``llama_cpp`` (llama.cpp as a compared engine,
the ``[bench]`` extra). ``accuracy`` is ``neuronfx check-accuracy``'s library."""

from __future__ import annotations

from neuronfx.bench import (
    artifacts,
    async_decode,
    choices,
    chunked_prefill,
    engines,
    kernels,
    kv_blocks,
    latency,
    moe,
    prefix_caching,
    prompt_lookup,
    serving,
    speculative,
    step_bound,
    structured,
    tensor_parallel,
    throughput,
    weight_formats,
)
from neuronfx.bench.types import Benchmark

BENCHMARKS: tuple[Benchmark, ...] = (
    latency.BENCHMARK, serving.BENCHMARK, throughput.BENCHMARK, speculative.BENCHMARK, tensor_parallel.BENCHMARK,
    weight_formats.BENCHMARK, prefix_caching.BENCHMARK, chunked_prefill.BENCHMARK, async_decode.BENCHMARK, moe.BENCHMARK,
    kernels.BENCHMARK, artifacts.BENCHMARK, structured.BENCHMARK, choices.BENCHMARK, prompt_lookup.BENCHMARK,
    step_bound.BENCHMARK, engines.BENCHMARK, kv_blocks.BENCHMARK,
)
