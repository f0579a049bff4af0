"""Chunked prefill keeps running requests' inter-token latency bounded while a long prompt is admitted.

One run prints both figures. Four requests (short prompts of real text) decode; once each has
a few tokens, a 2000-token prompt arrives. The inter-token latency (ITL) of the four, from that
arrival until the long request's first token, is measured on two runtimes of SmolLM2-135M-Instruct
(the default GGUF, as ``neuronfx generate`` finds it) with max_context_length 2048:

- chunked: ``prefill_chunk_size=128`` (prefill graphs stop at 128; the scheduler runs one chunk of
  the long prompt per iteration beside the decode step, token budget ``prefill_chunk_size +
  batch_size``);
- unchunked: prefill buckets up to 2048 (the long prompt is prefilled in one pass, during which
  nobody decodes).

Both have batch buckets (1, 4, 5) (the long prompt prefills at batch 1, the four decode at 4, all
five at 5) and decode buckets (256, sequence_length). Each scenario runs ``--rounds`` times (the
first warms the graphs up) and the last round is reported: ITL p50 / p99 / max of the four, the
long prompt's time to first token, and the scheduler iterations the admission took.

Usage: PYTHONPATH=. .venv/bin/python scripts/bench_chunked_prefill.py [--threads 2] [--backend inductor]
Shortened check: ... --backend eager --long-prompt 300 --max-context-length 512 --short-tokens 24 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import attrs
import torch

import neuronfx
from neuronfx.io.checkpoints import default_model_path, load_checkpoint, load_tokenizer
from neuronfx.runtime.scheduler import Queue, Request, step, submit

TEXT = (Path(neuronfx.__file__).parent / "data" / "bench_text.txt").read_text()
RUNNING = 4
SHORT_PROMPT = 64  # tokens of each running request's prompt


def runtime(ckpt: object, args: argparse.Namespace, chunked: bool) -> neuronfx.Runtime:
    """SmolLM2 with max_context_length ``args.max_context_length``, chunked or not (see the module doc)."""
    ctx = args.max_context_length
    seq = ctx + args.short_tokens
    options = dict(batch_size=RUNNING + 1, batch_buckets=(1, RUNNING, RUNNING + 1), max_context_length=ctx, sequence_length=seq,
                   decode_buckets=(256, seq), backend=args.backend)
    if chunked:
        options |= dict(prefill_chunk_size=args.chunk_size)
    else:
        options |= dict(prefill_buckets=(args.chunk_size, ctx))
    inference = neuronfx.InferenceConfig(**options)
    return neuronfx.compile(neuronfx.make_plan(ckpt.config, inference), ckpt.state_dict, progress=False)


def scenario(rt: neuronfx.Runtime, short: list[list[int]], long: list[int], short_tokens: int) -> dict:
    """Run the four short requests, admit ``long`` once each has 4 tokens; ITL of the four while
    it is admitted (its arrival to its first token), its TTFT, and the iterations it took."""
    greedy = neuronfx.SamplingParams(ignore_eos=True)
    state, queue, eos = neuronfx.init_state(rt), Queue(), frozenset()
    for i, p in enumerate(short):
        queue = submit(queue, i, Request(prompt=tuple(p), sampling=attrs.evolve(greedy, max_tokens=short_tokens)))
    last: dict[int, float] = {}
    counts = dict.fromkeys(range(RUNNING), 0)
    while min(counts.values()) < 4:
        events, state, queue = step(rt, state, queue, eos)
        now = time.perf_counter()
        for e in events:
            counts[e.index] += 1
            last[e.index] = now
    queue = submit(queue, RUNNING, Request(prompt=tuple(long), sampling=attrs.evolve(greedy, max_tokens=4)))
    arrival, gaps, iterations, first = time.perf_counter(), [], 0, None
    while first is None:
        events, state, queue = step(rt, state, queue, eos)
        now, iterations = time.perf_counter(), iterations + 1
        for e in events:
            if e.index == RUNNING:
                first = now
            elif e.token_id is not None:
                gaps.append(now - last[e.index])
                last[e.index] = now
        if first is None and not queue.running:
            raise RuntimeError("the running requests finished before the long prompt was admitted; raise --short-tokens")
    gaps.sort()
    return {"itl_p50_ms": statistics.median(gaps) * 1e3, "itl_p99_ms": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] * 1e3,
            "itl_max_ms": gaps[-1] * 1e3, "ttft_long_s": first - arrival, "iterations": iterations, "itl_samples": len(gaps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct's GGUF)")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk-size", type=int, default=128)
    ap.add_argument("--long-prompt", type=int, default=2000, help="tokens of the prompt admitted while the others decode")
    ap.add_argument("--max-context-length", type=int, default=2048)
    ap.add_argument("--short-tokens", type=int, default=64, help="tokens each running request generates at most")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each scenario; the last is reported (the first warms up)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    ckpt, tokenizer = load_checkpoint(path), load_tokenizer(path)
    ids = tokenizer(TEXT * (1 + args.long_prompt * 5 // len(TEXT)))["input_ids"]
    long = ids[:args.long_prompt]
    short = [ids[1000 + 97 * i: 1000 + 97 * i + SHORT_PROMPT] for i in range(RUNNING)]
    results = {}
    for name, chunked in (("chunked", True), ("unchunked", False)):
        t0 = time.perf_counter()
        rt = runtime(ckpt, args, chunked)
        compile_s = time.perf_counter() - t0
        for _ in range(args.rounds):
            results[name] = scenario(rt, short, long, args.short_tokens)
        results[name]["compile_s"] = compile_s
        results[name]["graphs"] = len(rt.plan.graphs)
        del rt
    if args.json:
        print(json.dumps({"args": vars(args), **results}))
        return
    print(f"SmolLM2-135M-Instruct, {args.backend}, {args.threads} threads: ITL of {RUNNING} running requests while a "
          f"{args.long_prompt}-token prompt is admitted (max_context_length {args.max_context_length})")
    print(f"{'':24}{'ITL p50 ms':>12}{'ITL p99 ms':>12}{'ITL max ms':>12}{'long TTFT s':>13}{'iterations':>12}{'graphs':>8}")
    for name, label in (("chunked", f"chunked ({args.chunk_size})"), ("unchunked", "unchunked")):
        r = results[name]
        print(f"{label:24}{r['itl_p50_ms']:12.1f}{r['itl_p99_ms']:12.1f}{r['itl_max_ms']:12.1f}{r['ttft_long_s']:13.2f}"
              f"{r['iterations']:12d}{r['graphs']:8d}")
    c, u = results["chunked"], results["unchunked"]
    print(f"ITL p99: {u['itl_p99_ms'] / c['itl_p99_ms']:.1f}x lower with chunking; the long prompt's TTFT "
          f"{c['ttft_long_s'] / u['ttft_long_s']:.2f}x the unchunked one")


if __name__ == "__main__":
    main()
