"""Overlapped (async) decode (``runtime/overlap.py``) on a tiny llama (eager): the same tokens,
texts and events as synchronous decode for greedy and seeded sampling, with requests finishing
at different steps (stop ids, stop strings, min_tokens, max_tokens), admission and abort
mid-run; the extra token of a request stopped by a stop string is never emitted; the step API's
lease rules; the server engine's async loop; bad options.
"""

from __future__ import annotations

import argparse
import asyncio
import threading

import attrs
import pytest
import torch
from helpers import GREEDY, VOCAB, hf_greedy, random_prompt, tiny_hf_model, tiny_runtime
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import neuronfx
from neuronfx import DecodeBatch, InferenceConfig, PrefillBatch, SamplingParams
from neuronfx.cli import check_async_flags
from neuronfx.errors import ConfigError, InputError, SlotError, StateConsumedError
from neuronfx.runtime import overlap
from neuronfx.runtime.generate import collect
from neuronfx.runtime.overlap import (
    Pending,
    busy,
    check_async,
    decode_finish,
    decode_launch,
    defer_release,
    overlap_abort,
    overlap_step,
    prepare,
    prepare_next,
    settle,
    stops_for_sure,
)
from neuronfx.runtime.scheduler import Queue, Request, TokenEvent, submit
from neuronfx.server.engine import Engine, Served, Sink
from neuronfx.server.metrics import make_metrics

NO_EOS: list[int] = []
PROMPT_LENS = (5, 17, 3, 12, 7, 9, 1)  # 7 requests, 4 slots: three are admitted mid-run


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=7)


@pytest.fixture(scope="module")
def rt(hf):
    return tiny_runtime(hf)  # batch_size 4: batch buckets (1, 2, 4)


@pytest.fixture(scope="module")
def tokenizer():
    """Word-level tokenizer over the tiny vocab: token i is the word "w{i}"; decode joins with spaces."""
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def words(tokens) -> str:
    return " ".join(f"w{t}" for t in tokens)


def stopping(base: list[SamplingParams], outputs: tuple[tuple[int, ...], ...]) -> list[SamplingParams]:
    """Per-request stops taken from a run without them (``outputs``), so that the requests end at
    different steps and for every reason: max_tokens, a stop id, a stop id held back by
    min_tokens, a stop string over two tokens (cut, or kept), max_tokens 1."""
    o = outputs
    return [
        attrs.evolve(base[0], max_tokens=3),
        attrs.evolve(base[1], stop_token_ids=(o[1][4],)),
        attrs.evolve(base[2], stop=(words(o[2][5:7]),)),
        attrs.evolve(base[3], max_tokens=12),
        attrs.evolve(base[4], stop_token_ids=(o[4][1],), min_tokens=3),
        attrs.evolve(base[5], stop=(words(o[5][2:4]),), include_stop_str_in_output=True),
        attrs.evolve(base[6], max_tokens=1),
    ]


def run(rt, tokenizer, sampling, async_decode):
    prompts = [random_prompt(n, seed=n) for n in PROMPT_LENS]
    events = list(neuronfx.stream_generate(rt, neuronfx.init_state(rt, seed=5), prompts, max_new_tokens=12, sampling=sampling,
                                           tokenizer=tokenizer, eos_token_ids=NO_EOS, async_decode=async_decode))
    assert isinstance(events[-1], neuronfx.Finished) and events[-1].state.free_slots == (0, 1, 2, 3)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    by_request = {i: [e for e in tokens if e.index == i] for i in range(len(prompts))}
    return by_request, collect(iter(events), True)[0]


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_async_equals_sync_events_tokens_and_texts(rt, tokenizer, kind, monkeypatch):
    """Every request's events (token ids, text deltas, finish and stop reasons, logprobs) are
    the synchronous run's: a request stopped by a stop string is launched once more, but that
    token never reaches the stream (no event, not in token_ids)."""
    if kind == "greedy":
        base = [SamplingParams(logprobs=2)] * len(PROMPT_LENS)
    else:  # seeded rows draw by (seed, token index): the same draws whatever the batch
        base = [SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=100 + i, presence_penalty=0.3,
                               repetition_penalty=1.2, logprobs=2) for i in range(len(PROMPT_LENS))]
    first, _ = neuronfx.generate(rt, neuronfx.init_state(rt, seed=5), [random_prompt(n, seed=n) for n in PROMPT_LENS],
                                 max_new_tokens=12, sampling=base, eos_token_ids=NO_EOS)
    sampling = stopping(base, first.token_ids)
    sync_events, sync = run(rt, tokenizer, sampling, async_decode=False)
    relaunched = []  # slots freed after a step that still ran them: requests ended by a stop string

    def spy(pending, slots):
        relaunched.extend(s for s in slots if s in pending.batch.seq_ids)
        return defer_release(pending, slots)

    monkeypatch.setattr(overlap, "defer_release", spy)
    async_events, overlapped = run(rt, tokenizer, sampling, async_decode=True)
    assert relaunched  # a request ended by a stop string rode one extra step; its extra token is not in the stream

    reasons = sync.finish_reasons
    assert reasons[:4] + reasons[5:] == ("length", "stop", "stop", "length", "stop", "length")  # 4: min_tokens may change its path
    assert overlapped.token_ids == sync.token_ids and overlapped.texts == sync.texts
    assert overlapped.finish_reasons == sync.finish_reasons and overlapped.stop_reasons == sync.stop_reasons
    assert len(sync.token_ids[0]) == 3 and len(sync.token_ids[6]) == 1
    for i, evs in async_events.items():
        want = sync_events[i]
        assert [(e.token_id, e.text, e.finish_reason, e.stop_reason) for e in evs] == \
               [(e.token_id, e.text, e.finish_reason, e.stop_reason) for e in want], f"request {i}"
        assert [e.finish_reason is not None for e in evs] == [False] * (len(evs) - 1) + [True]  # nothing after the last
        for a, b in zip(evs, want):  # the same token from the same cache: logprobs agree (batch size may differ)
            assert a.logprobs.top_ids == b.logprobs.top_ids
            assert torch.allclose(torch.tensor(a.logprobs.top_logprobs), torch.tensor(b.logprobs.top_logprobs), atol=1e-5)


def test_unseeded_sampling_equals_sync_without_stop_strings(rt):
    """Without stop strings every request leaves the batch at the step it would synchronously,
    so even unseeded rows (drawn from the state's key by row position) sample the same tokens."""
    prompts = [random_prompt(n, seed=n) for n in PROMPT_LENS]
    base = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4 + i) for i in range(len(PROMPT_LENS))]
    first, _ = neuronfx.generate(rt, neuronfx.init_state(rt, seed=3), prompts, sampling=base, eos_token_ids=NO_EOS)
    sampling = [attrs.evolve(sp, stop_token_ids=(out[2],)) if i % 2 else sp for i, (sp, out) in enumerate(zip(base, first.token_ids))]
    runs = [neuronfx.generate(rt, neuronfx.init_state(rt, seed=3), prompts, sampling=sampling, eos_token_ids=NO_EOS,
                              async_decode=a)[0] for a in (False, True)]
    assert runs[0].token_ids == runs[1].token_ids and "stop" in runs[0].finish_reasons


def test_admission_and_abort_mid_run_match_solo_greedy(hf, rt):
    """The step API under the overlapped scheduler: requests arrive between iterations (some
    while a decode step is in flight), one is aborted while its step is in flight; every other
    request gets transformers' greedy tokens for it alone, the aborted one no event after the
    abort, and live slots always equal the running requests' slots."""
    flight, queue = neuronfx.init_state(rt), Queue()
    requests = [Request(prompt=tuple(random_prompt(n, seed=20 + n)), sampling=SamplingParams(max_tokens=m))
                for n, m in ((6, 9), (11, 14), (3, 5), (8, 7), (14, 10), (2, 6))]
    tokens: dict[int, list[int]] = {}
    arrivals = {0: [0, 1], 2: [2, 3], 4: [4], 5: [5]}  # iteration -> requests submitted before it
    aborted, in_flight_seen = None, 0
    it = 0
    while busy(flight, queue) or it <= max(arrivals):
        for i in arrivals.get(it, []):
            queue = submit(queue, i, requests[i])
        if aborted is None and it >= 6 and isinstance(flight, Pending):  # iteration 6 is synchronous (an admission)
            assert any(r.index == 1 for r in queue.running)
            flight, queue = overlap_abort(rt, flight, queue, 1)
            aborted = len(tokens[1])
        events, flight, queue = overlap_step(rt, flight, queue, frozenset())
        in_flight_seen += isinstance(flight, Pending)
        for ev in events:
            tokens.setdefault(ev.index, []).append(ev.token_id)
        live = flight.live
        assert sorted(r.slot for r in queue.running) == [s for s, on in enumerate(live) if on]
        it += 1
    state = settle(flight)
    assert state.free_slots == (0, 1, 2, 3) and in_flight_seen > it // 2 and 0 < aborted < requests[1].sampling.max_tokens
    for i, req in enumerate(requests):
        if i == 1:
            assert len(tokens[1]) == aborted and tokens[1] == hf_greedy(hf, list(req.prompt), aborted)
        else:
            assert tokens[i] == hf_greedy(hf, list(req.prompt), req.sampling.max_tokens), f"request {i}"


def gated(rt, gate: threading.Semaphore):
    """``rt`` whose graphs, when called from a worker thread, first wait for a permit of ``gate``."""
    main = threading.main_thread()

    def wrap(graph):
        def call(weights, kv, inputs):
            if threading.current_thread() is not main:
                assert gate.acquire(timeout=30)
            return graph(weights, kv, inputs)
        return call

    return attrs.evolve(rt, graphs={k: wrap(g) for k, g in rt.graphs.items()})


def test_tokens_are_delivered_while_the_next_step_runs(rt, tokenizer):
    """overlap_step returns step n's events while step n + 1's graph is still blocked in the
    worker thread: the host's delivery runs concurrently with the graph."""
    gate = threading.Semaphore(0)
    grt = gated(rt, gate)
    queue = submit(Queue(), 0, Request(prompt=(5, 6, 7), sampling=SamplingParams(max_tokens=6)))
    events, flight, queue = overlap_step(grt, neuronfx.init_state(grt), queue, frozenset(), tokenizer)
    assert [e.token_id for e in events] != [] and isinstance(flight, Pending)  # prefill + one synchronous decode, then a launch
    assert not flight._future.done()  # step 3's graph waits for the gate
    gate.release()
    events, flight, queue = overlap_step(grt, flight, queue, frozenset(), tokenizer)
    assert len(events) == 1 and events[0].text and isinstance(flight, Pending)
    assert not flight._future.done()  # step 3's token was delivered while step 4 is blocked
    gate.release(10)
    while busy(flight, queue):
        events, flight, queue = overlap_step(grt, flight, queue, frozenset(), tokenizer)


def test_launch_finish_equal_decode_step_and_keep_the_lease_rules(rt):
    """decode_launch + decode_finish give decode_step's output; the launched state is consumed
    at once; a bad batch raises before anything changes; a Pending is used once."""
    prompts = [random_prompt(6, seed=1), random_prompt(9, seed=2)]
    outs = []
    for overlapped in (False, True):
        state = neuronfx.init_state(rt)
        out, state = neuronfx.prefill_step(rt, state, PrefillBatch(seq_ids=[0, 2], prompts=prompts, sampling=[GREEDY] * 2))
        batch = DecodeBatch(seq_ids=[0, 2], input_ids=out.tokens, sampling=[GREEDY] * 2)
        if overlapped:
            with pytest.raises(SlotError, match="slot 1 must be a live request"):
                decode_launch(rt, state, attrs.evolve(batch, seq_ids=(0, 1)))
            assert not state.consumed  # checked before the hand-over
            pending = decode_launch(rt, state, batch)
            assert state.consumed and pending.free_slots == (1, 3)
            with pytest.raises(StateConsumedError):
                neuronfx.decode_step(rt, state, batch)
            with pytest.raises(InputError, match="slot 1 is not a live slot"):
                defer_release(pending, [1])
            later = defer_release(pending, [2])
            assert pending.consumed and later.free_slots == (1, 2, 3)
            with pytest.raises(StateConsumedError):
                decode_finish(pending)
            out, state = decode_finish(later)
            with pytest.raises(StateConsumedError):
                decode_finish(later)
            assert state.free_slots == (1, 2, 3) and state.cache_lens[0] == 7
        else:
            out, state = neuronfx.decode_step(rt, state, batch)
        outs.append(out)
    assert outs[0].tokens == outs[1].tokens and torch.equal(outs[0].logits, outs[1].logits)


def test_inputs_prepared_during_the_previous_step_are_used_and_exact(rt, monkeypatch):
    """prepare_next makes the next step's random numbers, min_tokens bias and prompt-mask rows
    while a step runs; decode_launch uses them when they fit (same rows, counts and key) and
    the tokens are decode_step's (seeded, unseeded, min_tokens)."""
    sampling = [SamplingParams(temperature=1.0, seed=3, min_tokens=3), SamplingParams(temperature=0.7)]
    made = []
    monkeypatch.setattr(overlap, "prepare", lambda *a: made.append(a[1]) or prepare(*a))
    runs = []
    for overlapped in (False, True):
        out, state = neuronfx.prefill_step(rt, neuronfx.init_state(rt, seed=9),
                                           PrefillBatch(seq_ids=[0, 2], prompts=[random_prompt(6, 1), random_prompt(9, 2)], sampling=sampling))
        tokens, pending = [], None
        for _ in range(4):
            batch = DecodeBatch(seq_ids=[0, 2], input_ids=out.tokens, sampling=sampling)
            if overlapped:
                pending = prepare_next(decode_launch(rt, state, batch, None if pending is None else pending.next), [0, 2], sampling)
                out, state = decode_finish(pending)
            else:
                out, state = neuronfx.decode_step(rt, state, batch)
            tokens.append(out.tokens)
        runs.append(tokens)
    assert runs[0] == runs[1]
    assert len(made) == 1 + 4  # the first launch made its own; every later one used the prepared inputs


def test_stops_for_sure_is_stop_check_without_stop_strings():
    from neuronfx.runtime.scheduler import stop_check

    eos = frozenset({2})
    for sp in (SamplingParams(), SamplingParams(min_tokens=3), SamplingParams(ignore_eos=True, stop_token_ids=(5,)),
               SamplingParams(stop_token_ids=(2, 5), min_tokens=2)):
        req = Request(prompt=(1,), sampling=attrs.evolve(sp, max_tokens=4))
        for count in range(1, 5):
            for token in (2, 5, 9):
                reason = stop_check(req, (9,) * (count - 1) + (token,), "", eos, 0)[0]
                assert stops_for_sure(req, count, token, eos) == (reason is not None), (sp, count, token)


def test_engine_async_streams_the_sync_tokens_and_aborts(rt, tokenizer):
    """The server engine with async_decode=True: the same events as generate, an abort ends a
    request at once; with a runtime that speculates it fails at start with a ConfigError (and
    generate overlaps on it with speculative=False)."""
    prompts = [random_prompt(n, seed=40 + n) for n in (4, 9, 6)]
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    want, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, sampling=sampling, tokenizer=tokenizer)

    async def scenario() -> tuple[dict, list]:
        engine = Engine(lambda: Served(runtime=rt, tokenizer=tokenizer), max_waiting=4, metrics=make_metrics(), async_decode=True)
        engine.start()
        while engine.served is None:
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        sink, doomed = Sink(loop, asyncio.Queue()), Sink(loop, asyncio.Queue())
        engine.submit([Request(prompt=tuple(p), sampling=attrs.evolve(sampling, max_tokens=8)) for p in prompts], sink)
        (long_id,) = engine.submit([Request(prompt=(3, 4), sampling=SamplingParams(max_tokens=50, ignore_eos=True))], doomed)
        got: dict[int, list] = {}
        while sum(e.finish_reason is not None for evs in got.values() for e in evs) < len(prompts):
            choice, event = await sink.queue.get()
            got.setdefault(choice, []).append(event)
        engine.abort([long_id])
        tail = []
        while not tail or tail[-1].finish_reason is None:
            tail.append((await doomed.queue.get())[1])
        engine.stop(timeout=10)
        return got, tail

    got, tail = asyncio.run(scenario())
    for b in range(len(prompts)):
        assert tuple(e.token_id for e in got[b]) == want.token_ids[b] and "".join(e.text for e in got[b]) == want.texts[b]
    assert tail[-1].finish_reason == "abort" and tail[-1].token_id is None

    failures = []
    spec_rt = tiny_runtime(tiny_hf_model("llama", seed=7), speculation_length=2, draft_layers=1, prefill_buckets=(32,),
                           decode_buckets=(64,))
    engine = Engine(lambda: Served(runtime=spec_rt, tokenizer=tokenizer), max_waiting=0, metrics=make_metrics(),
                    on_failure=failures.append, async_decode=True)
    engine.start()
    engine._thread.join(30)
    assert isinstance(engine.failure, ConfigError) and failures == [engine.failure]
    # with speculative=False the same runtime decodes plainly (its draft cache following) and overlaps
    plain = [neuronfx.generate(spec_rt, neuronfx.init_state(spec_rt), prompts, sampling=sampling, speculative=False,
                               async_decode=a)[0].token_ids for a in (False, True)]
    assert plain[0] == plain[1]


def test_bad_options(rt):
    with pytest.raises(InputError, match="async_decode='yes' must be True or False"):
        neuronfx.generate(rt, neuronfx.init_state(rt), [[1, 2]], async_decode="yes")
    with pytest.raises(InputError, match="async_decode=1 must be True or False"):
        Engine(lambda: None, max_waiting=0, metrics=make_metrics(), async_decode=1)
    tp = attrs.evolve(rt, plan=attrs.evolve(rt.plan, inference=attrs.evolve(rt.plan.inference, tp_degree=2)))
    with pytest.raises(ConfigError, match="tp_degree=2"):
        check_async(tp, speculative=False)
    # the CLI checks the same before anything loads
    flags = argparse.Namespace(async_decode=True, draft_model=None, no_speculation=False)
    speculating = InferenceConfig(speculation_length=2, draft_layers=1)
    with pytest.raises(ConfigError, match="add --no-speculation or drop --async-decode"):
        check_async_flags(flags, speculating)
    check_async_flags(argparse.Namespace(async_decode=True, draft_model=None, no_speculation=True), speculating)
    with pytest.raises(ConfigError, match="--tp-degree=2"):
        check_async_flags(flags, InferenceConfig(tp_degree=2))
