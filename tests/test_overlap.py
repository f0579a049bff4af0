"""Overlapped (async) scheduling (``runtime/overlap.py``) on tiny llamas (eager): the same tokens,
texts and events as the synchronous scheduler for greedy and seeded sampling, plain, speculating
(self-draft and a draft runtime), with chunked prefill and prefix caching, over tensor-parallel
ranks and on inductor, with requests finishing at different steps (stop ids, stop strings,
min_tokens, max_tokens), admission and abort mid-run; the extra tokens of a request stopped by a
stop string are never emitted; the launch / finish lease rules; the server engine's async loop.
"""

from __future__ import annotations

import asyncio
import threading

import attrs
import pytest
import torch
from helpers import GREEDY, VOCAB, hf_greedy, random_prompt, tiny_hf_model, tiny_runtime
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import neuronfx
from neuronfx import SamplingParams
from neuronfx.errors import InputError, StateConsumedError
from neuronfx.runtime import overlap
from neuronfx.runtime.delivery import stop_check, stops_for_sure
from neuronfx.runtime.generate import collect
from neuronfx.runtime.overlap import Pending, busy, defer, finish, launch, overlap_abort, overlap_step, settle
from neuronfx.runtime.requests import Queue, Request, TokenEvent, submit
from neuronfx.runtime.scheduler import execute, plan
from neuronfx.server.engine import Engine, Sink
from neuronfx.server.metrics import make_metrics
from neuronfx.server.served import Served

NO_EOS: list[int] = []
PROMPT_LENS = (5, 17, 3, 12, 7, 9, 1)  # 7 requests, 4 slots: three are admitted mid-run; 17 and 12 are chunked at C = 8
CHUNKED = dict(prefill_chunk_size=8, prefill_buckets=None, enable_prefix_caching=True, prefix_block_size=4)
RUNTIMES = {
    "plain": {},
    "self-draft": dict(speculation_length=3, draft_layers=1),
    "chunked-prefix-cache": CHUNKED,
}


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=7)


@pytest.fixture(scope="module")
def runtimes(hf):
    """Each RUNTIMES entry compiled once (batch_size 4: batch buckets (1, 2, 4)), and a target
    with a draft runtime attached."""
    out = {name: tiny_runtime(hf, **options) for name, options in RUNTIMES.items()}
    target = tiny_runtime(hf, speculation_length=3)
    out["draft-runtime"] = neuronfx.with_draft(target, tiny_runtime(tiny_hf_model("llama", seed=8), output_logits=True))
    return out


@pytest.fixture(scope="module")
def rt(runtimes):
    return runtimes["plain"]


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
    different steps and for every reason: max_tokens, a stop id, a stop string over two tokens
    (cut, or kept), a stop id held back by min_tokens, max_tokens 1."""
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


def prompts() -> list[list[int]]:
    return [random_prompt(n, seed=n) for n in PROMPT_LENS]


def run(rt, tokenizer, sampling, async_decode):
    events = list(neuronfx.stream_generate(rt, neuronfx.init_state(rt, seed=5), prompts(), max_new_tokens=12, sampling=sampling,
                                           tokenizer=tokenizer, eos_token_ids=NO_EOS, async_decode=async_decode))
    assert isinstance(events[-1], neuronfx.Finished) and events[-1].state.free_slots == (0, 1, 2, 3)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    by_request = {i: [e for e in tokens if e.index == i] for i in range(len(PROMPT_LENS))}
    return by_request, collect(iter(events), True)[0]


def base_sampling(kind: str) -> list[SamplingParams]:
    if kind == "greedy":
        return [SamplingParams(logprobs=2)] * len(PROMPT_LENS)
    # seeded rows draw by (seed, token index): the same draws whatever the batch
    return [SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=100 + i, presence_penalty=0.3, repetition_penalty=1.2,
                           logprobs=2) for i in range(len(PROMPT_LENS))]


def spy_rescheduled(monkeypatch) -> list[int]:
    """Requests a stop string ended while they were scheduled in the iteration in flight."""
    rescheduled: list[int] = []

    def spy(pending, retire=(), aborted=()):
        it = pending.iteration
        scheduled = {r.index for r in (*it.decode, *it.speculate, *it.refill, *it.prefill)}
        rescheduled.extend(r.index for r in retire if r.index in scheduled)
        return defer(pending, retire, aborted)

    monkeypatch.setattr(overlap, "defer", spy)
    return rescheduled


@pytest.mark.parametrize("name", ["plain", "self-draft", "draft-runtime", "chunked-prefix-cache"])
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_async_equals_sync_events_tokens_and_texts(runtimes, tokenizer, kind, name, monkeypatch):
    """Every request's events (token ids, text deltas, finish and stop reasons, logprobs) are
    the synchronous scheduler's, speculating or not, with chunked prefill and prefix caching: a
    request stopped by a stop string is scheduled once more, but its extra tokens never reach
    the stream (no event, not in token_ids)."""
    rt, base = runtimes[name], base_sampling(kind)
    first, _ = neuronfx.generate(rt, neuronfx.init_state(rt, seed=5), prompts(), max_new_tokens=12, sampling=base, eos_token_ids=NO_EOS)
    sampling = stopping(base, first.token_ids)
    sync_events, sync = run(rt, tokenizer, sampling, async_decode=False)
    rescheduled = spy_rescheduled(monkeypatch)
    async_events, overlapped = run(rt, tokenizer, sampling, async_decode=True)
    assert rescheduled  # a request ended by a stop string rode one extra iteration; its extra tokens are not in the stream

    reasons = sync.finish_reasons
    assert reasons[:4] + reasons[5:] == ("length", "stop", "stop", "length", "stop", "length")  # 4: min_tokens may change its path
    assert overlapped.token_ids == sync.token_ids and overlapped.texts == sync.texts
    assert overlapped.finish_reasons == sync.finish_reasons and overlapped.stop_reasons == sync.stop_reasons
    assert overlapped.speculation == sync.speculation
    assert len(sync.token_ids[0]) == 3 and len(sync.token_ids[6]) == 1
    for i, evs in async_events.items():
        want = sync_events[i]
        assert [(e.token_id, e.text, e.finish_reason, e.stop_reason) for e in evs] == \
               [(e.token_id, e.text, e.finish_reason, e.stop_reason) for e in want], f"request {i}"
        assert [e.finish_reason is not None for e in evs] == [False] * (len(evs) - 1) + [True]  # nothing after the last
        for a, b in zip(evs, want):  # the same token from the same cache: logprobs agree (batch size may differ)
            assert a.logprobs.top_ids == b.logprobs.top_ids
            assert torch.allclose(torch.tensor(a.logprobs.top_logprobs), torch.tensor(b.logprobs.top_logprobs), atol=1e-5)


def test_speculating_async_tokens_are_greedy_decoding(hf, runtimes):
    """Greedy speculation is token-identical to plain greedy decoding, overlapped or not (and
    transformers' greedy tokens for each prompt alone)."""
    want = [tuple(hf_greedy(hf, p, 10)) for p in prompts()]
    for name in ("self-draft", "draft-runtime", "chunked-prefix-cache"):
        rt = runtimes[name]
        got, state = neuronfx.generate(rt, neuronfx.init_state(rt), prompts(), max_new_tokens=10, eos_token_ids=NO_EOS, async_decode=True)
        assert list(got.token_ids) == want, name
        assert state.free_slots == (0, 1, 2, 3)
        if name != "chunked-prefix-cache":
            assert all(s.drafted > 0 for s in got.speculation), name


@pytest.mark.parametrize("name", ["plain", "self-draft", "chunked-prefix-cache"])
def test_unseeded_sampling_equals_sync_without_stop_strings(runtimes, name):
    """Without stop strings every request leaves the batch at the iteration it would
    synchronously, so even unseeded rows (drawn from the state's key by row position) sample
    the same tokens."""
    rt = runtimes[name]
    base = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4 + i) for i in range(len(PROMPT_LENS))]
    first, _ = neuronfx.generate(rt, neuronfx.init_state(rt, seed=3), prompts(), sampling=base, eos_token_ids=NO_EOS)
    sampling = [attrs.evolve(sp, stop_token_ids=(out[2],)) if i % 2 else sp for i, (sp, out) in enumerate(zip(base, first.token_ids))]
    runs = [neuronfx.generate(rt, neuronfx.init_state(rt, seed=3), prompts(), sampling=sampling, eos_token_ids=NO_EOS,
                              async_decode=a)[0] for a in (False, True)]
    assert runs[0].token_ids == runs[1].token_ids and "stop" in runs[0].finish_reasons


def drive(rt, requests, arrivals, abort_at, budget=None):
    """The overlapped scheduler through the step API: ``requests[i]`` submitted before iteration
    ``arrivals``' key, request ``abort_at[1]`` aborted at iteration ``abort_at[0]`` (while an
    iteration is in flight); (tokens per request, tokens the aborted one had, final state).
    Live slots always equal the running and prefilling requests' slots."""
    flight, queue, tokens, aborted, it = neuronfx.init_state(rt), Queue(), {}, None, 0
    while busy(flight, queue) or it <= max(arrivals):
        for i in arrivals.get(it, []):
            queue = submit(queue, i, requests[i])
        if it == abort_at[0]:
            assert isinstance(flight, Pending) and any(r.index == abort_at[1] for r in queue.running + queue.prefilling)
            flight, queue = overlap_abort(rt, flight, queue, abort_at[1])
            aborted = len(tokens.get(abort_at[1], []))
        events, flight, queue = overlap_step(rt, flight, queue, frozenset(), max_num_batched_tokens=budget)
        for ev in events:
            tokens.setdefault(ev.index, []).append(ev.token_id)
        assert sorted(r.slot for r in queue.running + queue.prefilling) == [s for s, on in enumerate(flight.live) if on]
        it += 1
    return tokens, aborted, settle(flight)


def test_admission_and_abort_mid_run_match_solo_greedy(hf, rt):
    """Requests arrive between iterations (while one is in flight), one is aborted while its step
    is in flight; every other request gets transformers' greedy tokens for it alone, the aborted
    one no event after the abort."""
    requests = [Request(prompt=tuple(random_prompt(n, seed=20 + n)), sampling=SamplingParams(max_tokens=m))
                for n, m in ((6, 9), (11, 14), (3, 5), (8, 7), (14, 10), (2, 6))]
    tokens, aborted, state = drive(rt, requests, {0: [0, 1], 2: [2, 3], 4: [4], 5: [5]}, (6, 1))
    assert state.free_slots == (0, 1, 2, 3) and 0 < aborted < requests[1].sampling.max_tokens
    for i, req in enumerate(requests):
        n = aborted if i == 1 else req.sampling.max_tokens
        assert tokens.get(i, []) == hf_greedy(hf, list(req.prompt), n), f"request {i}"


def test_abort_of_a_chunked_prompt_in_flight_gives_its_prefix_blocks_back(hf, runtimes):
    """With chunked prefill and prefix caching, a long prompt sharing blocks with a finished one
    is aborted while one of its chunks is in flight: its references on the cached blocks are
    given back when the chunk returns (none leak), and the others get their solo greedy tokens."""
    rt = runtimes["chunked-prefix-cache"]
    shared = random_prompt(24, seed=3)
    requests = [Request(prompt=tuple(shared[:20]), sampling=SamplingParams(max_tokens=3)),
                Request(prompt=tuple(shared + random_prompt(8, seed=4)), sampling=SamplingParams(max_tokens=4)),
                Request(prompt=tuple(random_prompt(5, seed=5)), sampling=SamplingParams(max_tokens=6))]
    tokens, aborted, state = drive(rt, requests, {0: [0], 5: [1, 2]}, (7, 1), budget=6)
    assert aborted == 0 and state.free_slots == (0, 1, 2, 3)
    assert neuronfx.prefix_stats(state).hits > 0  # request 1 reused request 0's blocks before it was aborted
    assert all(e.refs == 0 for e in state.prefix.store.entries.values())
    for i in (0, 2):
        assert tokens[i] == hf_greedy(hf, list(requests[i].prompt), requests[i].sampling.max_tokens), f"request {i}"


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


def test_tokens_are_delivered_while_the_next_iteration_runs(rt, tokenizer):
    """overlap_step returns iteration n's events while iteration n + 1's graph is still blocked
    in the worker thread: the host's delivery runs concurrently with the graph."""
    gate = threading.Semaphore(0)
    grt = gated(rt, gate)
    queue = submit(Queue(), 0, Request(prompt=(5, 6, 7), sampling=SamplingParams(max_tokens=6)))
    events, flight, queue = overlap_step(grt, neuronfx.init_state(grt), queue, frozenset(), tokenizer)
    assert events == [] and isinstance(flight, Pending) and not flight.done  # the prefill waits for the gate
    gate.release()
    events, flight, queue = overlap_step(grt, flight, queue, frozenset(), tokenizer)
    assert len(events) == 1 and events[0].text and isinstance(flight, Pending)
    assert not flight.done  # the prefill's token was delivered while the first decode is blocked
    gate.release(10)
    while busy(flight, queue):
        events, flight, queue = overlap_step(grt, flight, queue, frozenset(), tokenizer)


def test_launch_finish_equal_execute_and_keep_the_lease_rules(rt):
    """launch + finish run scheduler.execute: the same outputs as running it synchronously; the
    launched state is consumed at once; a Pending is used once (defer returns a new one)."""
    queue = Queue()
    for i, n in enumerate((6, 9)):
        queue = submit(queue, i, Request(prompt=tuple(random_prompt(n, seed=i)), sampling=SamplingParams(max_tokens=4)))
    outs = []
    for overlapped in (False, True):
        it, state, _ = plan(rt, neuronfx.init_state(rt), queue, None, True)
        if overlapped:
            pending = launch(rt, state, it)
            assert state.consumed and pending.free_slots == (2, 3)
            with pytest.raises(StateConsumedError):
                neuronfx.release(rt, state, [0])
            later = defer(pending, aborted=it.prefill[1:])
            assert pending.consumed and later.free_slots == (1, 2, 3)
            with pytest.raises(StateConsumedError, match="already finished or replaced"):
                finish(pending)
            ran, state = finish(later)
            with pytest.raises(StateConsumedError):
                finish(later)
            assert state.free_slots == (1, 2, 3) and state.cache_lens[0] == 6
        else:
            ran, state = execute(rt, state, it)
        outs.append(ran[0].out)
    assert outs[0].tokens == outs[1].tokens and torch.equal(outs[0].logits, outs[1].logits)


def test_stops_for_sure_is_stop_check_without_stop_strings():
    eos = frozenset({2})
    for sp in (SamplingParams(), SamplingParams(min_tokens=3), SamplingParams(ignore_eos=True, stop_token_ids=(5,)),
               SamplingParams(stop_token_ids=(2, 5), min_tokens=2)):
        req = Request(prompt=(1,), sampling=attrs.evolve(sp, max_tokens=4))
        for count in range(1, 5):
            for token in (2, 5, 9):
                reason = stop_check(req, (9,) * (count - 1) + (token,), "", eos, 0)[0]
                assert stops_for_sure(req, count, token, eos) == (reason is not None), (sp, count, token)


def engine_run(rt, tokenizer, prompts, sampling, **options) -> tuple[dict, list]:
    """Run ``prompts`` and a long request through an async Engine; abort the long one once the
    others finished: (events per prompt, the long one's events)."""

    async def scenario() -> tuple[dict, list]:
        engine = Engine(lambda: Served(runtime=rt, tokenizer=tokenizer), max_waiting=4, metrics=make_metrics(), async_decode=True,
                        **options)
        engine.start()
        while engine.served is None:
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        sink, doomed = Sink(loop, asyncio.Queue()), Sink(loop, asyncio.Queue())
        engine.submit([Request(prompt=tuple(p), sampling=sampling) for p in prompts], sink)
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

    return asyncio.run(scenario())


@pytest.mark.parametrize("name", ["plain", "self-draft", "chunked-prefix-cache"])
def test_engine_async_streams_the_sync_tokens_and_aborts(runtimes, tokenizer, name):
    """The server engine with async_decode=True streams generate's events (speculating, or with
    chunked prefill, prefix caching and a token budget); an abort ends a request at once."""
    rt = runtimes[name]
    prompts_ = [random_prompt(n, seed=40 + n) for n in (4, 19, 6)]
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    want, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts_, sampling=sampling, tokenizer=tokenizer)
    got, tail = engine_run(rt, tokenizer, prompts_, sampling, max_num_batched_tokens=9 if name.startswith("chunked") else None)
    for b in range(len(prompts_)):
        assert tuple(e.token_id for e in got[b]) == want.token_ids[b] and "".join(e.text for e in got[b]) == want.texts[b]
    assert tail[-1].finish_reason == "abort" and tail[-1].token_id is None


def test_bad_options(rt):
    with pytest.raises(InputError, match="async_decode='yes' must be True or False"):
        neuronfx.generate(rt, neuronfx.init_state(rt), [[1, 2]], async_decode="yes")
    with pytest.raises(InputError, match="async_decode=1 must be True or False"):
        Engine(lambda: None, max_waiting=0, metrics=make_metrics(), async_decode=1)
    with pytest.raises(InputError, match="max_num_batched_tokens=0"):
        list(overlap.overlap_schedule(rt, neuronfx.init_state(rt), [], frozenset(), max_num_batched_tokens=0))


# --- tensor parallel and inductor ----------------------------------------------------------------


def tp_tokens(tp: int) -> tuple:
    """Greedy and seeded tokens of a self-speculating tiny llama at ``tp_degree=tp``, synchronous
    and overlapped (runs on every rank of a launch)."""
    hf = tiny_hf_model("llama", seed=7, vocab_size=257)
    rt = tiny_runtime(hf, tp_degree=tp, speculation_length=3, draft_layers=1)
    seeded = [SamplingParams(temperature=0.8, seed=i) for i in range(len(PROMPT_LENS))]
    return tuple(neuronfx.generate(rt, neuronfx.init_state(rt), prompts(), max_new_tokens=8, eos_token_ids=NO_EOS, sampling=sp,
                                   async_decode=a)[0].token_ids for sp in (GREEDY, seeded) for a in (False, True))


def test_tensor_parallel_ranks_overlap(hf):
    """At tp_degree=2 each rank runs its iterations in its worker thread (the collectives in
    the same order on every rank): the overlapped tokens are the synchronous ones and tp=1's."""
    want = tp_tokens(1)
    got = neuronfx.launch(tp_tokens, 2, tp_degree=2, threads=1)
    assert want[0] == want[1] and want[2] == want[3] and got == want


def test_inductor_speculative_async_equals_sync(inductor_speculative):
    """A compiled (inductor) self-speculating runtime, overlapped: the synchronous tokens,
    greedy and seeded."""
    _, rt = inductor_speculative
    seeded = [SamplingParams(temperature=0.8, seed=i) for i in range(3)]
    for sp in (GREEDY, seeded):
        runs = [neuronfx.generate(rt, neuronfx.init_state(rt), prompts()[:3], max_new_tokens=8, eos_token_ids=NO_EOS, sampling=sp,
                                  async_decode=a)[0].token_ids for a in (False, True)]
        assert runs[0] == runs[1]
