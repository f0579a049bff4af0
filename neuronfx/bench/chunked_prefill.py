"""``neuronfx bench chunked-prefill``: chunked prefill keeps running requests' inter-token
latency bounded while a long prompt is admitted.

Four requests (short prompts of real text) decode; once each has 4 tokens, a --long-prompt
prompt arrives. The inter-token latency (ITL) of the four, from that arrival until the long
request's first token, is measured on two runtimes with --max-context-length:

- chunked: ``prefill_chunk_size`` = --chunk-size (prefill graphs stop there; the scheduler runs
  one chunk of the long prompt per iteration beside the decode step);
- unchunked: prefill buckets up to --max-context-length (the long prompt is prefilled in one
  pass, during which nobody decodes).

Both have batch buckets (1, 4, 5) (the long prompt prefills at batch 1, the four decode at 4,
all five at 5) and decode buckets (256, sequence_length). Each scenario runs --rounds times (the
first warms the graphs up) and the last round is reported: ITL p50 / p99 / max of the four, the
long prompt's time to first token, and the scheduler iterations the admission took."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import attrs

import neuronfx
from neuronfx.bench.options import add_engine, add_model, add_threads, check_at_least, logger, set_threads
from neuronfx.bench.types import Benchmark
from neuronfx.bench.workload import default_text
from neuronfx.errors import InputError
from neuronfx.io import checkpoints
from neuronfx.runtime.scheduler import Queue, step, submit

RUNNING = 4
SHORT_PROMPT = 64  # tokens of each running request's prompt


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --backend, --dtype, --threads and the scenario's sizes."""
    add_model(p)
    add_engine(p, backend="inductor")
    add_threads(p)
    p.add_argument("--chunk-size", type=int, default=128)
    p.add_argument("--long-prompt", type=int, default=2000, help="tokens of the prompt admitted while the others decode")
    p.add_argument("--max-context-length", type=int, default=2048)
    p.add_argument("--short-tokens", type=int, default=64, help="tokens each running request generates at most")
    p.add_argument("--rounds", type=int, default=2, help="runs of each scenario; the last is reported (the first warms up)")


def runtime(ckpt: Any, args: argparse.Namespace, chunked: bool) -> neuronfx.Runtime:
    """The chunked or unchunked runtime of the module docstring."""
    ctx = args.max_context_length
    seq = ctx + args.short_tokens
    options = dict(batch_size=RUNNING + 1, batch_buckets=(1, RUNNING, RUNNING + 1), max_context_length=ctx, sequence_length=seq,
                   decode_buckets=tuple(sorted({min(256, seq), seq})), backend=args.backend, dtype=args.dtype)
    options |= dict(prefill_chunk_size=args.chunk_size) if chunked else dict(prefill_buckets=(args.chunk_size, ctx))
    return neuronfx.compile(neuronfx.make_plan(ckpt.config, neuronfx.InferenceConfig(**options)), ckpt.state_dict, progress=False)


def start_running(rt: neuronfx.Runtime, short: list[list[int]], short_tokens: int) -> tuple[Any, Queue, dict[int, float]]:
    """The four short requests, run until each has 4 tokens: (state, queue, each one's last token time)."""
    greedy = neuronfx.SamplingParams(ignore_eos=True)
    state, queue = neuronfx.init_state(rt), Queue()
    for i, p in enumerate(short):
        queue = submit(queue, i, neuronfx.Request(prompt=tuple(p), sampling=attrs.evolve(greedy, max_tokens=short_tokens)))
    last: dict[int, float] = {}
    counts = dict.fromkeys(range(RUNNING), 0)
    while min(counts.values()) < 4:
        events, state, queue = step(rt, state, queue, frozenset())
        for e in events:
            counts[e.index] += 1
            last[e.index] = time.perf_counter()
    return state, queue, last


def scenario(rt: neuronfx.Runtime, short: list[list[int]], long: list[int], short_tokens: int) -> dict[str, Any]:
    """Admit ``long`` while the four decode: their ITL until its first token (ms), its TTFT (s)
    and the iterations it took."""
    state, queue, last = start_running(rt, short, short_tokens)
    queue = submit(queue, RUNNING, neuronfx.Request(prompt=tuple(long), sampling=neuronfx.SamplingParams(ignore_eos=True, max_tokens=4)))
    arrival, gaps, iterations, first = time.perf_counter(), [], 0, None
    while first is None:
        events, state, queue = step(rt, state, queue, frozenset())
        now, iterations = time.perf_counter(), iterations + 1
        for e in events:
            if e.index == RUNNING:
                first = now
            elif e.token_id is not None:
                gaps.append(now - last[e.index])
                last[e.index] = now
        if first is None and not queue.running:
            raise InputError("the running requests finished before the long prompt was admitted; raise --short-tokens.")
    gaps.sort()
    return {"itl_p50_ms": statistics.median(gaps) * 1e3, "itl_p99_ms": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] * 1e3,
            "itl_max_ms": gaps[-1] * 1e3, "ttft_long_s": first - arrival, "iterations": iterations, "itl_samples": len(gaps)}


def check_options(args: argparse.Namespace) -> None:
    """InputError for sizes below 1 and a long prompt the plan cannot hold."""
    for name in ("chunk_size", "long_prompt", "max_context_length", "short_tokens", "rounds"):
        check_at_least(name, getattr(args, name), 1)
    if args.long_prompt > args.max_context_length:
        raise InputError(f"--long-prompt={args.long_prompt} is longer than --max-context-length={args.max_context_length}; "
                         "lower it or raise --max-context-length.")


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """The table of both scenarios (ms, s, iterations, graphs) and the ratios."""
    c, u = results["chunked"], results["unchunked"]
    lines = [f"{args.backend}: ITL of {RUNNING} running requests while a {args.long_prompt}-token prompt is admitted "
             f"(max_context_length {args.max_context_length})",
             f"{'':24}{'ITL p50 ms':>12}{'ITL p99 ms':>12}{'ITL max ms':>12}{'long TTFT s':>13}{'iterations':>12}{'graphs':>8}"]
    for label, r in ((f"chunked ({args.chunk_size})", c), ("unchunked", u)):
        lines.append(f"{label:24}{r['itl_p50_ms']:12.1f}{r['itl_p99_ms']:12.1f}{r['itl_max_ms']:12.1f}{r['ttft_long_s']:13.2f}"
                     f"{r['iterations']:12d}{r['graphs']:8d}")
    lines.append(f"ITL p99: {u['itl_p99_ms'] / c['itl_p99_ms']:.1f}x lower with chunking; the long prompt's TTFT "
                 f"{c['ttft_long_s'] / u['ttft_long_s']:.2f}x the unchunked one")
    return lines


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both scenarios on the same prompts (cut from the shipped text), the last round of each."""
    check_options(args)
    set_threads(args.threads)
    path = args.model or checkpoints.default_model_path()
    ckpt, tokenizer = checkpoints.load_checkpoint(path), checkpoints.load_tokenizer(path)
    text = default_text()
    ids = tokenizer(text * (1 + (args.long_prompt + 1500) * 5 // len(text)))["input_ids"]
    long, short = ids[:args.long_prompt], [ids[1000 + 97 * i: 1000 + 97 * i + SHORT_PROMPT] for i in range(RUNNING)]
    results = {}
    for name, chunked in (("chunked", True), ("unchunked", False)):
        t0 = time.perf_counter()
        rt = runtime(ckpt, args, chunked)
        compile_s = time.perf_counter() - t0
        for _ in range(args.rounds):
            results[name] = scenario(rt, short, long, args.short_tokens)
        results[name] |= {"compile_s": compile_s, "graphs": len(rt.plan.graphs)}
    log = logger(args)
    for line in report(results, args):
        log(line)
    return results


BENCHMARK = Benchmark(name="chunked-prefill", help="running requests' ITL while a long prompt is admitted, chunked against "
                      "unchunked prefill", description=__doc__, add_arguments=add_arguments, run=run)
