"""Overlapped (async) decode vs synchronous decode: inter-token latency at batch 8, one run.

Usage: PYTHONPATH=. .venv/bin/python scripts/bench_async_decode.py [--threads 2] [--gen-len 128] [--rounds 3]

SmolLM2-135M-Instruct (the default GGUF, float32), inductor, ``--threads`` torch threads, one
plan (batch 8, only the full batch bucket compiled). The same 8 chat prompts run through
``neuronfx.stream_generate`` with and without ``async_decode`` (greedy, ignore_eos, ``--gen-len``
tokens each, a stop string that never matches, so every run does the same work), alternating
modes for ``--rounds`` rounds after one warm-up of each. The streaming path is what a server
or a ``--stream`` caller pays per token: the scheduler detokenizes and stop-checks every token
(``advance_request``), and the consumer formats each event as an OpenAI SSE chunk (JSON), as
``neuronfx serve`` does. ITL = time between consecutive TokenEvents of one request, as the
consumer sees them. Prints ITL p50 / p99 of both modes, their ratio, tok/s, and checks that both
produced the same tokens; and, per mode, the decode graph's time and the host time between two
decode graphs (what overlapping takes off the critical path; the graph time shows what the
host thread's concurrent work costs the graph: CPU cores and the GIL are shared).

Both modes are measured after the warm-ups, so the process already holds the decode worker
thread (``runtime/overlap.py``) and its OpenMP team in both: libgomp spin-waits less once it
manages more threads than there are CPUs, which on a busy machine changes a step's time a lot,
for both modes alike once the worker exists (run on a quiet machine; the ratio is the figure).
"""

from __future__ import annotations

import argparse
import json
import time

import attrs
import torch

import neuronfx
from neuronfx.bench import percentile
from neuronfx.config.sampling import SamplingParams
from neuronfx.io.checkpoints import default_model_path, load_checkpoint, load_tokenizer

QUESTIONS = [
    "Explain how a transformer language model generates text, step by step.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between TCP and UDP? Give examples.",
    "Describe the water cycle to a ten-year-old.",
    "List some tips for writing clean, maintainable Python code and explain each.",
    "Why is the sky blue? Explain the physics in simple terms.",
    "Summarize the history of the printing press and its impact on Europe.",
    "How do vaccines train the immune system? Explain with an analogy.",
]


def sse_chunk(event: neuronfx.TokenEvent, created: int) -> str:
    """The consumer's per-token work: an OpenAI completion chunk as ``neuronfx serve`` streams it."""
    choice = {"index": 0, "text": event.text, "logprobs": None, "finish_reason": event.finish_reason,
              "stop_reason": event.stop_reason}
    body = {"id": f"cmpl-{event.index}", "object": "text_completion", "created": created, "model": "smollm2",
            "choices": [choice]}
    return f"data: {json.dumps(body)}\n\n"


def timed(runtime: neuronfx.Runtime, spans: list[tuple[str, float, float]]) -> neuronfx.Runtime:
    """``runtime`` whose graphs append (phase, start, end) (perf_counter seconds) to ``spans``."""

    def wrap(phase: str, graph: object) -> object:
        def call(weights: object, kv: object, inputs: object) -> object:
            t0 = time.perf_counter()
            out = graph(weights, kv, inputs)
            spans.append((phase, t0, time.perf_counter()))
            return out
        return call

    return attrs.evolve(runtime, graphs={k: wrap(k[0], g) for k, g in runtime.graphs.items()})


def host_gaps(spans: list[tuple[str, float, float]]) -> tuple[list[float], list[float]]:
    """(graph seconds of each decode step, seconds between one decode graph's end and the next
    one's start when no prefill ran between: the host time async decode takes off the path)."""
    graph = [end - start for phase, start, end in spans if phase == "decode"]
    gaps = [b[1] - a[2] for a, b in zip(spans, spans[1:]) if a[0] == b[0] == "decode"]
    return graph, gaps


def run_once(runtime: neuronfx.Runtime, tokenizer: object, prompts: list[list[int]], sampling: SamplingParams,
             async_decode: bool) -> tuple[list[float], dict[int, list[int]], float]:
    """(ITLs in seconds, tokens per request, wall seconds) of one run of ``prompts``."""
    state = neuronfx.init_state(runtime)
    last: dict[int, float] = {}
    itl: list[float] = []
    tokens: dict[int, list[int]] = {}
    sent = 0
    t0 = time.perf_counter()
    for event in neuronfx.stream_generate(runtime, state, prompts, sampling=sampling, tokenizer=tokenizer, async_decode=async_decode):
        if not isinstance(event, neuronfx.TokenEvent):
            continue
        sent += len(sse_chunk(event, int(t0)))
        now = time.perf_counter()
        if event.index in last:
            itl.append(now - last[event.index])
        last[event.index] = now
        tokens.setdefault(event.index, []).append(event.token_id)
    return itl, tokens, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--gen-len", type=int, default=128, help="tokens per request (default 128)")
    ap.add_argument("--rounds", type=int, default=3, help="measured runs per mode, alternating (default 3)")
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path()
    ckpt, tokenizer = load_checkpoint(path), load_tokenizer(path)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]) for q in QUESTIONS]
    inference = neuronfx.InferenceConfig(batch_size=8, batch_buckets=(8,), max_context_length=128,
                                         sequence_length=128 + args.gen_len, backend=args.backend)
    t0 = time.perf_counter()
    runtime = neuronfx.compile(neuronfx.make_plan(ckpt.config, inference), ckpt.state_dict, progress=False)
    spans: list[tuple[str, float, float]] = []
    runtime = timed(runtime, spans)
    print(f"SmolLM2-135M-Instruct, {args.backend}, float32, batch 8, {args.threads} threads, prompts "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.gen_len} generated each; compiled in "
          f"{time.perf_counter() - t0:.0f} s")
    sampling = SamplingParams(max_tokens=args.gen_len, ignore_eos=True, stop=("\n\nQ:",))
    results: dict[bool, list] = {False: [], True: []}
    outputs: dict[bool, dict] = {}
    for mode in (False, True):  # warm-up
        run_once(runtime, tokenizer, prompts, sampling, mode)
    for _ in range(args.rounds):
        for mode in (False, True):
            spans.clear()
            itl, tokens, wall = run_once(runtime, tokenizer, prompts, sampling, mode)
            results[mode].append((itl, wall, sum(map(len, tokens.values())), *host_gaps(spans)))
            outputs[mode] = tokens
    figures = {}
    for mode, name in ((False, "sync"), (True, "async")):
        itl = [x for r in results[mode] for x in r[0]]
        graph = [x for r in results[mode] for x in r[3]]
        gaps = [x for r in results[mode] for x in r[4]]
        tok_s = sum(r[2] for r in results[mode]) / sum(r[1] for r in results[mode])
        figures[mode] = (percentile(itl, 50) * 1e3, percentile(itl, 99) * 1e3, tok_s)
        print(f"{name:>5}: ITL p50 {figures[mode][0]:.2f} ms, p99 {figures[mode][1]:.2f} ms, {tok_s:.1f} tok/s "
              f"({len(itl)} intervals); decode graph p50 {percentile(graph, 50) * 1e3:.2f} ms, host time between "
              f"decode graphs p50 {percentile(gaps, 50) * 1e3:.2f} ms")
    p50 = figures[True][0] / figures[False][0]
    p99 = figures[True][1] / figures[False][1]
    print(f"async / sync: ITL p50 {p50:.3f} ({(1 - p50) * 100:+.1f}% lower), p99 {p99:.3f}, "
          f"tok/s {figures[True][2] / figures[False][2]:.3f}; same tokens: {outputs[True] == outputs[False]}")


if __name__ == "__main__":
    main()
