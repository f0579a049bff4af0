"""Request priority (vLLM's meaning): waiting requests are admitted lowest ``priority`` first, ties
in submission order, without preemption; results do not depend on it."""

from __future__ import annotations

import pytest
from helpers import hf_greedy, random_prompt, tiny_hf_model, tiny_runtime

import neuronfx
from neuronfx import SamplingParams
from neuronfx.errors import InputError
from neuronfx.runtime.scheduler import Queue, Request, step, submit

NO_EOS = frozenset()


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=7)


@pytest.fixture(scope="module")
def rt(hf):
    return tiny_runtime(hf)  # 4 slots


def request(length: int, seed: int, max_tokens: int, priority: int = 0) -> Request:
    return Request(prompt=tuple(random_prompt(length, seed)), sampling=SamplingParams(max_tokens=max_tokens), priority=priority)


def test_later_high_priority_request_is_admitted_before_earlier_low_ones(hf, rt):
    state, queue = neuronfx.init_state(rt), Queue()
    busy = [request(4 + i, seed=i, max_tokens=3 + 2 * i) for i in range(4)]  # they end one at a time
    for i, r in enumerate(busy):
        queue = submit(queue, i, r, runtime=rt)
    events, state, queue = step(rt, state, queue, NO_EOS)
    assert not queue.waiting and len(queue.running) == 4 and not state.free_slots
    late = {4: request(6, seed=14, max_tokens=4, priority=0), 5: request(5, seed=15, max_tokens=4, priority=0),
            6: request(7, seed=16, max_tokens=4, priority=-1)}  # submitted last, most urgent
    for i, r in late.items():
        queue = submit(queue, i, r, runtime=rt)
    assert [i for i, _ in queue.waiting] == [6, 4, 5]
    first: dict[int, int] = {}
    tokens: dict[int, list[int]] = {ev.index: [ev.token_id] for ev in events}
    iteration = 1
    while not queue.idle:
        events, state, queue = step(rt, state, queue, NO_EOS)
        for ev in events:
            first.setdefault(ev.index, iteration)
            tokens.setdefault(ev.index, []).append(ev.token_id)
        iteration += 1
    assert first[6] < first[4] < first[5]  # one slot frees per iteration: high priority first, then arrival order
    for i, r in {**dict(enumerate(busy)), **late}.items():
        assert tokens[i] == hf_greedy(hf, list(r.prompt), r.sampling.max_tokens), i


def test_ties_keep_arrival_order():
    queue = Queue()
    for i, priority in enumerate([1, 0, 1, 0, -2, 1]):
        queue = submit(queue, i, request(3, seed=i, max_tokens=2, priority=priority))
    assert [i for i, _ in queue.waiting] == [4, 1, 3, 0, 2, 5]


@pytest.mark.parametrize("async_decode", [False, True])
def test_generate_with_priority_gives_the_same_tokens(hf, rt, async_decode):
    prompts = [random_prompt(n, seed=30 + n) for n in (5, 9, 3, 12, 7, 4)]  # more prompts than slots
    plain, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=5, eos_token_ids=[])
    ranked, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=5, eos_token_ids=[],
                                  priority=[3, 0, 2, 1, -5, 2], async_decode=async_decode)
    assert ranked.token_ids == plain.token_ids
    assert [list(t) for t in ranked.token_ids] == [hf_greedy(hf, p, 5) for p in prompts]
    one, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=5, eos_token_ids=[], priority=7)
    assert one.token_ids == plain.token_ids
    seeded = SamplingParams(temperature=1.0, seed=3)  # n = 2 choices per prompt: each prompt's choices share its priority
    forked, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts[:3], max_new_tokens=5, eos_token_ids=[], n=2, sampling=seeded)
    ranked, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts[:3], max_new_tokens=5, eos_token_ids=[], n=2, sampling=seeded,
                                  priority=[2, 1, 0], async_decode=async_decode)
    assert ranked.token_ids == forked.token_ids


@pytest.mark.parametrize(("priority", "match"), [
    (True, r"priority=True must be one int, or one int per prompt \(2\)"),
    ([0], r"priority=\[0\] must be one int, or one int per prompt \(2\)"),
    ([0, 1.5], r"request 1: priority=1.5 must be an int"),
    ("high", r"priority='high' must be one int"),
])
def test_bad_priority_raises_before_any_change(rt, priority, match):
    state = neuronfx.init_state(rt)
    with pytest.raises(InputError, match=match):
        neuronfx.generate(rt, state, [[1, 2], [3]], priority=priority)
    with pytest.raises(InputError, match=r"request 0: priority=None must be an int"):
        submit(Queue(), 0, Request(prompt=(1,), sampling=SamplingParams(max_tokens=2), priority=None))
    result, _ = neuronfx.generate(rt, state, [[1, 2]], max_new_tokens=2, eos_token_ids=[])
    assert len(result.token_ids[0]) == 2
