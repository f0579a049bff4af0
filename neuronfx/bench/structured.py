"""``neuronfx bench structured``: the cost of structured outputs at batch 1, one run.

One plan (batch 1, the default model: SmolLM2). One chat prompt asking for a JSON record runs
through the reference scheduler constrained by a JSON schema (:data:`SCHEMA`, at most --gen-len
tokens; it ends when the JSON is complete) and unconstrained (eos ignored) for as many tokens as
the constrained warm-up produced, so both decode over the same context lengths; the two
alternate for --rounds rounds after one warm-up of each. Reported: decode tok/s of each (the
median round: tokens after the first over the seconds in decode steps), their same-round ratio
(median), and the host time per constrained token spent in the matcher (filling its bitmask row
and consuming the token; timed around each call), which the constrained row adds to the decode
step; the in-graph unpacking of the bitmask runs for every row, constrained or not."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch

import neuronfx
from neuronfx.bench.options import add_engine, add_model, add_threads, check_at_least, logger, set_threads
from neuronfx.bench.rounds import alternate, median
from neuronfx.bench.types import Benchmark
from neuronfx.io import checkpoints
from neuronfx.runtime.generate import collect
from neuronfx.runtime.structured import Backend, Grammars, Matcher

QUESTION = "Describe a fictional person as JSON with their name, age, city, job and three hobbies."
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "city": {"type": "string"},
    "job": {"type": "string"}, "hobbies": {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3}},
    "required": ["name", "age", "city", "job", "hobbies"], "additionalProperties": False}


class TimedMatcher(Matcher):
    """A matcher that adds the seconds of its fill and consume calls to ``clock[0]``."""

    def __init__(self, inner: Matcher, clock: list[float]) -> None:
        self.inner, self.clock = inner, clock

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        t0 = time.perf_counter()
        self.inner.fill(bitmask, row)
        self.clock[0] += time.perf_counter() - t0

    def consume(self, tokens: Sequence[int]) -> bool:
        t0 = time.perf_counter()
        ok = self.inner.consume(tokens)
        self.clock[0] += time.perf_counter() - t0
        return ok

    def validate(self, tokens: Sequence[int]) -> int:
        return self.inner.validate(tokens)

    def rollback(self, n: int) -> None:
        self.inner.rollback(n)

    def is_stopped(self) -> bool:
        return self.inner.is_stopped()

    def error(self) -> str:
        return self.inner.error()


class TimedBackend(Backend):
    """``inner`` whose matchers are :class:`TimedMatcher` s on one clock."""

    def __init__(self, inner: Backend) -> None:
        self.inner, self.clock = inner, [0.0]

    def compile(self, structured: neuronfx.StructuredOutputs) -> Any:
        return self.inner.compile(structured)

    def matcher(self, compiled: Any) -> Matcher:
        return TimedMatcher(self.inner.matcher(compiled), self.clock)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --backend, --dtype, --threads, --gen-len and --rounds."""
    add_model(p)
    add_engine(p, backend="inductor")
    add_threads(p)
    p.add_argument("--gen-len", type=int, default=128, help="token budget of each request (default 128)")
    p.add_argument("--rounds", type=int, default=3, help="measured runs per mode, alternating (default 3)")


def run_once(runtime: neuronfx.Runtime, tokenizer: Any, prompt: list[int], sampling: neuronfx.SamplingParams,
             backend: TimedBackend, grammars: Grammars) -> dict[str, Any]:
    """One request through the reference scheduler with the timed grammars (``grammars``, its
    compiled grammar cached after the warm-up): its tokens, text, decode tok/s and matcher seconds."""
    backend.clock[0] = 0.0
    requests = [neuronfx.Request(prompt=tuple(prompt), sampling=sampling)]
    events = neuronfx.schedule(runtime, neuronfx.init_state(runtime), requests, frozenset(runtime.plan.model.eos_token_ids),
                               tokenizer, grammars=grammars)
    result, _ = collect(events, with_text=True)
    n = len(result.token_ids[0])
    return {"tokens": n, "text": result.texts[0], "finish_reason": result.finish_reasons[0],
            "decode_tok_s": (n - 1) / result.decode_s if result.decode_s > 0 else float("nan"), "matcher_s": backend.clock[0]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Compile one batch-1 plan, warm both modes up, alternate them for --rounds rounds."""
    check_at_least("gen_len", args.gen_len, 2)
    check_at_least("rounds", args.rounds, 1)
    set_threads(args.threads)
    path = args.model or checkpoints.default_model_path()
    ckpt, tokenizer = checkpoints.load_checkpoint(path), checkpoints.load_tokenizer(path)
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"])
    length = max(64, len(prompt))
    inference = neuronfx.InferenceConfig(batch_size=1, max_context_length=length, sequence_length=length + args.gen_len,
                                         backend=args.backend, dtype=args.dtype)
    runtime = neuronfx.compile(neuronfx.make_plan(ckpt.config, inference), ckpt.state_dict, progress=False)
    backend = TimedBackend(Grammars.for_runtime(runtime, tokenizer).backend)
    grammars = Grammars(backend)
    constrained = neuronfx.SamplingParams(max_tokens=args.gen_len, structured=neuronfx.StructuredOutputs(json=SCHEMA))
    warm = run_once(runtime, tokenizer, prompt, constrained, backend, grammars)  # and the grammar's compilation
    plain = neuronfx.SamplingParams(max_tokens=max(2, warm["tokens"]), ignore_eos=True)
    modes = {"unconstrained": lambda: run_once(runtime, tokenizer, prompt, plain, backend, grammars),
             "json_schema": lambda: run_once(runtime, tokenizer, prompt, constrained, backend, grammars)}
    modes["unconstrained"]()  # its warm-up
    runs = alternate(modes, args.rounds)
    return report(args, runs)


def report(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The figures of ``runs`` (each mode's rounds), logged and returned."""
    json_runs = runs["json_schema"]
    out: dict[str, Any] = {name: {"decode_tok_s": median([r["decode_tok_s"] for r in rs]), "tokens": rs[-1]["tokens"]}
                           for name, rs in runs.items()}
    out["ratio"] = median([c["decode_tok_s"] / u["decode_tok_s"] for c, u in zip(json_runs, runs["unconstrained"])])
    out["host_ms_per_constrained_token"] = 1e3 * sum(r["matcher_s"] for r in json_runs) / sum(r["tokens"] for r in json_runs)
    out["json_text"], out["json_finish_reason"] = json_runs[-1]["text"], json_runs[-1]["finish_reason"]
    log = logger(args)
    for name in ("unconstrained", "json_schema"):
        log(f"{name:>13}: {out[name]['decode_tok_s']:.1f} decode tok/s (median of {len(runs[name])} rounds; {out[name]['tokens']} tokens)")
    log(f"json_schema / unconstrained: {out['ratio']:.3f}x (median same-round ratio); host time in the matcher "
        f"{out['host_ms_per_constrained_token']:.3f} ms per constrained token (mask fill + consume)")
    log(f"constrained output ({out['json_finish_reason']}): {out['json_text']}")
    return out


BENCHMARK = Benchmark(name="structured", help="structured outputs at batch 1: decode tok/s unconstrained vs JSON-schema "
                      "constrained, host time per constrained token", description=__doc__, add_arguments=add_arguments, run=run)
