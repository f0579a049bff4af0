"""Prefix caching on SmolLM2-135M (the default model's GGUF), one run, every figure:

1. TTFT of requests that share a ``--system-tokens`` (512) system prompt and differ in a
   ``--question-tokens`` (32) question, p50 over ``--requests`` requests: cold (an empty prefix
   cache: a fresh state per request), warm (the system prompt cached by one earlier request),
   and with prefix caching off (a runtime compiled without it). Target: warm >= 3x lower than cold.
2. Throughput with no shared prefix (``--throughput-requests`` distinct random prompts of
   ``--prompt-tokens`` tokens, ``--gen-tokens`` generated each, ``--batch-size`` slots): generated
   tokens per second with prefix caching on vs off in ``--repeat`` rounds, the order of the
   runtimes rotating each round; the figure is the median of the rounds' on/off ratios. Target:
   on >= 0.97x off.

TTFT is the wall time from submitting a request to the scheduler until its first token event
(``scheduler.step`` iterations, as the server's engine runs them), greedy, one request at a time.
Both runtimes have the same plan but ``enable_prefix_caching`` (same ``prefill_chunk_size``), so
the comparison is of prefix caching alone. Every warm request's tokens are checked against its
cold run (greedy, identical).

Usage: PYTHONPATH=. .venv/bin/python scripts/bench_prefix_caching.py [--backend inductor] [--threads 2]
Shortened check: ... --requests 3 --throughput-requests 2 --gen-tokens 8 --repeat 1 --backend eager
"""

from __future__ import annotations

import argparse
import statistics
import time

import attrs
import torch

import neuronfx
from neuronfx.io.checkpoints import default_model_path, load_checkpoint
from neuronfx.runtime.prefix import prefix_stats
from neuronfx.runtime.scheduler import Queue, Request, step, submit

GREEDY = neuronfx.SamplingParams(temperature=0.0, ignore_eos=True)


def random_tokens(n: int, seed: int, vocab: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(100, vocab, (n,), generator=g).tolist())  # skip the low (special) ids


def ttft(runtime: neuronfx.Runtime, state: neuronfx.State, prompt: tuple[int, ...]) -> tuple[float, int, neuronfx.State]:
    """(seconds from submit to the first token event, that token, the state after the request)."""
    queue = submit(Queue(), 0, Request(prompt=prompt, sampling=attrs.evolve(GREEDY, max_tokens=1)))
    t0 = time.perf_counter()
    first, seconds = None, 0.0
    while not queue.idle:
        events, state, queue = step(runtime, state, queue, frozenset())
        if first is None and events:
            seconds, first = time.perf_counter() - t0, events[0].token_id
    return seconds, first, state


def ttft_runs(on: neuronfx.Runtime, off: neuronfx.Runtime, args: argparse.Namespace, vocab: int) -> dict:
    system = random_tokens(args.system_tokens, 1, vocab)
    prompts = [system + random_tokens(args.question_tokens, 100 + i, vocab) for i in range(args.requests)]
    for rt in (on, off):  # warm the graphs (inductor's first call) outside the timings
        ttft(rt, neuronfx.init_state(rt), random_tokens(len(prompts[0]), 99, vocab))
    cold, cold_tokens = [], []
    for p in prompts:
        state = neuronfx.init_state(on)  # an empty prefix cache
        s, tok, _ = ttft(on, state, p)
        cold.append(s)
        cold_tokens.append(tok)
    off_s = [ttft(off, neuronfx.init_state(off), p)[0] for p in prompts]
    state = neuronfx.init_state(on)
    _, _, state = ttft(on, state, system + random_tokens(args.question_tokens, 99, vocab))  # caches the system prompt
    warm, warm_tokens = [], []
    for p in prompts:
        s, tok, state = ttft(on, state, p)
        warm.append(s)
        warm_tokens.append(tok)
    stats = prefix_stats(state)
    return {"cold": statistics.median(cold), "warm": statistics.median(warm), "off": statistics.median(off_s),
            "same_tokens": cold_tokens == warm_tokens, "hit_rate": stats.hits / stats.queries}


def throughput(runtime: neuronfx.Runtime, prompts: list[tuple[int, ...]], gen: int) -> float:
    """Generated tokens per second of one schedule of ``prompts`` (fresh state)."""
    requests = [Request(prompt=p, sampling=attrs.evolve(GREEDY, max_tokens=gen)) for p in prompts]
    state = neuronfx.init_state(runtime)
    t0 = time.perf_counter()
    n = sum(1 for e in neuronfx.schedule(runtime, state, requests, frozenset()) if isinstance(e, neuronfx.TokenEvent))
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct's GGUF)")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=9, help="requests per TTFT figure (p50)")
    ap.add_argument("--chunk", type=int, default=128, help="prefill_chunk_size")
    ap.add_argument("--block", type=int, default=16, help="prefix_block_size")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--throughput-requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=7, help="alternating off/on throughput pairs")
    ap.add_argument("--control", action="store_true", help="also a second runtime without prefix caching in every round")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    ckpt = load_checkpoint(args.model or default_model_path())
    vocab = ckpt.config.vocab_size
    longest = max(args.system_tokens + args.question_tokens, args.prompt_tokens)
    ctx = 1 << (longest - 1).bit_length()
    base = dict(backend=args.backend, batch_size=args.batch_size, max_context_length=ctx,
                sequence_length=ctx + max(args.gen_tokens, 16), prefill_chunk_size=args.chunk, prefix_block_size=args.block)
    runtimes = {}
    sides = (("on", True), ("off", False)) + ((("control", False),) if args.control else ())
    for name, on in sides:
        t0 = time.perf_counter()
        plan = neuronfx.make_plan(ckpt.config, neuronfx.InferenceConfig(enable_prefix_caching=on, **base))
        runtimes[name] = neuronfx.compile(plan, ckpt.state_dict, progress=False)
        print(f"compiled prefix caching {name}: {time.perf_counter() - t0:.0f} s")

    t = ttft_runs(runtimes["on"], runtimes["off"], args, vocab)
    print(f"TTFT p50, {args.system_tokens}-token shared system prompt + {args.question_tokens}-token question, "
          f"{args.requests} requests ({args.backend}, {args.threads} threads, chunk {args.chunk}, block {args.block}):")
    print(f"  prefix caching off {t['off'] * 1e3:.1f} ms; cold cache {t['cold'] * 1e3:.1f} ms; warm cache {t['warm'] * 1e3:.1f} ms")
    print(f"  warm vs cold: {t['cold'] / t['warm']:.2f}x lower (target >= 3x: {'met' if t['cold'] / t['warm'] >= 3 else 'NOT met'}); "
          f"warm hit rate {t['hit_rate']:.0%}; warm tokens == cold tokens: {t['same_tokens']}")

    prompts = [random_tokens(args.prompt_tokens, 1000 + i, vocab) for i in range(args.throughput_requests)]
    runs: dict[str, list[float]] = {name: [] for name, _ in sides}
    names = ("off", "control", "on") if args.control else ("off", "on")
    for i in range(args.repeat):  # alternating rounds: every side sees the same drift of a shared machine
        # The order rotates each round: a run measured 0.95x slower in second place than in first
        # (two identical runtimes, 2026-12-02), so a fixed order would bias the ratio.
        for name in names[i % len(names):] + names[:i % len(names)]:
            runs[name].append(throughput(runtimes[name], prompts, args.gen_tokens))
    pairs = [on / off for on, off in zip(runs["on"], runs["off"])]
    ratio = statistics.median(pairs)
    print(f"throughput, no shared prefix ({args.throughput_requests} requests x {args.prompt_tokens} prompt + "
          f"{args.gen_tokens} generated tokens, {args.batch_size} slots, {args.repeat} rounds, order rotating):")
    print(f"  off {' '.join(f'{x:.1f}' for x in runs['off'])} tok/s; on {' '.join(f'{x:.1f}' for x in runs['on'])} tok/s")
    print(f"  on/off per round {' '.join(f'{x:.3f}' for x in pairs)}: median {ratio:.3f}x (target >= 0.97x: "
          f"{'met' if ratio >= 0.97 else 'NOT met'}); best on / best off {max(runs['on']) / max(runs['off']):.3f}x")
    if args.control:  # what two identical runtimes without caching differ by: the noise floor of the ratio
        control = statistics.median(c / off for c, off in zip(runs["control"], runs["off"]))
        print(f"  control (a second runtime without caching) {' '.join(f'{x:.1f}' for x in runs['control'])} tok/s; "
              f"control/off median {control:.3f}x; on vs the median of both off runtimes "
              f"{statistics.median(runs['on']) / statistics.median(runs['off'] + runs['control']):.3f}x")


if __name__ == "__main__":
    main()
