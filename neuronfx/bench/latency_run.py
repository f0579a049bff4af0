"""The measurement behind ``neuronfx bench latency``: every (batch size, prompt length,
generation length) case in neuronfx, optionally beside another engine (transformers or
llama.cpp) on the same prompts, with compile times, resident memory and the weight bytes a
decode step reads against this machine's read bandwidth."""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import attrs
import torch

import neuronfx
from neuronfx.bench.bandwidth import bandwidth_rows, decode_weight_bytes, format_read_bandwidth, read_bandwidth, rss_bytes, unique_tensors
from neuronfx.bench.options import Log
from neuronfx.bench.rounds import alternate, format_rounds, median_round, ratios, round_ratios
from neuronfx.bench.timing import BenchResult, Engine, bench_plan, format_result, random_prompts, summarize, time_neuronfx
from neuronfx.graphs.kernels import library as kernels
from neuronfx.graphs.kernels.gemm_choice import prefill_choice
from neuronfx.runtime.runtime import Runtime

OpenEngine = Callable[[], AbstractContextManager[Engine]]
"""Opens the compared engine (e.g. ``functools.partial(transformers_engine, ckpt, "float32")``)."""


@attrs.frozen(kw_only=True)
class LatencySpec:
    """The cases and the plans of a latency run (see :func:`run_bench`)."""

    backend: str
    dtype: str
    batch_sizes: tuple[int, ...]
    prompt_lens: tuple[int, ...] = (128,)
    gen_lens: tuple[int, ...] = (128,)
    weight_format: str = "float"
    weight_group_size: int = 32
    device: str = "cpu"
    activation_format: str = "float"
    rounds: int = 1  # > 1 with a compared engine: each case that many times in both, alternating

    @property
    def label(self) -> str:
        """The dtype name neuronfx's results carry: "float32", "float32/gguf", "float32/gguf/int8x"."""
        label = self.dtype if self.weight_format == "float" else f"{self.dtype}/{self.weight_format}"
        return label + ("/int8x" if self.activation_format == "int8" else "")


@attrs.frozen(kw_only=True)
class BatchRun:
    """What one batch size's runtime measured."""

    results: tuple[BenchResult, ...]
    compile: dict[str, Any]
    memory: dict[str, Any]
    step_bytes: int
    rounds: tuple[dict[str, Any], ...]


def run_bench(checkpoint: Any, spec: LatencySpec, compare: OpenEngine | None = None, log: Log = print) -> dict[str, Any]:
    """Measure every case; returns JSON-able ``{"results": [BenchResult as dict], "ratios",
    "compile", "memory", "threads", "read_bandwidth", "bandwidth", "rounds"}``.

    ``compare`` opens another engine: after all of neuronfx's cases (so its memory does not
    count in neuronfx's RSS), or with ``spec.rounds`` > 1 held beside the runtimes, each case
    then running ``rounds`` times in both engines, alternating; each engine's result is its
    median round and ``"rounds"`` lists the per-round decode tok/s ratios. ``bandwidth``: per
    engine and batch size, the weight bytes one decode step reads over TPOT, against the read
    bandwidth measured once at the start. A "gguf" spec needs ``checkpoint`` read with
    ``gguf_blocks=True``. Raises ConfigError for a case the plan cannot hold."""
    bandwidth = read_bandwidth()
    for line in (format_read_bandwidth(bandwidth), prefill_16bit(spec), quant_path(spec)):
        if line is not None:
            log(line)
    interleaved = compare is not None and spec.rounds > 1
    with compare() if interleaved else contextlib.nullcontext() as engine:
        runs = [measure_batch(checkpoint, spec, b, engine, log) for b in spec.batch_sizes]
    results = [r for run in runs for r in run.results]
    step_bytes = {("neuronfx", b): run.step_bytes for b, run in zip(spec.batch_sizes, runs)}
    compared = []
    if compare is not None:
        with compare() if not interleaved else contextlib.nullcontext(engine) as other:
            results += [] if interleaved else engine_cases(other, spec, checkpoint.config.vocab_size, log)
            step_bytes |= {(other.name, b): other.decode_bytes(b) for b in spec.batch_sizes if other.decode_bytes is not None}
            compared = ratios(results, other.name)
    return {
        "results": [attrs.asdict(r) for r in results], "ratios": compared,
        "compile": [run.compile for run in runs], "memory": [run.memory for run in runs],
        "threads": torch.get_num_threads(), "read_bandwidth": bandwidth,
        "bandwidth": bandwidth_rows(results, step_bytes, bandwidth["bytes_per_s"]),
        "prefill_16bit": prefill_16bit(spec), "rounds": [row for run in runs for row in run.rounds],
    }


def prefill_16bit(spec: LatencySpec) -> str | None:
    """The line saying how a 16-bit plan's prefill products run on this CPU (inductor only:
    the other backends run the reference ops)."""
    if spec.backend != "inductor" or spec.dtype == "float32":
        return None
    return prefill_choice(spec.dtype).describe()


def quant_path(spec: LatencySpec) -> str | None:
    """The line naming the SIMD path of a quantized plan's decode products on this CPU (the
    inductor backend's kernels; None for other plans)."""
    if spec.backend != "inductor" or spec.device != "cpu" or spec.weight_format == "float":
        return None
    if not kernels.small_gemm_available():
        return "quantized decode products: torch fallback (the kernel library is unavailable)"
    path = kernels.quant_int8_x_isa() + " (int8 activations)" if spec.activation_format == "int8" else kernels.quant_isa()
    return f"quantized decode products: {path} path"


def measure_batch(checkpoint: Any, spec: LatencySpec, batch: int, engine: Engine | None, log: Log) -> BatchRun:
    """Compile the plan of one batch size, warm it up, and time its cases (alternating with
    ``engine`` in rounds when one is given)."""
    plan = bench_plan(checkpoint, spec.backend, spec.dtype, batch, max(spec.prompt_lens), max(spec.gen_lens), spec.weight_format,
                      spec.weight_group_size, spec.device, spec.activation_format)
    gc.collect()
    t0 = time.perf_counter()
    runtime = neuronfx.compile(plan, checkpoint.state_dict, progress=log is print)
    compiled = {"batch_size": batch, "compile_s": time.perf_counter() - t0, "graphs": len(plan.graphs),
                "per_graph_s": {f"{p}{k}x{b}": s for (p, b, k), s in runtime.compile_s.items()}}
    memory = {"batch_size": batch, "rss_bytes": rss_bytes(), "weights_bytes": sum(t.nbytes for t in unique_tensors(runtime.weights)),
              "kv_bytes": plan.kv.nbytes}
    warm = random_prompts(checkpoint.config.vocab_size, batch, 8, seed=1)
    time_neuronfx(runtime, warm, 3)
    if engine is not None:
        engine.time(warm, 3)
    results, rows = [], []
    for prompts, gen_len in cases(spec, checkpoint.config.vocab_size, batch):
        if engine is None:
            case = [summarize("neuronfx", spec.backend, spec.label, batch, len(prompts[0]), *time_neuronfx(runtime, prompts, gen_len))]
        else:
            case, row = alternated_case(runtime, engine, prompts, gen_len, spec)
            rows.append(row)
            log(format_rounds(row))
        for r in case:
            log(format_result(r))
        results += case
    return BatchRun(results=tuple(results), compile=compiled, memory=memory, step_bytes=decode_weight_bytes(runtime.weights, batch),
                    rounds=tuple(rows))


def cases(spec: LatencySpec, vocab_size: int, batch: int) -> Iterator[tuple[list[list[int]], int]]:
    """(prompts, generation length) of every case of one batch size, the same prompts in every engine."""
    for p in spec.prompt_lens:
        for g in spec.gen_lens:
            yield random_prompts(vocab_size, batch, p), g


def alternated_case(runtime: Runtime, engine: Engine, prompts: list[list[int]], gen_len: int,
                    spec: LatencySpec) -> tuple[list[BenchResult], dict[str, Any]]:
    """One case ``spec.rounds`` times in neuronfx and ``engine``, alternating: (each engine's
    median round, the per-round ratios)."""
    timed = alternate({"neuronfx": functools.partial(time_neuronfx, runtime, prompts, gen_len),
                       engine.name: functools.partial(engine.time, prompts, gen_len)}, spec.rounds)
    b, p = len(prompts), len(prompts[0])
    ours = [summarize("neuronfx", spec.backend, spec.label, b, p, *t) for t in timed["neuronfx"]]
    theirs = [summarize(engine.name, engine.backend, engine.dtype, b, p, *t) for t in timed[engine.name]]
    return [median_round(ours), median_round(theirs)], round_ratios(ours, theirs)


def engine_cases(engine: Engine, spec: LatencySpec, vocab_size: int, log: Log) -> list[BenchResult]:
    """Every case in ``engine`` (after a warm-up per batch size), the same prompts as neuronfx's."""
    out = []
    for b in spec.batch_sizes:
        engine.time(random_prompts(vocab_size, b, 8, seed=1), 3)
        for prompts, gen_len in cases(spec, vocab_size, b):
            r = summarize(engine.name, engine.backend, engine.dtype, b, len(prompts[0]), *engine.time(prompts, gen_len))
            log(format_result(r))
            out.append(r)
    return out
