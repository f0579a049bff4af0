"""The measurement behind ``neuronfx bench latency``: every (batch size, prompt length,
generation length) case in neuronfx, optionally beside another engine (transformers,
llama.cpp or OpenVINO GenAI) on the same prompts, with compile times, resident memory, the
weight bytes a decode step reads against this machine's read bandwidth and, for an engine
that returns its tokens, how many of its greedy tokens equal neuronfx's."""

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
from neuronfx.bench.accuracy_report import first_divergence
from neuronfx.bench.bandwidth import bandwidth_rows, decode_weight_bytes, format_read_bandwidth, read_bandwidth, rss_bytes, unique_tensors
from neuronfx.bench.options import Log
from neuronfx.bench.rounds import alternate, format_rounds, median_round, ratios, round_ratios
from neuronfx.bench.timing import BenchResult, Engine, bench_plan, format_result, random_prompts, summarize, time_neuronfx
from neuronfx.config.sampling import SamplingParams
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
    kv_cache_dtype: str = "auto"
    rounds: int = 1  # > 1 with a compared engine: each case that many times in both, alternating
    agreement: bool = False  # keep neuronfx's greedy tokens of each batch size's first case, for the compared engine's agreement

    @property
    def label(self) -> str:
        """The dtype name neuronfx's results carry: "float32", "float32/gguf", "float32/gguf/int8x"."""
        label = self.dtype if self.weight_format == "float" else f"{self.dtype}/{self.weight_format}"
        label += "/int8x" if self.activation_format == "int8" else ""
        return label + ("" if self.kv_cache_dtype == "auto" else f"/kv-{self.kv_cache_dtype}")


@attrs.frozen(kw_only=True)
class BatchRun:
    """What one batch size's runtime measured."""

    results: tuple[BenchResult, ...]
    compile: dict[str, Any]
    memory: dict[str, Any]
    step_bytes: int
    rounds: tuple[dict[str, Any], ...]
    tokens: list[list[int]] | None  # neuronfx's greedy tokens of the first case (spec.agreement), B rows of gen_len ids


def run_bench(checkpoint: Any, spec: LatencySpec, compare: OpenEngine | None = None, log: Log = print) -> dict[str, Any]:
    """Measure every case; returns JSON-able ``{"results": [BenchResult as dict], "ratios",
    "compile", "memory", "threads", "read_bandwidth", "bandwidth", "rounds", "agreement"}``.

    ``compare`` opens another engine: after all of neuronfx's cases (so its memory does not
    count in neuronfx's RSS), or with ``spec.rounds`` > 1 held beside the runtimes, each case
    then running ``rounds`` times in both engines, alternating; each engine's result is its
    median round and ``"rounds"`` lists the per-round decode tok/s ratios. ``bandwidth``: per
    engine and batch size, the weight bytes one decode step reads over TPOT, against the read
    bandwidth measured once at the start. ``"agreement"`` (``spec.agreement`` and an engine
    with ``tokens``): per batch size, its greedy tokens of the first case against neuronfx's
    (:func:`token_agreement`). A "gguf" spec needs ``checkpoint`` read with
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
    compared, agreement = [], []
    if compare is not None:
        with compare() if not interleaved else contextlib.nullcontext(engine) as other:
            results += [] if interleaved else engine_cases(other, spec, checkpoint.config.vocab_size, log)
            step_bytes |= {(other.name, b): other.decode_bytes(b) for b in spec.batch_sizes if other.decode_bytes is not None}
            compared = ratios(results, other.name)
            agreement = engine_agreement(other, spec, checkpoint.config.vocab_size, runs)
    return {
        "results": [attrs.asdict(r) for r in results], "ratios": compared,
        "compile": [run.compile for run in runs], "memory": [run.memory for run in runs],
        "threads": torch.get_num_threads(), "read_bandwidth": bandwidth,
        "bandwidth": bandwidth_rows(results, step_bytes, bandwidth["bytes_per_s"]),
        "prefill_16bit": prefill_16bit(spec), "rounds": [row for run in runs for row in run.rounds],
        "agreement": agreement,
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
    paths = {"float": kernels.quant_isa(), "int8": kernels.quant_int8_x_isa() + " (int8 activations)",
             "auto": kernels.quant_int8_x_isa() + " (int8 activations where they measured faster, else " + kernels.quant_isa() + ")"}
    return f"quantized decode products: {paths[spec.activation_format]} path"


def measure_batch(checkpoint: Any, spec: LatencySpec, batch: int, engine: Engine | None, log: Log) -> BatchRun:
    """Compile the plan of one batch size, warm it up, and time its cases (alternating with
    ``engine`` in rounds when one is given)."""
    plan = bench_plan(checkpoint, spec.backend, spec.dtype, batch, max(spec.prompt_lens), max(spec.gen_lens), spec.weight_format,
                      spec.weight_group_size, spec.device, spec.activation_format, spec.kv_cache_dtype)
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
    tokens = greedy_neuronfx(runtime, *first_case(spec, checkpoint.config.vocab_size, batch)) if spec.agreement else None
    return BatchRun(results=tuple(results), compile=compiled, memory=memory, step_bytes=decode_weight_bytes(runtime.weights, batch),
                    rounds=tuple(rows), tokens=tokens)


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


def first_case(spec: LatencySpec, vocab_size: int, batch: int) -> tuple[list[list[int]], int]:
    """(prompts, generation length) of one batch size's first case: where tokens are compared."""
    return next(cases(spec, vocab_size, batch))


def greedy_neuronfx(runtime: Runtime, prompts: list[list[int]], gen_len: int) -> list[list[int]]:
    """neuronfx's greedy tokens of ``prompts`` (eos ignored): B rows of ``gen_len`` ids."""
    result, _ = neuronfx.generate(runtime, neuronfx.init_state(runtime), prompts, max_new_tokens=gen_len,
                                  sampling=SamplingParams(ignore_eos=True))
    return [list(row) for row in result.token_ids]


def engine_agreement(engine: Engine, spec: LatencySpec, vocab_size: int, runs: list[BatchRun]) -> list[dict[str, Any]]:
    """Per batch size, ``engine``'s greedy tokens of the first case against neuronfx's
    (:func:`token_agreement`); empty unless ``spec.agreement`` and the engine gives tokens."""
    if not spec.agreement or engine.tokens is None:
        return []
    out = []
    for b, run in zip(spec.batch_sizes, runs):
        prompts, gen_len = first_case(spec, vocab_size, b)
        out.append(token_agreement(engine.name, run.tokens, engine.tokens(prompts, gen_len), len(prompts[0])))
    return out


def token_agreement(engine: str, ours: list[list[int]], theirs: list[list[int]], prompt_len: int) -> dict[str, Any]:
    """How far ``engine``'s greedy tokens (``theirs``) follow neuronfx's (``ours``), B rows of
    gen_len ids each: ``matching`` counts each row's tokens before its first difference (after
    one, the rows continue different texts, so later equal tokens are not counted), of
    ``tokens`` = B x gen_len; ``identical_rows``; ``first_difference`` per row (None: none)."""
    first = [first_divergence(x, y) for x, y in zip(ours, theirs, strict=True)]
    gen_len = len(ours[0])
    matching = sum(gen_len if f is None else f for f in first)
    return {"engine": engine, "reference": "neuronfx", "batch_size": len(ours), "prompt_len": prompt_len, "gen_len": gen_len,
            "matching": matching, "tokens": len(ours) * gen_len, "identical_rows": first.count(None), "first_difference": first}


def format_agreement(row: dict[str, Any]) -> str:
    """One line of :func:`token_agreement`."""
    return (f"B={row['batch_size']} prompt={row['prompt_len']} gen={row['gen_len']}: {row['engine']}'s greedy tokens equal "
            f"neuronfx's for {row['matching']}/{row['tokens']} tokens (up to each row's first difference), "
            f"{row['identical_rows']}/{row['batch_size']} rows identical")
