"""OpenAI's ``logit_bias`` (``SamplingParams.logit_bias``): the bias is added on the host to the
sampler's ``logits_bias`` input, so it reaches prefill, decode, chunked prefill and speculation.
Greedy with a bias equals transformers' ``generate`` with the same bias (``sequence_bias`` on
one-token sequences), token for token; bad ids and values raise SamplingParamsError (the CLI's
``--logit-bias`` syntax InputError)."""

from __future__ import annotations

import pytest
import torch
from helpers import random_prompt, tiny_hf_model, tiny_plan, tiny_runtime

import neuronfx
from neuronfx import SamplingParams
from neuronfx.cli.options import logit_bias_from_args
from neuronfx.errors import InputError, SamplingParamsError

N = 8
NO_EOS: list[int] = []


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=3)


@pytest.fixture(scope="module")
def rt(hf):
    return tiny_runtime(hf)


@torch.no_grad()
def hf_biased(hf, prompt: list[int], bias: dict[int, float]) -> list[int]:
    """transformers' greedy N tokens with ``bias`` added to each token's logit at every step."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N, eos_token_id=None,
                      pad_token_id=0, sequence_bias={(t,): b for t, b in bias.items()})
    return out[0, len(prompt):].tolist()


def run(rt, prompts, sampling, **kw) -> list[list[int]]:
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=N, sampling=sampling,
                                  eos_token_ids=NO_EOS, **kw)
    return [list(t) for t in result.token_ids]


PROMPTS = [random_prompt(n, seed=40 + n) for n in (5, 11, 3)]


def test_minus_100_on_the_greedy_token_equals_transformers(hf, rt):
    plain = run(rt, PROMPTS, SamplingParams())
    banned = [{p[0]: -100.0} for p in plain]  # each prompt bans its own plain greedy first token
    biased = run(rt, PROMPTS, [SamplingParams(logit_bias=b) for b in banned])
    for prompt, tokens, before, bias in zip(PROMPTS, biased, plain, banned):
        assert tokens == hf_biased(hf, prompt, bias)
        assert tokens != before and tokens[0] != before[0]
        assert before[0] not in tokens


def test_bias_of_several_tokens_equals_transformers(hf, rt):
    plain = run(rt, PROMPTS[:1], SamplingParams())[0]
    bias = {plain[0]: -100.0, plain[1]: -7.5, 17: 3.25}
    assert run(rt, PROMPTS[:1], SamplingParams(logit_bias=bias))[0] == hf_biased(hf, PROMPTS[0], bias)


def test_plus_100_forces_a_token_every_step(rt):
    forced = run(rt, PROMPTS, [SamplingParams(logit_bias={t: 100.0}) for t in (9, 200, 0)])
    assert forced == [[9] * N, [200] * N, [0] * N]
    sampled = run(rt, PROMPTS[:1], SamplingParams(temperature=1.0, seed=5, logit_bias={42: 100.0}))
    assert sampled == [[42] * N]


def test_bias_in_chunked_prefill_equals_transformers(hf):
    rt = tiny_runtime(hf, prefill_chunk_size=8, prefill_buckets=None)
    prompt = random_prompt(20, seed=8)  # three chunks; the last samples the first token
    plain = run(rt, [prompt], SamplingParams())[0]
    bias = {plain[0]: -100.0}
    assert run(rt, [prompt], SamplingParams(logit_bias=bias))[0] == hf_biased(hf, prompt, bias)


@pytest.mark.parametrize("async_decode", [False, True])
def test_speculation_gives_the_non_speculative_biased_tokens(hf, rt, async_decode):
    spec = tiny_runtime(hf, speculation_length=4, draft_layers=1)
    plain = run(rt, PROMPTS, SamplingParams())
    sampling = [SamplingParams(logit_bias={p[0]: -100.0, p[2]: -100.0}) for p in plain]
    result, _ = neuronfx.generate(spec, neuronfx.init_state(spec), PROMPTS, max_new_tokens=N, sampling=sampling,
                                  eos_token_ids=NO_EOS, async_decode=async_decode)
    assert result.speculation is not None and all(s.target_passes >= 1 for s in result.speculation)
    assert [list(t) for t in result.token_ids] == run(rt, PROMPTS, sampling)


def biased_tokens(biases: list[dict[int, float]], tp: int = 2) -> list[list[int]]:
    """Greedy tokens of PROMPTS with ``biases`` (one per prompt) on the tiny llama at ``tp`` (runs on every rank)."""
    hf = tiny_hf_model("llama", seed=3)
    rt = neuronfx.compile(tiny_plan(hf, tp_degree=tp), hf.state_dict(), progress=False, cache=False)
    return run(rt, PROMPTS, [SamplingParams(logit_bias=b) for b in biases])


def test_tensor_parallel_applies_the_bias_on_every_rank(hf, rt):
    plain = run(rt, PROMPTS, SamplingParams())
    biases = [{plain[0][0]: -100.0}, {plain[1][0]: -100.0, 77: 4.0}, {31: 100.0}]
    ranks = neuronfx.launch(biased_tokens, biases, tp_degree=2, threads=1)
    want = run(rt, PROMPTS, [SamplingParams(logit_bias=b) for b in biases])
    assert ranks == want and want[2] == [31] * N and want[0] == hf_biased(hf, PROMPTS[0], biases[0])


def test_params_are_frozen_and_hashable():
    a = SamplingParams(logit_bias={7: 1.0, 3: -2.0})
    assert a.logit_bias == ((3, -2.0), (7, 1.0))
    assert a == SamplingParams(logit_bias=[(3, -2.0), (7, 1.0)]) and hash(a) == hash(SamplingParams(logit_bias={3: -2.0, 7: 1.0}))
    assert SamplingParams().logit_bias == ()


@pytest.mark.parametrize(("bias", "names"), [
    ({5: 100.5}, ("logit_bias={5: 100.5}", "bias 100.5 for token 5", "[-100, 100]")),
    ({5: float("inf")}, ("bias inf", "finite")),
    ({-1: 1.0}, ("token id -1", "ints >= 0")),
    ({"5": 1.0}, ("token id '5'", "ints >= 0")),
    ({True: 1.0}, ("token id True",)),
    ({5: "1"}, ("bias '1'",)),
    ([(5, 1.0), (5, 2.0)], ("repeats a token id",)),
    (5, ("logit_bias=5", "mapping {token id: bias}")),
])
def test_bad_bias_raises_naming_it(bias, names):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(logit_bias=bias)
    for needle in names:
        assert needle in str(info.value)


def test_id_outside_the_vocabulary_raises_before_any_change(rt):
    state = neuronfx.init_state(rt)
    with pytest.raises(SamplingParamsError, match=r"token id 256, outside the vocabulary.*vocab_size=256"):
        neuronfx.generate(rt, state, PROMPTS, sampling=SamplingParams(logit_bias={256: -100.0}))
    result, _ = neuronfx.generate(rt, state, PROMPTS[:1], max_new_tokens=2, eos_token_ids=NO_EOS)  # the state is still usable
    assert len(result.token_ids[0]) == 2


def test_cli_logit_bias_syntax():
    assert logit_bias_from_args(["5=-100", "7=2.5"]) == {5: -100.0, 7: 2.5}
    assert logit_bias_from_args([]) == {}
    for bad in ("x=1", "5", "5=abc", "=3"):
        with pytest.raises(InputError, match=f"--logit-bias {bad!r} must be ID=BIAS"):
            logit_bias_from_args([bad])
