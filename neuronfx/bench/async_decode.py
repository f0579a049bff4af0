"""``neuronfx bench async``: overlapped (async) decode against synchronous decode at batch 8, one run.

One plan (batch 8, only the full batch bucket compiled). The same 8 chat prompts run through
``neuronfx.stream_generate`` with and without ``async_decode`` (greedy, eos ignored, --gen-len
tokens each, a stop string that never matches, so every run does the same work), the modes
alternating for --rounds rounds after one warm-up of each. The streaming path is what a server
or a ``--stream`` caller pays per token: the scheduler detokenizes and stop-checks every token,
and the consumer formats each event as an OpenAI SSE chunk (JSON), as ``neuronfx serve`` does.
ITL = time between consecutive TokenEvents of one request, as the consumer sees them. Reported:
ITL p50 / p99 of both modes, their ratio, tok/s, whether both produced the same tokens; and, per
mode, the decode graph's time and the host time between two decode graphs (what overlapping
takes off the critical path; the graph time shows what the host thread's concurrent work costs
the graph: CPU cores and the GIL are shared).

Both modes are measured after the warm-ups, so the process already holds the decode worker
thread and its OpenMP team in both (libgomp spin-waits less once it manages more threads than
there are CPUs, which on a busy machine changes a step's time a lot, for both modes alike once
the worker exists; run on a quiet machine; the ratio is the figure)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import attrs

import neuronfx
from neuronfx.bench.options import add_engine, add_model, add_threads, check_at_least, logger, set_threads
from neuronfx.bench.rounds import alternate
from neuronfx.bench.timing import percentile
from neuronfx.bench.types import Benchmark
from neuronfx.io import checkpoints

QUESTIONS = (
    "Explain how a transformer language model generates text, step by step.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between TCP and UDP? Give examples.",
    "Describe the water cycle to a ten-year-old.",
    "List some tips for writing clean, maintainable Python code and explain each.",
    "Why is the sky blue? Explain the physics in simple terms.",
    "Summarize the history of the printing press and its impact on Europe.",
    "How do vaccines train the immune system? Explain with an analogy.",
)

Span = tuple[str, float, float]  # (phase, start, end), perf_counter seconds


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --backend, --dtype, --threads, --gen-len and --rounds."""
    add_model(p)
    add_engine(p, backend="inductor")
    add_threads(p)
    p.add_argument("--gen-len", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument("--rounds", type=int, default=3, help="measured runs per mode, alternating (default 3)")


def sse_chunk(event: neuronfx.TokenEvent, created: int) -> str:
    """The consumer's per-token work: an OpenAI completion chunk as ``neuronfx serve`` streams it."""
    choice = {"index": 0, "text": event.text, "logprobs": None, "finish_reason": event.finish_reason,
              "stop_reason": event.stop_reason}
    body = {"id": f"cmpl-{event.index}", "object": "text_completion", "created": created, "model": "bench", "choices": [choice]}
    return f"data: {json.dumps(body)}\n\n"


def timed(runtime: neuronfx.Runtime, spans: list[Span]) -> neuronfx.Runtime:
    """``runtime`` whose graphs append (phase, start, end) to ``spans`` on every call."""

    def wrap(phase: str, graph: Any) -> Any:
        def call(*args: Any) -> Any:
            t0 = time.perf_counter()
            out = graph(*args)
            spans.append((phase, t0, time.perf_counter()))
            return out
        return call

    return attrs.evolve(runtime, graphs={k: wrap(k[0], g) for k, g in runtime.graphs.items()})


DECODE_GRAPHS = ("decode", "greedy")
"""The phases of the graphs a decode step runs (greedy: all-greedy rows, ``runtime.steps.decode_phase``)."""


def host_gaps(spans: list[Span]) -> tuple[list[float], list[float]]:
    """(graph seconds of each decode step, seconds between one decode graph's end and the next
    one's start when no prefill ran between: the host time async decode takes off the path)."""
    graph = [end - start for phase, start, end in spans if phase in DECODE_GRAPHS]
    gaps = [b[1] - a[2] for a, b in zip(spans, spans[1:]) if a[0] in DECODE_GRAPHS and b[0] in DECODE_GRAPHS]
    return graph, gaps


def run_once(runtime: neuronfx.Runtime, tokenizer: Any, prompts: list[list[int]], sampling: neuronfx.SamplingParams,
             async_decode: bool, spans: list[Span]) -> dict[str, Any]:
    """One run of ``prompts``: ITLs (s), tokens per request, wall seconds, decode graph times and host gaps."""
    spans.clear()
    last: dict[int, float] = {}
    itl: list[float] = []
    tokens: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    for event in neuronfx.stream_generate(runtime, neuronfx.init_state(runtime), prompts, sampling=sampling, tokenizer=tokenizer,
                                          async_decode=async_decode):
        if not isinstance(event, neuronfx.TokenEvent):
            continue
        sse_chunk(event, int(t0))
        now = time.perf_counter()
        if event.index in last:
            itl.append(now - last[event.index])
        last[event.index] = now
        tokens.setdefault(event.index, []).append(event.token_id)
    graph, gaps = host_gaps(spans)
    return {"itl": itl, "tokens": tokens, "wall_s": time.perf_counter() - t0, "graph": graph, "gaps": gaps}


def mode_figures(runs: list[dict[str, Any]]) -> dict[str, float]:
    """One mode's figures over its rounds (ms and tok/s)."""
    itl = [x for r in runs for x in r["itl"]]
    return {"itl_p50_ms": percentile(itl, 50) * 1e3, "itl_p99_ms": percentile(itl, 99) * 1e3, "intervals": len(itl),
            "tok_s": sum(sum(map(len, r["tokens"].values())) for r in runs) / sum(r["wall_s"] for r in runs),
            "graph_p50_ms": percentile([x for r in runs for x in r["graph"]], 50) * 1e3,
            "host_gap_p50_ms": percentile([x for r in runs for x in r["gaps"]], 50) * 1e3}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Compile one batch-8 plan, warm both modes up, alternate them for --rounds rounds."""
    check_at_least("gen_len", args.gen_len, 2)
    check_at_least("rounds", args.rounds, 1)
    set_threads(args.threads)
    path = args.model or checkpoints.default_model_path()
    ckpt, tokenizer = checkpoints.load_checkpoint(path), checkpoints.load_tokenizer(path)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]) for q in QUESTIONS]
    inference = neuronfx.InferenceConfig(batch_size=8, batch_buckets=(8,), max_context_length=max(128, max(map(len, prompts))),
                                         sequence_length=max(128, max(map(len, prompts))) + args.gen_len, backend=args.backend,
                                         dtype=args.dtype)
    spans: list[Span] = []
    runtime = timed(neuronfx.compile(neuronfx.make_plan(ckpt.config, inference), ckpt.state_dict, progress=False), spans)
    sampling = neuronfx.SamplingParams(max_tokens=args.gen_len, ignore_eos=True, stop=("\n\nQ:",))
    modes = {"sync": lambda: run_once(runtime, tokenizer, prompts, sampling, False, spans),
             "async": lambda: run_once(runtime, tokenizer, prompts, sampling, True, spans)}
    alternate(modes, 1)  # warm-up of each
    runs = alternate(modes, args.rounds)
    out = {name: mode_figures(r) for name, r in runs.items()}
    out["ratio_itl_p50"] = out["async"]["itl_p50_ms"] / out["sync"]["itl_p50_ms"]
    out["same_tokens"] = all(a["tokens"] == b["tokens"] for a, b in zip(runs["sync"], runs["async"]))
    log = logger(args)
    for name in ("sync", "async"):
        f = out[name]
        log(f"{name:>5}: ITL p50 {f['itl_p50_ms']:.2f} ms, p99 {f['itl_p99_ms']:.2f} ms, {f['tok_s']:.1f} tok/s ({f['intervals']} "
            f"intervals); decode graph p50 {f['graph_p50_ms']:.2f} ms, host time between decode graphs p50 {f['host_gap_p50_ms']:.2f} ms")
    log(f"async / sync: ITL p50 {out['ratio_itl_p50']:.3f}; same tokens: {out['same_tokens']}")
    return out


BENCHMARK = Benchmark(name="async", help="overlapped (async) decode against synchronous decode at batch 8: ITL, tok/s, host "
                      "time between decode graphs", description=__doc__, add_arguments=add_arguments, run=run)
