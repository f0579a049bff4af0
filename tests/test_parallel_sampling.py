"""n > 1 choices per prompt (OpenAI's ``n``) through ``generate`` and the scheduler, on a tiny
llama (eager): the prompt is prefilled once and the other choices copy its KV
(``runtime/fork.py``); seeded choice c equals the prompt run alone with seed + c."""

from __future__ import annotations

import attrs
import pytest
from helpers import hf_greedy, random_prompt, tiny_hf_model, tiny_runtime

import neuronfx
from neuronfx import SamplingParams
from neuronfx.errors import InputError
from neuronfx.runtime.scheduler import Queue, Request, step, submit

SAMPLED = SamplingParams(temperature=1.0, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=5)


@pytest.fixture(scope="module")
def rt(hf):
    return tiny_runtime(hf)  # batch_size 4


def counted(rt):
    """``rt`` whose graph calls are counted per phase, and the counter."""
    calls: dict[str, int] = {}

    class Counting(dict):
        def __getitem__(self, key):
            calls[key[0]] = calls.get(key[0], 0) + 1
            return dict.__getitem__(self, key)

    return attrs.evolve(rt, graphs=Counting(rt.graphs)), calls


def run(rt, prompts, n=1, sampling=SAMPLED, max_new_tokens=12, **kw):
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, n=n, sampling=sampling, max_new_tokens=max_new_tokens, **kw)
    return [list(t) for t in result.token_ids]


def test_seeded_choices_equal_their_seed_alone_and_prefill_once(rt):
    """n = 4 seeded: four different choices, choice c equal to the prompt alone with seed + c;
    one prefill graph call, the other three choices one decode row each."""
    prompt = random_prompt(9, seed=1)
    counting, calls = counted(rt)
    choices = run(counting, [prompt], n=4)
    assert calls["prefill"] == 1
    alone = [run(rt, [prompt], sampling=attrs.evolve(SAMPLED, seed=11 + c))[0] for c in range(4)]
    assert choices == alone
    assert len({tuple(c) for c in choices}) == 4


def test_greedy_choices_are_identical_and_equal_transformers(rt, hf):
    prompt = random_prompt(7, seed=2)
    choices = run(rt, [prompt], n=4, sampling=SamplingParams(ignore_eos=True), max_new_tokens=8)
    assert choices == [hf_greedy(hf, prompt, 8)] * 4


def test_two_prompts_more_choices_than_slots(rt):
    """2 prompts x n = 3 over 4 slots: choices wait for slots (a choice whose first choice has
    finished is prefilled itself); each still equals its seed alone, entries prompt-major."""
    prompts = [random_prompt(6, seed=3), random_prompt(11, seed=4)]
    choices = run(rt, prompts, n=3, max_new_tokens=6)
    alone = [run(rt, [p], sampling=attrs.evolve(SAMPLED, seed=11 + c), max_new_tokens=6)[0] for p in prompts for c in range(3)]
    assert choices == alone


def test_one_token_prompt_and_async_decode(rt):
    """A prompt of one token copies nothing and decodes it at position 0; overlapped decode
    gives the same choices."""
    choices = run(rt, [[5]], n=3)
    assert choices == [run(rt, [[5]], sampling=attrs.evolve(SAMPLED, seed=11 + c))[0] for c in range(3)]
    assert run(rt, [[5]], n=3, async_decode=True) == choices


def test_scheduler_forks_a_running_parent(rt):
    """A request naming a running parent with the same prompt is forked from its slot; one
    naming a parent with another prompt is prefilled: both equal their runs alone."""
    prompt, other = random_prompt(8, seed=5), random_prompt(8, seed=6)
    counting, calls = counted(rt)
    first, second = attrs.evolve(SAMPLED, max_tokens=12), attrs.evolve(SAMPLED, seed=12, max_tokens=12)
    state, queue = neuronfx.init_state(counting), submit(Queue(), 0, Request(prompt=tuple(prompt), sampling=first), counting)
    tokens: dict[int, list[int]] = {}
    events, state, queue = step(counting, state, queue, frozenset())
    queue = submit(queue, 1, Request(prompt=tuple(prompt), sampling=second, parent=0), counting)
    queue = submit(queue, 2, Request(prompt=tuple(other), sampling=second, parent=0), counting)
    while not queue.idle:
        for ev in events:
            tokens.setdefault(ev.index, []).append(ev.token_id)
        events, state, queue = step(counting, state, queue, frozenset())
    for ev in events:
        tokens.setdefault(ev.index, []).append(ev.token_id)
    assert calls["prefill"] == 2  # request 0, then request 2 (request 1 forked)
    assert tokens[1] == run(rt, [prompt], sampling=second)[0] and tokens[2] == run(rt, [other], sampling=second)[0]


@pytest.mark.parametrize("n", [0, -1, 129, True, 2.0])
def test_bad_n_is_an_error_before_anything_runs(rt, n):
    state = neuronfx.init_state(rt)
    with pytest.raises(InputError, match=r"n=.* must be an int in \[1, 128\]"):
        neuronfx.generate(rt, state, [[1, 2, 3]], n=n)
    assert not state.consumed


def test_bad_parent_is_an_error(rt):
    with pytest.raises(InputError, match="parent=3 must be None or the index of an earlier request"):
        submit(Queue(), 2, Request(prompt=(1, 2), sampling=SAMPLED, parent=3), rt)


@pytest.mark.parametrize("kind", ["self", "draft-model"])
def test_choices_under_speculation(hf, rt, kind):
    """Speculating runtimes fork too (a draft model's cache is copied with the target's):
    greedy choices equal plain greedy, seeded choices their seed alone on the same runtime."""
    spec = tiny_runtime(hf, "eager", speculation_length=3, **({"draft_layers": 1} if kind == "self" else {}))
    if kind == "draft-model":
        spec = neuronfx.with_draft(spec, tiny_runtime(tiny_hf_model("llama", seed=9), "eager", output_logits=True))
    prompt = random_prompt(10, seed=7)
    greedy = SamplingParams(ignore_eos=True)
    assert run(spec, [prompt], n=3, sampling=greedy) == [run(rt, [prompt], sampling=greedy)[0]] * 3
    seeded = run(spec, [prompt], n=3)
    assert seeded == [run(spec, [prompt], sampling=attrs.evolve(SAMPLED, seed=11 + c))[0] for c in range(3)]


@pytest.mark.parametrize("options", [{"prefill_chunk_size": 8, "prefill_buckets": None}, {"enable_prefix_caching": True}],
                         ids=["chunked-prefill", "prefix-caching"])
def test_choices_with_chunked_prefill_and_prefix_caching(hf, options):
    """A prompt longer than a chunk is chunked once and forked after its last chunk; with prefix
    caching the first choice prefills through the cache: choices equal their seeds alone."""
    rt = tiny_runtime(hf, **options)
    prompt = random_prompt(20, seed=8)
    counting, calls = counted(rt)
    choices = run(counting, [prompt], n=3)
    assert choices == [run(rt, [prompt], sampling=attrs.evolve(SAMPLED, seed=11 + c))[0] for c in range(3)]
    assert calls.get("chunk", 0) + calls.get("prefill", 0) == (3 if "prefill_chunk_size" in options else 1)


def test_choices_asking_prompt_logprobs_each_get_them(hf):
    """A choice asking for prompt logprobs is prefilled itself (a fork computes no prompt
    logits): every choice carries the same prompt logprobs."""
    rt = tiny_runtime(hf, enable_prompt_logprobs=True)
    prompt = random_prompt(9, seed=9)
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [prompt], n=2, sampling=attrs.evolve(SAMPLED, prompt_logprobs=2),
                                  max_new_tokens=4)
    first, second = result.prompt_logprobs
    assert len(first) == 9 and first[0] is None and first[1] is not None and first == second
