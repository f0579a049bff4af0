"""Randomized soak of the reference scheduler on a tiny random llama (eager backend).

A seeded loop of random valid and invalid operations: submit valid and invalid requests, run
scheduler iterations, abort requests, call steps with bad inputs, reuse consumed states, pass a
state of another runtime, call ``generate`` between iterations, and write NaN into free slots
(harmless) and into a running request's slot (that request must finish with "error").

Checked throughout: a valid operation never raises; an invalid one raises exactly its documented
error and changes nothing; every completed request equals its solo run (the same request alone
on a fresh state of the same runtime, cached by request); resident memory does not grow by more
than ``RSS_TOLERANCE_MIB`` after warm-up.

    NEURONFX_SOAK_OPS=10000 .venv/bin/python scripts/soak.py   # prints the figures as JSON

``NEURONFX_SOAK_OPS`` (default 10000 here) and ``NEURONFX_SOAK_SECONDS`` (default: no limit)
bound the run; ``NEURONFX_SOAK_SEED`` (default 0) picks the sequence. ``tests/test_soak.py`` runs
it bounded for CI.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import random
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import VOCAB, kv_tensors, random_prompt, tiny_hf_model, tiny_runtime

import neuronfx
from neuronfx import DecodeBatch, PrefillBatch, Request, SamplingParams
from neuronfx.errors import (
    BatchTooLargeError,
    EmptyPromptError,
    InputError,
    NeuronfxError,
    PromptTooLongError,
    SamplingParamsError,
    SequenceLengthExceededError,
    SlotError,
    StateConsumedError,
    StateMismatchError,
    TokenOutOfVocabError,
)
from neuronfx.runtime.scheduler import Queue, abort, schedule, step, submit

RSS_TOLERANCE_MIB = 24.0
"""Allowed RSS growth between the end of warm-up and the end of the run."""
WARMUP_FRACTION = 0.1
NO_EOS: frozenset[int] = frozenset()
MAX_PROMPT, MAX_TOKENS = 24, 12  # valid requests: 24 + 12 <= sequence_length 64

# SamplingParams fields out of range: rejected by SamplingParams itself when built (inside the call).
BAD_SAMPLING_FIELDS = (
    {"temperature": -1.0}, {"temperature": float("nan")}, {"top_p": 0.0}, {"min_p": 2.0}, {"repetition_penalty": 0.0},
    {"presence_penalty": float("inf")}, {"seed": -5}, {"min_tokens": 3, "max_tokens": 1},
)
# Valid SamplingParams the plan cannot serve: rejected when a request or step is checked.
OVER_PLAN_SAMPLING = (
    SamplingParams(top_k=VOCAB + 1), SamplingParams(logprobs=99), SamplingParams(stop_token_ids=(VOCAB,)),
)


def bad_sampling(r: random.Random) -> SamplingParams:
    """A SamplingParams the tiny plan rejects: built from bad fields (raises right here) or over the plan."""
    i = r.randrange(len(BAD_SAMPLING_FIELDS) + len(OVER_PLAN_SAMPLING))
    if i < len(OVER_PLAN_SAMPLING):
        return OVER_PLAN_SAMPLING[i]
    return SamplingParams(**BAD_SAMPLING_FIELDS[i - len(OVER_PLAN_SAMPLING)])


def rss_mib() -> float:
    """Resident set size of this process, MiB (/proc/self/statm; ru_maxrss elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class SoakFailure(AssertionError):
    """An invariant of the soak broke (wrong tokens, wrong error, state changed by a failed call)."""


def expect(error: type[Exception], call: Callable[[], object]) -> str:
    """Run ``call``; it must raise exactly ``error``. Returns the error's class name."""
    try:
        call()
    except NeuronfxError as exc:
        if type(exc) is not error:
            raise SoakFailure(f"expected {error.__name__}, got {type(exc).__name__}: {exc}") from exc
        return type(exc).__name__
    raise SoakFailure(f"expected {error.__name__}, nothing was raised")


def host_view(state: neuronfx.State) -> tuple:
    return state.cache_lens, state.generated, state.live, state.rng_key, state.consumed


@attrs.define
class Soak:
    """The loop's bookkeeping; one method per operation."""

    rt: neuronfx.Runtime
    foreign: neuronfx.State
    rng: random.Random
    state: neuronfx.State
    queue: Queue = attrs.field(factory=Queue)
    previous: neuronfx.State | None = None  # a state some step consumed
    next_index: int = 0
    requests: dict[int, Request] = attrs.Factory(dict)
    tokens: dict[int, list[int]] = attrs.Factory(dict)
    poisoned: set[int] = attrs.Factory(set)
    solo_cache: dict[Any, tuple[int, ...]] = attrs.Factory(dict)
    ops: collections.Counter = attrs.Factory(collections.Counter)
    errors: collections.Counter = attrs.Factory(collections.Counter)
    finished: collections.Counter = attrs.Factory(collections.Counter)

    # --- helpers ----------------------------------------------------------------------------

    def solo(self, req: Request) -> tuple[int, ...]:
        """The request alone on a fresh state (cached)."""
        key = ("request", req)
        if key not in self.solo_cache:
            events = schedule(self.rt, neuronfx.init_state(self.rt), [req], NO_EOS)
            self.solo_cache[key] = tuple(e.token_id for e in events if isinstance(e, neuronfx.TokenEvent))
        return self.solo_cache[key]

    def sampling(self) -> SamplingParams:
        """Random parameters whose tokens do not depend on the batch: greedy, or seeded."""
        r = self.rng
        kind = r.randrange(6)
        if kind == 0:
            return SamplingParams(repetition_penalty=1.3)
        if kind == 1:
            return SamplingParams(temperature=0.9, seed=r.randrange(1000))
        if kind == 2:
            return SamplingParams(temperature=1.0, top_k=20, top_p=0.9, presence_penalty=0.5, seed=r.randrange(1000))
        if kind == 3:
            return SamplingParams(stop_token_ids=(r.randrange(VOCAB),), min_tokens=2, logprobs=2)
        return SamplingParams()

    def valid_request(self) -> Request:
        r = self.rng
        prompt = random_prompt(r.randint(1, MAX_PROMPT), seed=r.randrange(40))  # few prompts: solo cache hits
        sampling = self.sampling()
        req = Request(prompt=tuple(prompt), sampling=attrs.evolve(sampling, max_tokens=r.randint(max(1, sampling.min_tokens), MAX_TOKENS)))
        if r.random() < 0.15:  # a stop id from its own greedy output: it really stops early
            base = attrs.evolve(req, sampling=SamplingParams(max_tokens=req.sampling.max_tokens))
            req = attrs.evolve(base, sampling=attrs.evolve(base.sampling, stop_token_ids=(r.choice(self.solo(base)),)))
        return req

    def record(self, events: list) -> None:
        """Append events' tokens; check every finished request against its solo run."""
        for ev in events:
            if ev.token_id is not None:
                self.tokens.setdefault(ev.index, []).append(ev.token_id)
            if ev.finish_reason is None:
                continue
            self.finished[ev.finish_reason] += 1
            req, got = self.requests.pop(ev.index), tuple(self.tokens.pop(ev.index, []))
            if ev.index in self.poisoned:
                self.poisoned.discard(ev.index)
                if ev.finish_reason != "error":
                    raise SoakFailure(f"request {ev.index} had NaN in its cache but finished with {ev.finish_reason!r}")
                if got != self.solo(req)[: len(got)]:
                    raise SoakFailure(f"request {ev.index}: tokens before the NaN differ from its solo run")
            elif ev.finish_reason == "error" or got != self.solo(req):
                raise SoakFailure(f"request {ev.index} ({ev.finish_reason}): {got} != solo {self.solo(req)}")

    def advance(self, state: neuronfx.State) -> None:
        self.previous, self.state = self.state, state

    def unchanged(self, before: tuple) -> None:
        if host_view(self.state) != before:
            raise SoakFailure("a failed call changed the state")

    # --- operations -------------------------------------------------------------------------

    def submit_valid(self) -> None:
        req = self.valid_request()
        self.queue = submit(self.queue, self.next_index, req, runtime=self.rt)
        self.requests[self.next_index] = req
        self.next_index += 1

    def submit_invalid(self) -> None:
        r, good = self.rng, self.valid_request()
        cases = [
            (EmptyPromptError, attrs.evolve(good, prompt=())),
            (PromptTooLongError, attrs.evolve(good, prompt=tuple(random_prompt(r.randint(33, 40), 1)))),
            (TokenOutOfVocabError, attrs.evolve(good, prompt=good.prompt + (VOCAB + r.randrange(5),))),
            (TokenOutOfVocabError, attrs.evolve(good, prompt=(-1,) + good.prompt)),
            (SequenceLengthExceededError, attrs.evolve(good, prompt=tuple(random_prompt(30, 2)),
                                                       sampling=attrs.evolve(good.sampling, max_tokens=40))),
            (SamplingParamsError, None),  # the request's SamplingParams are built inside the call
        ]
        error, req = r.choice(cases)
        index = self.next_index
        if self.requests and r.random() < 0.2:  # an index already in use
            error, req, index = InputError, good, r.choice(list(self.requests))
        queue = self.queue
        call = (lambda: submit(queue, index, req, runtime=self.rt)) if req is not None else (
            lambda: submit(queue, index, attrs.evolve(good, sampling=bad_sampling(r)), runtime=self.rt))
        self.errors[expect(error, call)] += 1

    def iterate(self) -> None:
        events, state, self.queue = step(self.rt, self.state, self.queue, NO_EOS)
        if state is not self.state:  # an idle iteration returns the state it was given
            self.advance(state)
        self.record(events)

    def abort_one(self) -> None:
        active = [i for i, _ in self.queue.waiting] + [r.index for r in self.queue.running]
        if not active or self.rng.random() < 0.2:
            self.errors[expect(InputError, lambda: abort(self.rt, self.state, self.queue, -1))] += 1
            return
        index = self.rng.choice(active)
        state, self.queue = abort(self.rt, self.state, self.queue, index)
        if state is not self.state:
            self.advance(state)
        self.requests.pop(index)
        self.tokens.pop(index, None)
        self.poisoned.discard(index)

    def bad_step(self) -> None:
        """A step call with a bad input on the live state: it must raise and change nothing."""
        rt, s, r = self.rt, self.state, self.rng
        free, live = list(s.free_slots), [i for i, on in enumerate(s.live) if on]
        g = SamplingParams()
        cases = [(BatchTooLargeError, lambda: neuronfx.decode_step(rt, s, DecodeBatch(seq_ids=range(5), input_ids=[1] * 5, sampling=[g] * 5))),
                 (SlotError, lambda: neuronfx.prefill_step(rt, s, PrefillBatch(seq_ids=[7], prompts=[[1]], sampling=[g])))]
        if free:
            f = r.choice(free)
            cases += [(SlotError, lambda: neuronfx.decode_step(rt, s, DecodeBatch(seq_ids=[f], input_ids=[1], sampling=[g]))),
                      (SlotError, lambda: neuronfx.release(rt, s, [f])),
                      (PromptTooLongError, lambda: neuronfx.prefill_step(rt, s, PrefillBatch(seq_ids=[f], prompts=[[1] * 33], sampling=[g])))]
        if live:
            x = r.choice(live)
            cases += [(SlotError, lambda: neuronfx.prefill_step(rt, s, PrefillBatch(seq_ids=[x], prompts=[[1]], sampling=[g]))),
                      (TokenOutOfVocabError, lambda: neuronfx.decode_step(rt, s, DecodeBatch(seq_ids=[x], input_ids=[VOCAB], sampling=[g]))),
                      (SamplingParamsError, lambda: neuronfx.decode_step(rt, s, DecodeBatch(seq_ids=[x], input_ids=[1], sampling=[bad_sampling(r)]))),
                      (SlotError, lambda: neuronfx.decode_step(rt, s, DecodeBatch(seq_ids=[x, x], input_ids=[1, 1], sampling=[g, g])))]
        error, call = r.choice(cases)
        before = host_view(s)
        self.errors[expect(error, call)] += 1
        self.unchanged(before)

    def reuse_consumed(self) -> None:
        old = self.previous
        if old is None:
            return
        calls = [lambda: neuronfx.release(self.rt, old, []), lambda: neuronfx.generate(self.rt, old, [[1, 2]]),
                 lambda: neuronfx.decode_step(self.rt, old, DecodeBatch(seq_ids=[0], input_ids=[1], sampling=[SamplingParams()]))]
        self.errors[expect(StateConsumedError, self.rng.choice(calls))] += 1

    def foreign_state(self) -> None:
        batch = PrefillBatch(seq_ids=[0], prompts=[[1, 2]], sampling=[SamplingParams()])
        self.errors[expect(StateMismatchError, lambda: neuronfx.prefill_step(self.rt, self.foreign, batch))] += 1

    def generate_between(self) -> None:
        """``generate`` on the live state: its requests use free slots; the scheduler's wait."""
        r = self.rng
        prompts = [random_prompt(r.randint(1, MAX_PROMPT), seed=r.randrange(40)) for _ in range(r.randint(1, 2))]
        n = r.randint(1, 6)
        if not self.state.free_slots:
            self.errors[expect(BatchTooLargeError, lambda: neuronfx.generate(self.rt, self.state, prompts, max_new_tokens=n))] += 1
            return
        result, state = neuronfx.generate(self.rt, self.state, prompts, max_new_tokens=n, eos_token_ids=[])
        self.advance(state)
        for p, got in zip(prompts, result.token_ids):
            key = ("generate", tuple(p), n)
            if key not in self.solo_cache:
                alone, _ = neuronfx.generate(self.rt, neuronfx.init_state(self.rt), [p], max_new_tokens=n, eos_token_ids=[])
                self.solo_cache[key] = alone.token_ids[0]
            if got != self.solo_cache[key]:
                raise SoakFailure(f"generate between iterations: {got} != solo {self.solo_cache[key]}")

    def poison_free(self) -> None:
        """NaN into every free slot and the scratch slot: never read, so nothing may change."""
        slots = list(self.state.free_slots) + [self.rt.plan.kv.scratch_slot]
        for t in kv_tensors(self.state):
            t[slots] = float("nan")

    def poison_live(self) -> None:
        """NaN into a running request's attended cache: it must finish with "error"."""
        running = [r for r in self.queue.running if r.index not in self.poisoned]
        if not running:
            return
        run = self.rng.choice(running)
        self.state.kv[0].k[run.slot, :, : self.state.cache_lens[run.slot]] = float("nan")
        self.poisoned.add(run.index)

    def drain(self) -> None:
        while not self.queue.idle:
            self.iterate()
        if self.poisoned or self.requests:
            raise SoakFailure(f"requests left unfinished: {sorted(self.requests)}")
        if any(self.state.live):
            raise SoakFailure(f"slots still live after draining: {self.state.live}")


OPERATIONS = {  # name -> weight
    "submit_valid": 20, "submit_invalid": 8, "iterate": 40, "abort_one": 3, "bad_step": 10,
    "reuse_consumed": 4, "foreign_state": 2, "generate_between": 3, "poison_free": 6, "poison_live": 1,
}


def run(ops: int = 10_000, seconds: float | None = None, seed: int = 0, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run up to ``ops`` random operations (stopping early after ``seconds``), then drain the
    queue. Raises SoakFailure (or any undocumented exception) on the first broken invariant.
    Returns the figures: operations (total and by name), errors by kind, finish reasons,
    requests, RSS (MiB) at start, after warm-up and at the end, and seconds."""
    torch.manual_seed(seed)
    hf = tiny_hf_model("llama", seed=0)
    rt = tiny_runtime(hf)
    foreign = neuronfx.init_state(tiny_runtime(hf, batch_size=2))
    soak = Soak(rt=rt, foreign=foreign, rng=random.Random(seed), state=neuronfx.init_state(rt, seed=seed))
    names, weights = list(OPERATIONS), list(OPERATIONS.values())
    gc.collect()
    rss_start, rss_warm = rss_mib(), None
    t0 = time.perf_counter()
    warmup = max(1, int(ops * WARMUP_FRACTION))
    done = 0
    while done < ops and (seconds is None or time.perf_counter() - t0 < seconds):
        name = soak.rng.choices(names, weights)[0]
        getattr(soak, name)()
        soak.ops[name] += 1
        done += 1
        if done == warmup:
            gc.collect()
            rss_warm = rss_mib()
        if log and done % 1000 == 0:
            log(f"{done} ops, {time.perf_counter() - t0:.0f} s, rss {rss_mib():.1f} MiB")
    soak.drain()
    gc.collect()
    rss_end = rss_mib()
    return {
        "operations": done, "by_operation": dict(soak.ops), "errors_by_kind": dict(sorted(soak.errors.items())),
        "errors": sum(soak.errors.values()), "requests_submitted": soak.next_index,
        "finish_reasons": dict(soak.finished), "solo_runs_cached": len(soak.solo_cache),
        "rss_mib_start": round(rss_start, 1), "rss_mib_after_warmup": round(rss_warm if rss_warm is not None else rss_end, 1),
        "rss_mib_end": round(rss_end, 1), "rss_tolerance_mib": RSS_TOLERANCE_MIB,
        "seconds": round(time.perf_counter() - t0, 1), "seed": seed,
    }


def main() -> None:
    ops = int(os.environ.get("NEURONFX_SOAK_OPS", "10000"))
    seconds = os.environ.get("NEURONFX_SOAK_SECONDS")
    seed = int(os.environ.get("NEURONFX_SOAK_SEED", "0"))
    figures = run(ops, float(seconds) if seconds else None, seed, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(figures, indent=2))
    growth = figures["rss_mib_end"] - figures["rss_mib_after_warmup"]
    if growth > RSS_TOLERANCE_MIB:
        sys.exit(f"RSS grew {growth:.1f} MiB after warm-up > {RSS_TOLERANCE_MIB} MiB")


if __name__ == "__main__":
    main()
