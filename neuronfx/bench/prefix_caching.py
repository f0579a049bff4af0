"""``neuronfx bench prefix-caching``: prefix caching, every figure in one run.

1. TTFT of requests that share a --system-tokens system prompt and differ in a
   --question-tokens question, p50 over --requests requests: cold (an empty prefix cache: a
   fresh state per request), warm (the system prompt cached by one earlier request), and with
   prefix caching off (a runtime compiled without it). Target: warm >= 3x lower than cold.
2. Throughput with no shared prefix (--throughput-requests distinct random prompts of
   --prompt-tokens tokens, --gen-tokens generated each, --batch-size slots): generated tokens
   per second with prefix caching on and off in --repeat rounds, the order rotating each round
   (a run measured 0.95x slower in second place than in first); the figure is the median of
   the rounds' on/off ratios. Target: on >= 0.97x off. --control adds a second runtime without
   caching to every round: the noise floor of the ratio.

3. With --layouts (instead of 1 and 2): warm-hit TTFT p50 of the slots layout (a hit copies
   the cached blocks into the request's slot) against the blocks layout (a hit puts them in its
   block table), prefix caching on in both, each layout's cache warmed by one request, the
   --requests requests alternating between the layouts, which layout goes first alternating
   too. Target: blocks <= 1.0x slots. Every request's first token is checked across layouts.

TTFT is the wall time from submitting a request to the scheduler until its first token event
(scheduler iterations, as the server's engine runs them), greedy, one request at a time. Both
runtimes have the same plan but ``enable_prefix_caching``, so the comparison is of prefix
caching alone. Every warm request's first token is checked against its cold run."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import attrs

import neuronfx
from neuronfx.bench.options import Log, add_engine, add_model, add_threads, check_at_least, logger, set_threads
from neuronfx.bench.types import Benchmark
from neuronfx.bench.workload import random_ids
from neuronfx.config.kv import KV_LAYOUTS
from neuronfx.errors import InputError
from neuronfx.io import checkpoints
from neuronfx.runtime.scheduler import Queue, step, submit

GREEDY = neuronfx.SamplingParams(temperature=0.0, ignore_eos=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --backend, --dtype, --threads, the workload's sizes and --control."""
    add_model(p)
    add_engine(p, backend="inductor")
    add_threads(p)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=9, help="requests per TTFT figure (p50)")
    p.add_argument("--chunk", type=int, default=128, help="prefill_chunk_size")
    p.add_argument("--block", type=int, default=16, help="prefix_block_size")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--throughput-requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=7, help="rounds of the throughput runs, the order rotating")
    p.add_argument("--control", action="store_true", help="also a second runtime without prefix caching in every round")
    p.add_argument("--kv-layout", choices=KV_LAYOUTS, default="slots",
                   help="the KV layout of every runtime: slots (a hit copies its blocks in) or blocks (a hit shares them)")
    p.add_argument("--layouts", action="store_true",
                   help="instead: warm-hit TTFT of the slots layout against the blocks layout (prefix caching on in both, "
                        "requests alternating; figure 3 of the module doc)")


def tokens(n: int, seed: int, vocab: int) -> tuple[int, ...]:
    """``n`` seeded random token ids, as a prompt."""
    return tuple(random_ids(vocab, n, seed))


def ttft(runtime: neuronfx.Runtime, state: neuronfx.State, prompt: tuple[int, ...]) -> tuple[float, int, neuronfx.State]:
    """(seconds from submit to the first token event, that token, the state after the request)."""
    queue = submit(Queue(), 0, neuronfx.Request(prompt=prompt, sampling=attrs.evolve(GREEDY, max_tokens=1)))
    t0 = time.perf_counter()
    first, seconds = None, 0.0
    while not queue.idle:
        events, state, queue = step(runtime, state, queue, frozenset())
        if first is None and events:
            seconds, first = time.perf_counter() - t0, events[0].token_id
    return seconds, first, state


def ttft_runs(on: neuronfx.Runtime, off: neuronfx.Runtime, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Figure 1 of the module docstring: TTFT p50 cold, warm and off (seconds), the warm hit rate."""
    system = tokens(args.system_tokens, 1, vocab)
    prompts = [system + tokens(args.question_tokens, 100 + i, vocab) for i in range(args.requests)]
    for rt in (on, off):  # warm the graphs (inductor's first call) outside the timings
        ttft(rt, neuronfx.init_state(rt), tokens(len(prompts[0]), 99, vocab))
    cold = [ttft(on, neuronfx.init_state(on), p)[:2] for p in prompts]  # a fresh state: an empty prefix cache
    off_s = [ttft(off, neuronfx.init_state(off), p)[0] for p in prompts]
    _, _, state = ttft(on, neuronfx.init_state(on), system + tokens(args.question_tokens, 99, vocab))  # caches the system prompt
    warm = []
    for p in prompts:
        s, tok, state = ttft(on, state, p)
        warm.append((s, tok))
    stats = neuronfx.prefix_stats(state)
    return {"cold_s": statistics.median(s for s, _ in cold), "warm_s": statistics.median(s for s, _ in warm),
            "off_s": statistics.median(off_s), "same_tokens": [t for _, t in cold] == [t for _, t in warm],
            "hit_rate": stats.hits / stats.queries}


def throughput(runtime: neuronfx.Runtime, prompts: list[tuple[int, ...]], gen: int) -> float:
    """Generated tokens per second of one schedule of ``prompts`` (fresh state)."""
    requests = [neuronfx.Request(prompt=p, sampling=attrs.evolve(GREEDY, max_tokens=gen)) for p in prompts]
    t0 = time.perf_counter()
    n = sum(1 for e in neuronfx.schedule(runtime, neuronfx.init_state(runtime), requests, frozenset())
            if isinstance(e, neuronfx.TokenEvent))
    return n / (time.perf_counter() - t0)


def throughput_runs(runtimes: dict[str, neuronfx.Runtime], args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Figure 2: tok/s per runtime per round, the order rotating; the median on/off ratio."""
    prompts = [tokens(args.prompt_tokens, 1000 + i, vocab) for i in range(args.throughput_requests)]
    names = ("off", "control", "on") if "control" in runtimes else ("off", "on")
    runs: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.repeat):
        for name in names[i % len(names):] + names[:i % len(names)]:
            runs[name].append(throughput(runtimes[name], prompts, args.gen_tokens))
    out: dict[str, Any] = {"tok_s": runs, "on_off_ratios": [a / b for a, b in zip(runs["on"], runs["off"])]}
    out["median_ratio"] = statistics.median(out["on_off_ratios"])
    if "control" in runs:
        out["control_off_median"] = statistics.median(c / o for c, o in zip(runs["control"], runs["off"]))
    return out


def plan_options(args: argparse.Namespace, kv_layout: str) -> dict[str, Any]:
    """The InferenceConfig fields every runtime shares, but prefix caching, in ``kv_layout``."""
    longest = max(args.system_tokens + args.question_tokens, args.prompt_tokens)
    ctx = 1 << (longest - 1).bit_length()
    return dict(backend=args.backend, dtype=args.dtype, batch_size=args.batch_size, max_context_length=ctx,
                sequence_length=ctx + max(args.gen_tokens, 16), prefill_chunk_size=args.chunk, prefix_block_size=args.block,
                kv_layout=kv_layout) | ({"kv_block_size": args.block} if kv_layout == "blocks" else {})


def compile_runtimes(ckpt: Any, sides: dict[str, dict[str, Any]], log: Log) -> dict[str, neuronfx.Runtime]:
    """One runtime per name of ``sides`` (its InferenceConfig fields)."""
    runtimes = {}
    for name, options in sides.items():
        t0 = time.perf_counter()
        runtimes[name] = neuronfx.compile(neuronfx.make_plan(ckpt.config, neuronfx.InferenceConfig(**options)), ckpt.state_dict,
                                          progress=False)
        log(f"compiled {name}: {time.perf_counter() - t0:.0f} s")
    return runtimes


def compile_sides(ckpt: Any, args: argparse.Namespace, log: Log) -> dict[str, neuronfx.Runtime]:
    """The runtimes with prefix caching on and off (and the control), the same plan otherwise."""
    base = plan_options(args, args.kv_layout)
    sides = {"on": base | {"enable_prefix_caching": True}, "off": base} | ({"control": base} if args.control else {})
    return compile_runtimes(ckpt, sides, log)


def layout_ttft(runtimes: dict[str, neuronfx.Runtime], args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Figure 3 of the module docstring: warm-hit TTFT p50 per layout (seconds), blocks / slots."""
    system = tokens(args.system_tokens, 1, vocab)
    prompts = [system + tokens(args.question_tokens, 100 + i, vocab) for i in range(args.requests)]
    states = {}
    for name, rt in runtimes.items():
        ttft(rt, neuronfx.init_state(rt), tokens(len(prompts[0]), 99, vocab))  # the graphs' first calls, untimed
        states[name] = ttft(rt, neuronfx.init_state(rt), system + tokens(args.question_tokens, 99, vocab))[2]  # caches the system prompt
    warm: dict[str, list[tuple[float, int]]] = {name: [] for name in runtimes}
    names = list(runtimes)
    for i, prompt in enumerate(prompts):
        for name in names[i % 2:] + names[:i % 2]:
            seconds, first, states[name] = ttft(runtimes[name], states[name], prompt)
            warm[name].append((seconds, first))
    p50 = {name: statistics.median(s for s, _ in runs) for name, runs in warm.items()}
    hits = {name: neuronfx.prefix_stats(state) for name, state in states.items()}
    return {"warm_s": p50, "ratio": p50["blocks"] / p50["slots"], "hit_rate": {n: h.hits / h.queries for n, h in hits.items()},
            "same_tokens": [t for _, t in warm["slots"]] == [t for _, t in warm["blocks"]]}


def layout_report(t: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Figure 3 as lines, the target marked met or not."""
    return [f"warm-hit TTFT p50, {args.system_tokens}-token cached system prompt + {args.question_tokens}-token question, "
            f"{args.requests} requests per layout, alternating ({args.backend}, chunk {args.chunk}, block {args.block}):",
            f"  slots (a hit copies its blocks) {t['warm_s']['slots'] * 1e3:.1f} ms; blocks (a hit shares them) "
            f"{t['warm_s']['blocks'] * 1e3:.1f} ms",
            f"  blocks / slots {t['ratio']:.3f}x (target <= 1.0x: {'met' if t['ratio'] <= 1.0 else 'NOT met'}); hit rates "
            f"{t['hit_rate']['slots']:.0%} / {t['hit_rate']['blocks']:.0%}; first tokens equal: {t['same_tokens']}"]


def report(t: dict[str, Any], tp: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """The figures as lines, each target marked met or not."""
    warm_x = t["cold_s"] / t["warm_s"]
    lines = [f"TTFT p50, {args.system_tokens}-token shared system prompt + {args.question_tokens}-token question, {args.requests} "
             f"requests ({args.backend}, chunk {args.chunk}, block {args.block}, KV layout {args.kv_layout}):",
             f"  prefix caching off {t['off_s'] * 1e3:.1f} ms; cold cache {t['cold_s'] * 1e3:.1f} ms; warm cache {t['warm_s'] * 1e3:.1f} ms",
             f"  warm vs cold: {warm_x:.2f}x lower (target >= 3x: {'met' if warm_x >= 3 else 'NOT met'}); warm hit rate "
             f"{t['hit_rate']:.0%}; warm tokens == cold tokens: {t['same_tokens']}",
             f"throughput, no shared prefix ({args.throughput_requests} requests x {args.prompt_tokens} prompt + {args.gen_tokens} "
             f"generated tokens, {args.batch_size} slots, {args.repeat} rounds, order rotating):"]
    lines += [f"  {name} " + " ".join(f"{x:.1f}" for x in values) + " tok/s" for name, values in tp["tok_s"].items()]
    lines.append(f"  on/off per round {' '.join(f'{x:.3f}' for x in tp['on_off_ratios'])}: median {tp['median_ratio']:.3f}x "
                 f"(target >= 0.97x: {'met' if tp['median_ratio'] >= 0.97 else 'NOT met'})")
    if "control_off_median" in tp:
        lines.append(f"  control/off median {tp['control_off_median']:.3f}x (the noise floor of the ratio)")
    return lines


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Check the sizes, compile both sides, measure both figures."""
    for name in ("system_tokens", "question_tokens", "requests", "chunk", "block", "batch_size", "throughput_requests",
                 "prompt_tokens", "gen_tokens", "repeat"):
        check_at_least(name, getattr(args, name), 1)
    set_threads(args.threads)
    log = logger(args)
    if args.layouts and (args.control or args.kv_layout != "slots"):
        raise InputError("--layouts compiles one runtime per KV layout and no control; drop --control and --kv-layout.")
    ckpt = checkpoints.load_checkpoint(args.model or checkpoints.default_model_path())
    if args.layouts:
        sides = {layout: plan_options(args, layout) | {"enable_prefix_caching": True} for layout in ("slots", "blocks")}
        t = layout_ttft(compile_runtimes(ckpt, sides, log), args, ckpt.config.vocab_size)
        for line in layout_report(t, args):
            log(line)
        return {"layouts": t}
    runtimes = compile_sides(ckpt, args, log)
    t = ttft_runs(runtimes["on"], runtimes["off"], args, ckpt.config.vocab_size)
    tp = throughput_runs(runtimes, args, ckpt.config.vocab_size)
    for line in report(t, tp, args):
        log(line)
    return {"ttft": t, "throughput": tp}


BENCHMARK = Benchmark(name="prefix-caching", help="TTFT with a shared system prompt (cold, warm, off) and throughput with no "
                      "shared prefix (on against off)", description=__doc__, add_arguments=add_arguments, run=run)
