"""Input normalisation and the order of input checks in generate / init_state (tiny llama, eager)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import GREEDY, tiny_hf_model, tiny_runtime

import neuronfx
from neuronfx.errors import InputError, PromptTooLongError, SamplingParamsError, SequenceLengthExceededError
from neuronfx.runtime.generate import normalize_prompts


@pytest.fixture(scope="module")
def rt():
    return tiny_runtime(tiny_hf_model("llama", seed=0))


def test_prompt_too_long_is_reported_before_total_length(rt):
    # 40 tokens > max_context_length=32 and 40 + 30 > sequence_length=64: the prompt is the fix.
    state = neuronfx.init_state(rt)
    with pytest.raises(PromptTooLongError, match="max_context_length=32"):
        neuronfx.generate(rt, state, [list(range(40))], max_new_tokens=30)
    assert not state.consumed
    with pytest.raises(SequenceLengthExceededError, match="sequence_length=64"):
        neuronfx.generate(rt, state, [list(range(30))], max_new_tokens=40)


@pytest.mark.parametrize(
    "ids, expected",
    [
        ([3, 4, 5], [[3, 4, 5]]),
        ([[3, 4], [5]], [[3, 4], [5]]),
        (torch.tensor([3, 4]), [[3, 4]]),
        (torch.tensor([[3, 4], [5, 6]], dtype=torch.int32), [[3, 4], [5, 6]]),
        (np.array([3, 4], dtype=np.int64), [[3, 4]]),
        ([np.int64(3), np.int32(4)], [[3, 4]]),
        ([np.array([3, 4]), [5]], [[3, 4], [5]]),
        ([torch.tensor(3), torch.tensor(4)], [[3, 4]]),  # 0-d tensors are ids, like numpy integers
        ([np.int64(3), torch.tensor(4)], [[3, 4]]),
    ],
)
def test_normalize_prompts_accepts_ints_tensors_and_numpy(ids, expected):
    out = normalize_prompts(ids)
    assert out == expected and all(type(t) is int for row in out for t in row)


@pytest.mark.parametrize("ids", [[[[1, 2]]], ["ab"], [True, False], [1.0, 2.0], torch.tensor([1.0]), np.zeros((2, 2, 2), dtype=np.int64),
                                 b"abc", bytearray(b"ab"), {1, 2, 3}, None, 5, np.array(["a", "b"]), [torch.tensor(1.5)]])
def test_normalize_prompts_rejects_wrong_shapes_and_types(ids):
    with pytest.raises(InputError):
        normalize_prompts(ids)


def test_numpy_prompt_generates_like_list(rt):
    a, _ = neuronfx.generate(rt, neuronfx.init_state(rt), np.array([5, 9, 11]), max_new_tokens=4, eos_token_ids=[])
    b, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [5, 9, 11], max_new_tokens=4, eos_token_ids=[])
    assert a.token_ids == b.token_ids


def test_eos_accepts_single_id(rt):
    ref, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [5, 9, 11], max_new_tokens=8, eos_token_ids=[])
    stop = ref.token_ids[0][2]
    out, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [5, 9, 11], max_new_tokens=8, eos_token_ids=stop)
    first = ref.token_ids[0].index(stop)
    assert out.token_ids[0] == ref.token_ids[0][: first + 1] and out.finish_reasons == ("stop",)


@pytest.mark.parametrize("bad", [{"eos_token_ids": "2"}, {"eos_token_ids": [1.5]}, {"sampling": {"temperature": 1.0}}, {"sampling": [None]}])
def test_bad_generate_options_raise_input_error_before_any_change(rt, bad):
    state = neuronfx.init_state(rt)
    with pytest.raises(InputError):
        neuronfx.generate(rt, state, [5, 9], max_new_tokens=2, **bad)
    assert not state.consumed


@pytest.mark.parametrize("seed", [-1, 2**63, 1.7, "a", True])
def test_init_state_rejects_bad_seed(rt, seed):
    with pytest.raises(InputError, match="seed"):
        neuronfx.init_state(rt, seed)


def test_largest_seed_works(rt):
    out, _ = neuronfx.generate(rt, neuronfx.init_state(rt, 2**63 - 1), [5, 9], max_new_tokens=2, eos_token_ids=[],
                               sampling=neuronfx.SamplingParams(temperature=1.0))
    assert len(out.token_ids[0]) == 2


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_bool_sampling_values_rejected(rt, field):
    with pytest.raises(SamplingParamsError, match=field):
        neuronfx.generate(rt, neuronfx.init_state(rt), [5, 9], max_new_tokens=2, sampling=neuronfx.SamplingParams(**{field: True}))


def test_prefill_batch_rejects_non_list_prompt():
    with pytest.raises(InputError, match="row 0"):
        neuronfx.PrefillBatch(seq_ids=[0], prompts=[5], sampling=[GREEDY])


def test_caller_eos_is_eos_and_ignore_eos_still_ignores_it(rt):
    prompt = [5, 9, 11]
    ref, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompt, max_new_tokens=8, eos_token_ids=[])
    eos = ref.token_ids[0][2]
    first = ref.token_ids[0].index(eos)
    stopped, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompt, max_new_tokens=8, eos_token_ids=[eos])
    assert stopped.token_ids[0] == ref.token_ids[0][: first + 1]
    assert stopped.finish_reasons == ("stop",) and stopped.stop_reasons == (None,)  # eos, not a stop id
    ignored, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompt, max_new_tokens=8, eos_token_ids=[eos],
                                   sampling=neuronfx.SamplingParams(ignore_eos=True))
    assert ignored.token_ids == ref.token_ids and ignored.finish_reasons == ("length",)
