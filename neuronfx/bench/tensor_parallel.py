"""``neuronfx bench tensor-parallel --tp-degree 1 2``: tensor parallelism against one process.

For each N of --tp-degree, one ``neuronfx.launch`` of N fresh ranks (N = 1 too, so every
configuration starts from a fresh process), each with ``max(1, cores // N)`` torch threads,
compiling one plan from --model (``neuronfx.compile`` reads the checkpoint on every rank: each
keeps its shard). The plan has one prefill bucket (the prompt length), one decode bucket (prompt
+ generation) and the batch buckets --batch-sizes. Measured, times in seconds:

- decode tok/s per batch size: greedy --gen-lens tokens after --prompt-lens-token prompts,
  median of 3 runs, after a warm-up.
- TTFT: prefill of one prompt, median of 3; for N > 1 also with a second runtime compiled with
  ``sequence_parallel=True`` (batch 1 only; when its compile fails the run goes on and
  ``sp_error`` holds the error).
- memory per rank, after compile and ``trim_heap``: bytes of the rank's unique weight tensors
  and the process's RSS (torch, the compiled graphs and the KV cache included); ``max_*`` over ranks.
- collective share: ``torch.profiler`` (CPU activity) over 10 batch-1 decode steps, each in a
  ``record_function`` marker, after 2 unprofiled ones. Collective time = the self CPU time of
  the events on the thread that ran the steps whose name contains "c10d", "all_gather" or
  "wait_tensor" (issuing the gloo work, and blocking until it is done: transfer time plus
  waiting for the slower rank); gloo's own threads are left out, their time overlaps the wait.
  Share = collective time / the markers' wall time (the profiler's overhead is in both).

Then, per N > 1, the ratios to N = 1 (decode tok/s per batch size, target >= 0.85; per-rank
weight bytes, target <= 0.55)."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

import neuronfx
from neuronfx.bench.bandwidth import rss_bytes, unique_tensors
from neuronfx.bench.options import Log, add_engine, add_model, check_at_least, logger
from neuronfx.bench.rounds import median
from neuronfx.bench.timing import random_prompts, summarize, time_neuronfx
from neuronfx.bench.types import Benchmark
from neuronfx.config.inference import InferenceConfig
from neuronfx.config.model import ModelConfig
from neuronfx.config.plan import make_plan
from neuronfx.config.sampling import SamplingParams
from neuronfx.io import checkpoints
from neuronfx.memory import trim_heap
from neuronfx.runtime.runtime import Runtime
from neuronfx.runtime.steps import DecodeBatch, PrefillBatch, decode_step, prefill_step, release

COLLECTIVE_MARKERS = ("c10d", "all_gather", "wait_tensor")
"""Substrings of the profiler event names counted as collective time (torch's functional
collectives appear as ``_c10d_functional::all_gather_into_tensor`` / ``::wait_tensor``)."""

REPEATS = 3
PROFILE_STEPS = 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --backend, --dtype, --tp-degree and the case's sizes."""
    add_model(p)
    add_engine(p)
    p.add_argument("--tp-degree", type=int, nargs="+", default=[1, 2], metavar="N",
                   help="each N ranks (1 = one process with every core) against N=1, same run (default 1 2)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[512], help="prompt tokens (the first value; default 512)")
    p.add_argument("--gen-lens", type=int, nargs="+", default=[64], help="generated tokens (the first value; default 64)")


def tp_inference(backend: str, dtype: str, tp: int, batch_sizes: Sequence[int], prompt_len: int, gen_len: int,
                 sequence_parallel: bool = False) -> InferenceConfig:
    """One prefill bucket (``prompt_len``), one decode bucket (``prompt_len + gen_len``) and the
    batch buckets ``batch_sizes``: few graphs to compile."""
    seq = prompt_len + gen_len
    buckets = tuple(sorted(set(batch_sizes)))
    return InferenceConfig(batch_size=buckets[-1], batch_buckets=buckets, max_context_length=prompt_len, sequence_length=seq,
                           prefill_buckets=(prompt_len,), decode_buckets=(seq,), dtype=dtype, backend=backend, tp_degree=tp,
                           sequence_parallel=sequence_parallel)


def collective_share(runtime: Runtime, prompt: list[int], steps: int) -> dict[str, Any]:
    """Profile ``steps`` batch-1 decode steps after a prefill of ``prompt`` (see the module
    docstring): the share of their wall time this thread spent in collectives."""
    from torch.profiler import ProfilerActivity, profile, record_function

    greedy = [SamplingParams()]
    steps = min(steps, runtime.plan.inference.sequence_length - len(prompt) - 2)  # room in the slot
    state = neuronfx.init_state(runtime)
    out, state = prefill_step(runtime, state, PrefillBatch(seq_ids=[0], prompts=[prompt], sampling=greedy))
    for _ in range(2):  # unprofiled warm-up steps
        out, state = decode_step(runtime, state, DecodeBatch(seq_ids=[0], input_ids=out.tokens, sampling=greedy))
    marker = "neuronfx_tp_bench_decode_step"
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function(marker):
                out, state = decode_step(runtime, state, DecodeBatch(seq_ids=[0], input_ids=out.tokens, sampling=greedy))
    release(runtime, state, [0])
    return {"steps": steps, **collective_figures(list(prof.events()), marker)}


def collective_figures(events: list[Any], marker: str) -> dict[str, Any]:
    """Per-step wall and collective seconds of the profiled ``marker`` steps in ``events``."""
    step_events = [e for e in events if e.name == marker]
    threads = {e.thread for e in step_events}  # the thread that ran the steps (gloo's own threads excluded)
    wall_us = sum(e.cpu_time_total for e in step_events)
    by_name: dict[str, float] = {}
    calls: dict[str, int] = {}
    for e in events:
        if e.thread in threads and e.name != marker and any(m in e.name for m in COLLECTIVE_MARKERS):
            by_name[e.name] = by_name.get(e.name, 0.0) + e.self_cpu_time_total
            calls[e.name] = calls.get(e.name, 0) + 1
    n, collective_us = max(1, len(step_events)), sum(by_name.values())
    return {"step_wall_s": wall_us / 1e6 / n, "collective_s_per_step": collective_us / 1e6 / n,
            "collective_share": collective_us / wall_us if wall_us > 0 else float("nan"),
            "collective_events_s": {k: v / 1e6 for k, v in sorted(by_name.items())},
            "collective_calls_per_step": {k: v / n for k, v in sorted(calls.items())}}


def decode_figures(runtime: Runtime, batch_sizes: Sequence[int], prompt_len: int, gen_len: int, label: tuple[str, str]) -> dict[str, Any]:
    """Decode tok/s per batch size: the median of :data:`REPEATS` greedy runs after a warm-up."""
    vocab, backend, dtype = runtime.plan.model.vocab_size, *label
    decode: dict[str, Any] = {}
    for b in sorted(set(batch_sizes)):
        time_neuronfx(runtime, random_prompts(vocab, b, 8, seed=1), 3)
        rates = [summarize("neuronfx", backend, dtype, b, prompt_len,
                           *time_neuronfx(runtime, random_prompts(vocab, b, prompt_len, seed=i), gen_len)).decode_tok_s
                 for i in range(REPEATS)]
        decode[str(b)] = {"decode_tok_s": median(rates), "repeats": rates}
    return decode


def ttfts(runtime: Runtime, prompt: list[list[int]]) -> list[float]:
    """TTFT of ``prompt`` (one row), :data:`REPEATS` times."""
    return [time_neuronfx(runtime, prompt, 1)[0] for _ in range(REPEATS)]


def sequence_parallel_row(model: ModelConfig, model_path: str, tp: int, backend: str, dtype: str, prompt: list[list[int]],
                          gen_len: int) -> dict[str, Any]:
    """TTFT with sequence-parallel prefill (batch 1), or ``sp_error`` when its compile fails
    (every rank fails alike: same plan, same graphs; the other figures are still reported)."""
    inference = tp_inference(backend, dtype, tp, (1,), len(prompt[0]), gen_len, sequence_parallel=True)
    t0 = time.perf_counter()
    try:
        sp = neuronfx.compile(make_plan(model, inference, checkpoint=str(model_path)), progress=False)
    except Exception as exc:
        return {"sp_error": f"{type(exc).__name__}: " + " ".join(str(exc).split())}
    row = {"sp_compile_s": time.perf_counter() - t0}
    time_neuronfx(sp, random_prompts(model.vocab_size, 1, 8, seed=1), 1)  # warm-up
    sp_ttfts = ttfts(sp, prompt)
    return row | {"ttft_sp_s": median(sp_ttfts), "ttft_sp_repeats_s": sp_ttfts}


def tp_bench_rank(model: ModelConfig, model_path: str, tp: int, backend: str, dtype: str, batch_sizes: tuple[int, ...],
                  gen_len: int, prompt_len: int) -> dict[str, Any]:
    """One rank of one configuration (run by ``neuronfx.launch`` on every rank; every rank runs
    the same steps): this rank's figures, with every rank's memory under ``"ranks"``."""
    row: dict[str, Any] = {"tp_degree": tp, "threads": torch.get_num_threads(), "backend": backend, "dtype": dtype,
                           "prompt_len": prompt_len, "gen_len": gen_len}
    plan = make_plan(model, tp_inference(backend, dtype, tp, batch_sizes, prompt_len, gen_len), checkpoint=str(model_path))
    trim_heap()
    t0 = time.perf_counter()
    runtime = neuronfx.compile(plan, progress=False)
    row |= {"compile_s": time.perf_counter() - t0, "graphs": len(runtime.graphs)}
    trim_heap()
    mem = {"rank": runtime.plan.rank, "weights_bytes": sum(t.nbytes for t in unique_tensors(runtime.weights)),
           "rss_bytes": rss_bytes(), "kv_bytes": runtime.plan.kv.nbytes}
    row["decode"] = decode_figures(runtime, batch_sizes, prompt_len, gen_len, (backend, dtype))
    prompt = random_prompts(model.vocab_size, 1, prompt_len, seed=7)
    first = ttfts(runtime, prompt)
    row |= {"ttft_s": median(first), "ttft_repeats_s": first}
    # a 1-token prompt (same prefill and decode buckets, so the same cost) leaves room for the steps
    row["profile"] = collective_share(runtime, prompt[0][:1], PROFILE_STEPS)
    del runtime
    trim_heap()
    if tp > 1:
        row |= sequence_parallel_row(model, model_path, tp, backend, dtype, prompt, gen_len)
        trim_heap()
    ranks = all_ranks(mem)
    return row | {"ranks": ranks, "max_weights_bytes": max(m["weights_bytes"] for m in ranks),
                  "max_rss_bytes": max(m["rss_bytes"] for m in ranks)}


def all_ranks(mem: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``mem``, gathered to every rank (just this one outside a process group)."""
    import torch.distributed as dist

    if not dist.is_initialized():  # tp=1 joins no group
        return [mem]
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mem)
    return ranks


def run_tp_bench(model_path: str, tp_degrees: Sequence[int], backend: str, dtype: str, batch_sizes: Sequence[int] = (1, 8),
                 gen_len: int = 64, prompt_len: int = 512, log: Log = print) -> dict[str, Any]:
    """The module docstring's figures: ``{"runs": [one dict per tp], "ratios": [one dict per tp > 1]}``.
    Raises ConfigError for a tp that does not divide the model (before any process starts) and
    TensorParallelError when a rank fails."""
    model = checkpoints.load_checkpoint(model_path, lazy=True).config  # a GGUF is dequantized here once, then dropped
    trim_heap()
    batch_sizes = tuple(sorted(set(batch_sizes)))
    for tp in tp_degrees:  # a bad tp fails here, before any process starts
        make_plan(model, tp_inference(backend, dtype, tp, batch_sizes, prompt_len, gen_len))
    runs = []
    for tp in tp_degrees:
        threads = (os.cpu_count() or 1) if tp == 1 else max(1, (os.cpu_count() or 1) // tp)
        runs.append(neuronfx.launch(tp_bench_rank, model, str(model_path), tp, backend, dtype, batch_sizes, gen_len, prompt_len,
                                    tp_degree=tp, threads=threads))
        log(format_tp_run(runs[-1]))
    base = next((r for r in runs if r["tp_degree"] == 1), None)
    out_ratios = [tp_ratio(r, base) for r in runs if base is not None and r["tp_degree"] > 1]
    for q in out_ratios:
        log(format_tp_ratio(q, next(r for r in runs if r["tp_degree"] == q["tp_degree"])))
    return {"runs": runs, "ratios": out_ratios}


def tp_ratio(r: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """One configuration's figures over tp=1's."""
    return {
        "tp_degree": r["tp_degree"],
        "decode_tok_s_ratio": {b: r["decode"][b]["decode_tok_s"] / base["decode"][b]["decode_tok_s"] for b in r["decode"]},
        "weights_bytes_ratio": r["max_weights_bytes"] / base["max_weights_bytes"],
        "rss_bytes_ratio": r["max_rss_bytes"] / base["max_rss_bytes"],
        "ttft_ratio": r["ttft_s"] / base["ttft_s"],
        "ttft_sp_ratio": r["ttft_sp_s"] / base["ttft_s"] if "ttft_sp_s" in r else None,
        "collective_share": r["profile"]["collective_share"],
    }


def format_tp_run(r: dict[str, Any]) -> str:
    """One line of one configuration's figures (tok/s, ms, MiB, collective share)."""
    decode = "  ".join(f"B={b} {d['decode_tok_s']:6.1f}" for b, d in r["decode"].items())
    sp = f" / SP {r['ttft_sp_s'] * 1e3:6.1f}" if "ttft_sp_s" in r else " / SP failed" if "sp_error" in r else ""
    return (
        f"tp={r['tp_degree']} threads/rank={r['threads']} {r['backend']} {r['dtype']}  decode tok/s {decode}  "
        f"TTFT({r['prompt_len']}) {r['ttft_s'] * 1e3:6.1f}{sp} ms  "
        f"weights/rank {r['max_weights_bytes'] / 2**20:6.1f} MiB  RSS/rank {r['max_rss_bytes'] / 2**20:6.1f} MiB  "
        f"collectives {r['profile']['collective_share'] * 100:4.1f}% of decode step "
        f"({r['profile']['collective_s_per_step'] * 1e3:.2f} of {r['profile']['step_wall_s'] * 1e3:.2f} ms)  "
        f"compile {r['compile_s']:.0f} s"
    )


def format_tp_ratio(q: dict[str, Any], r: dict[str, Any]) -> str:
    """One line of :func:`tp_ratio`, each ratio marked against its target."""
    decode = "  ".join(f"B={b} x{v:.2f}{'' if v >= 0.85 else ' (<0.85)'}" for b, v in q["decode_tok_s_ratio"].items())
    w = q["weights_bytes_ratio"]
    if q["ttft_sp_ratio"] is None:
        sp = f"SP failed ({r.get('sp_error', 'not run')})"
    else:
        sp = f"x{q['ttft_sp_ratio']:.2f} with SP ({r['ttft_s'] * 1e3:.1f} vs {r['ttft_sp_s'] * 1e3:.1f} ms)"
    return (
        f"tp={q['tp_degree']} / tp=1: decode tok/s {decode}  weights/rank x{w:.2f}{'' if w <= 0.55 else ' (>0.55)'}  "
        f"RSS/rank x{q['rss_bytes_ratio']:.2f}  TTFT x{q['ttft_ratio']:.2f} without SP, {sp}  "
        f"collectives {q['collective_share'] * 100:.1f}% of decode step"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Check the sizes, then measure (the ranks read the checkpoint themselves)."""
    check_at_least("tp_degree", args.tp_degree, 1)
    check_at_least("batch_sizes", args.batch_sizes, 1)
    check_at_least("prompt_lens", args.prompt_lens, 1)
    check_at_least("gen_lens", args.gen_lens, 2)
    return run_tp_bench(args.model or checkpoints.default_model_path(), args.tp_degree, args.backend, args.dtype, args.batch_sizes,
                        gen_len=args.gen_lens[0], prompt_len=args.prompt_lens[0], log=logger(args))


BENCHMARK = Benchmark(name="tensor-parallel", help="tensor parallelism against one process: decode tok/s, TTFT (with and "
                      "without sequence parallel), memory per rank, collective share", description=__doc__,
                      add_arguments=add_arguments, run=run)
