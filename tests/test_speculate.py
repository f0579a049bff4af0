"""Speculative decoding on tiny models against transformers' greedy output, the speculate
mask/KV specs against naive references, and rejection sampling's output distribution."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy, random_prompt, tiny_hf_model, tiny_runtime
from hypothesis import given
from hypothesis import strategies as st

import neuronfx
from neuronfx import Draft, SamplingParams
from neuronfx.config.kv import speculate_access
from neuronfx.config.masks import decode_mask
from neuronfx.errors import BucketOverflowError, ConfigError, SamplingParamsError
from neuronfx.runtime.speculate import accept_greedy, accept_sampled, truncate_at_stop

NO_EOS: list[int] = []


# --- pure pieces --------------------------------------------------------------------------------


@given(st.integers(1, 3), st.integers(1, 6), st.integers(1, 40), st.data())
def test_speculate_mask_matches_naive(batch, k, bucket, data):
    starts = [data.draw(st.integers(0, max(0, bucket - k))) for _ in range(batch)]
    positions = torch.tensor([[p + t for t in range(k)] for p in starts], dtype=torch.int32)
    mask = decode_mask(positions, bucket)
    assert mask.shape == (batch, 1, k, bucket)
    for b in range(batch):
        for t in range(k):
            for j in range(bucket):
                assert bool(mask[b, 0, t, j]) == (j <= starts[b] + t)  # cache prefix + causal among the k


@given(st.integers(0, 100), st.integers(1, 8), st.integers(1, 128))
def test_speculate_access(cache_len, k, bucket):
    if cache_len + k > bucket:
        with pytest.raises(BucketOverflowError):
            speculate_access(cache_len, k, bucket)
        return
    a = speculate_access(cache_len, k, bucket)
    assert list(a.write) == list(range(cache_len, cache_len + k))
    assert list(a.attend) == list(range(cache_len + k)) and list(a.read) == list(range(bucket))
    assert a.cache_len_after == cache_len + k


def test_accept_greedy_longest_prefix_plus_target_token():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_greedy([5, 9, 7], [5, 6, 7, 8]) == [5, 6]  # first mismatch takes the target's
    assert accept_greedy([1], [2, 3]) == [2]


def test_truncate_at_stop_and_budget():
    assert truncate_at_stop([1, 2, 3, 4], 10, frozenset({3})) == ([1, 2, 3], True)
    assert truncate_at_stop([1, 2, 3, 4], 2, frozenset({3})) == ([1, 2], False)
    assert truncate_at_stop([1, 2], 5, frozenset()) == ([1, 2], False)


def test_rejection_sampling_preserves_target_distribution():
    # One draft token (k = 2): the first emitted token must be distributed as p[0] whatever q is.
    # 30000 draws, chi-square goodness of fit at alpha = 1e-3 (p-value from the regularized upper
    # incomplete gamma, as in tests/test_sampling.py).
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1]])
    g = torch.Generator().manual_seed(0)
    n, counts = 30000, torch.zeros(5)
    for _ in range(n):
        d = int(torch.multinomial(q[0], 1, generator=g))
        counts[accept_sampled([d], q, p, torch.rand(1, generator=g), g)[0]] += 1
    assert counts[4] == 0  # zero target probability is never produced
    expected = p[0, :4] * n
    chi2 = float(((counts[:4] - expected) ** 2 / expected).sum())
    p_value = float(torch.special.gammaincc(torch.tensor(3 / 2), torch.tensor(chi2 / 2)))
    assert p_value > 1e-3, f"chi2={chi2:.2f}, p={p_value:.2g}, counts={counts.tolist()}"


# --- end to end on tiny models ------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=3)


@pytest.fixture(scope="module")
def draft_rt():
    # An unrelated random model: it almost never agrees, which exercises every rejection path.
    return tiny_runtime(tiny_hf_model("llama", seed=99), "eager", output_logits=True)


@pytest.mark.parametrize("k", [2, 4, 6])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", ["self", "draft-model", "same-model"])
def test_greedy_speculation_equals_plain_greedy(hf, draft_rt, k, batch, kind):
    rt = tiny_runtime(hf, "eager", speculation_length=k, draft_layers=1)
    draft = None
    if kind == "draft-model":
        draft = Draft(runtime=draft_rt, state=neuronfx.init_state(draft_rt))
    elif kind == "same-model":
        same = tiny_runtime(hf, "eager")
        draft = Draft(runtime=same, state=neuronfx.init_state(same))
    prompts = [random_prompt(n, seed=10 * k + n) for n in (5, 9, 3, 12)[:batch]]
    result, state, new_draft = neuronfx.generate_speculative(rt, neuronfx.init_state(rt), prompts, max_new_tokens=17,
                                                            eos_token_ids=NO_EOS, draft=draft)
    for p, tokens in zip(prompts, result.token_ids):
        assert list(tokens) == hf_greedy(hf, p, 17)  # exactly max_new_tokens, never one more
    assert result.finish_reasons == ("length",) * batch
    assert state.free_slots == (0, 1, 2, 3)
    for s in result.speculation:
        assert s.emitted == 16 and s.drafted == (k - 1) * s.target_passes
        if kind == "same-model":
            assert s.acceptance_rate == 1.0 and s.mean_accepted_length == pytest.approx(16 / s.target_passes)
    if draft is not None:
        assert new_draft.state.free_slots == (0, 1, 2, 3)


def test_eos_inside_accepted_run_stops_right_after_it(hf):
    rt = tiny_runtime(hf, "eager", speculation_length=4, draft_layers=1)
    same = tiny_runtime(hf, "eager")
    prompt = random_prompt(6, seed=1)
    greedy = hf_greedy(hf, prompt, 12)
    eos = greedy[6]
    cut = greedy.index(eos) + 1
    result, _, _ = neuronfx.generate_speculative(rt, neuronfx.init_state(rt), [prompt], max_new_tokens=12,
                                                 eos_token_ids=[eos], draft=Draft(runtime=same, state=neuronfx.init_state(same)))
    assert list(result.token_ids[0]) == greedy[:cut] and result.finish_reasons == ("stop",)


def test_end_of_cache_falls_back_to_plain_decode(hf):
    # prompt 20 + 44 new = sequence_length 64: the last steps cannot verify k = 6 positions.
    rt = tiny_runtime(hf, "eager", speculation_length=6, draft_layers=1)
    prompt = random_prompt(20, seed=2)
    result, _, _ = neuronfx.generate_speculative(rt, neuronfx.init_state(rt), [prompt], max_new_tokens=44, eos_token_ids=NO_EOS)
    assert list(result.token_ids[0]) == hf_greedy(hf, prompt, 44)


def test_sampled_speculation_with_same_model_draft_accepts_everything(hf):
    rt = tiny_runtime(hf, "eager", speculation_length=4, draft_layers=1, output_logits=True)
    same = tiny_runtime(hf, "eager", output_logits=True)
    sp = SamplingParams(temperature=0.9, top_p=0.95)
    result, _, _ = neuronfx.generate_speculative(rt, neuronfx.init_state(rt, seed=5), [random_prompt(7, 3)] * 2,
                                                 sampling=sp, max_new_tokens=13, eos_token_ids=NO_EOS,
                                                 draft=Draft(runtime=same, state=neuronfx.init_state(same)))
    assert [len(t) for t in result.token_ids] == [13, 13]
    assert all(s.acceptance_rate == 1.0 for s in result.speculation)  # p == q: min(1, p/q) = 1


def test_speculation_errors_before_any_change(hf, draft_rt):
    plain = tiny_runtime(hf, "eager")
    with pytest.raises(ConfigError, match="speculation_length"):
        neuronfx.generate_speculative(plain, neuronfx.init_state(plain), [[1, 2]])
    rt = tiny_runtime(hf, "eager", speculation_length=3)
    with pytest.raises(ConfigError, match="draft_layers"):
        neuronfx.generate_speculative(rt, neuronfx.init_state(rt), [[1, 2]])
    rt = tiny_runtime(hf, "eager", speculation_length=3, draft_layers=1)
    state = neuronfx.init_state(rt)
    for bad in (SamplingParams(min_p=0.1), SamplingParams(logprobs=2), SamplingParams(presence_penalty=0.5)):
        with pytest.raises(SamplingParamsError, match="speculative"):
            neuronfx.generate_speculative(rt, state, [[1, 2]], sampling=bad)
    with pytest.raises(ConfigError, match="output_logits"):
        greedy_draft = tiny_runtime(hf, "eager", output_logits=False)
        neuronfx.generate_speculative(rt, state, [[1, 2]], sampling=SamplingParams(temperature=1.0),
                                      draft=Draft(runtime=greedy_draft, state=neuronfx.init_state(greedy_draft)))
    assert not state.consumed and state.free_slots == (0, 1, 2, 3)
    with pytest.raises(ConfigError, match="draft_layers=2 must be < num_hidden_layers=2"):
        tiny_runtime(hf, "eager", speculation_length=3, draft_layers=2)
    with pytest.raises(ConfigError, match="speculation_length=1"):
        neuronfx.InferenceConfig(speculation_length=1)


@pytest.mark.parametrize("backend", ["export", "inductor"])
def test_compiled_speculate_and_draft_graphs(hf, backend):
    rt = tiny_runtime(hf, backend, speculation_length=4, draft_layers=1)
    prompts = [random_prompt(n, seed=50 + n) for n in (6, 11, 2)]
    result, _, _ = neuronfx.generate_speculative(rt, neuronfx.init_state(rt), prompts, max_new_tokens=15, eos_token_ids=NO_EOS)
    for p, tokens in zip(prompts, result.token_ids):
        assert list(tokens) == hf_greedy(hf, p, 15)
