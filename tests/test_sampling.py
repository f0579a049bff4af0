"""neuronfx.graphs.sampling.sample against a naive float64 reference of the filtered distribution.

A deterministic rand grid ``(arange(N) + 0.5) / N`` makes inverse-CDF sampling exact up to the
grid: token i is drawn for about ``N * p_i`` of the N values (within one per CDF boundary).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from neuronfx.config.sampling import SamplingParams, pack_sampling
from neuronfx.graphs.sampling import sample

torch.set_num_threads(1)


def reference_probs(logits: list[float], top_k: int, top_p: float, temperature: float, width: int) -> list[float]:
    """Exact filtered distribution over the vocab: the ``width`` best logits, then top-k,
    temperature, then top-p keeping the token that crosses p (mass ranked above it < p)."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])[: min(width, top_k)]
    scaled = [logits[i] / temperature for i in order]
    peak = max(scaled)
    weights = [math.exp(x - peak) for x in scaled]
    total = sum(weights)
    probs = [w / total for w in weights]
    kept, before = [], 0.0
    for i, p in zip(order, probs):
        if before < top_p:
            kept.append((i, p))
        before += p
    mass = sum(p for _, p in kept)
    out = [0.0] * len(logits)
    for i, p in kept:
        out[i] = p / mass
    return out


def grid(n: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) + 0.5).div(n).float()


def draw_grid(logits: torch.Tensor, row: list[float], width: int, n: int = 4096) -> torch.Tensor:
    """Token drawn for each of n grid rand values, same logits row and params in every row."""
    params = torch.tensor([row], dtype=torch.float32).expand(n, 3)
    return sample(logits[None].expand(n, -1), params, grid(n), width)


def frequencies(tokens: torch.Tensor, vocab: int) -> list[float]:
    return (torch.bincount(tokens.long(), minlength=vocab).double() / tokens.numel()).tolist()


# --- greedy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [1, 5, 50])
def test_greedy_rows_are_argmax(width):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=g) * 3
    greedy = torch.tensor(pack_sampling([SamplingParams()], width) * 16)
    assert greedy[0].tolist() == [1.0, 1.0, 1.0]
    for rand in (torch.zeros(16), torch.full((16,), 1 - 2**-24), torch.rand(16, generator=g)):
        tokens = sample(logits, greedy, rand, width)
        assert tokens.dtype == torch.int32 and tokens.shape == (16,)
        assert torch.equal(tokens.long(), logits.argmax(-1))


def test_top_k_one_is_argmax_at_any_temperature():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 40, generator=g)
    for t in (0.1, 1.0, 5.0):
        params = torch.tensor([[1.0, 1.0, t]] * 8)
        tokens = sample(logits, params, torch.rand(8, generator=g), 40)
        assert torch.equal(tokens.long(), logits.argmax(-1))


def test_mixed_rows_are_independent():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 30, generator=g)
    params = torch.tensor([[1.0, 1.0, 1.0], [3.0, 1.0, 1.0], [1.0, 1.0, 1.0], [30.0, 0.9, 0.7]])
    rand = torch.rand(4, generator=g)
    tokens = sample(logits, params, rand, 30)
    for b in range(4):
        alone = sample(logits[b : b + 1], params[b : b + 1], rand[b : b + 1], 30)
        assert tokens[b] == alone[0]
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


# --- top-p ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("top_p", "support"), [(0.4, {0}), (0.7, {0, 1}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2})])
def test_top_p_on_half_three_tenths_fifth(top_p, support):
    """probs [0.5, 0.3, 0.2]: p=0.7 keeps exactly two tokens (0.5 < 0.7, crossing token kept)."""
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    tokens = draw_grid(logits, [3.0, top_p, 1.0], 3, n=1000)
    assert set(tokens.tolist()) == support
    freq = frequencies(tokens, 3)
    ref = reference_probs(logits.tolist(), 3, top_p, 1.0, 3)
    for f, r in zip(freq, ref):
        assert f == pytest.approx(r, abs=2 / 1000)


def test_top_p_follows_rank_not_token_index():
    perm = [3, 0, 4, 1, 2]  # token perm[r] has the r-th largest probability
    probs = torch.zeros(5)
    probs[perm] = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    tokens = draw_grid(probs.log(), [5.0, 0.6, 1.0], 5, n=1000)  # 0.4 < 0.6 < 0.65: two kept
    assert set(tokens.tolist()) == {3, 0}


# --- top-k ----------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [2, 5, 17])
def test_top_k_masks_everything_below_rank_k(top_k):
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(64, generator=g)
    tokens = draw_grid(logits, [float(top_k), 1.0, 2.0], 64)  # temperature 2 flattens the kept set
    assert set(tokens.tolist()) == set(logits.topk(top_k).indices.tolist())


def test_top_k_width_caps_the_candidates():
    """top_k disabled (= width): only the ``width`` best logits can be drawn."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, generator=g) * 0.1  # near flat
    row = pack_sampling([SamplingParams(temperature=1.0)], 8)[0]
    assert row == [8.0, 1.0, 1.0]
    tokens = draw_grid(logits, row, 8)
    assert set(tokens.tolist()) == set(logits.topk(8).indices.tolist())


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_rand_just_below_one_never_draws_a_masked_token(top_k):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 20, generator=g)
    params = torch.tensor([[float(top_k), 1.0, 1.0]] * 6)
    for rand in (torch.zeros(6), torch.full((6,), 1 - 2**-24)):
        tokens = sample(logits, params, rand, 20)
        allowed = logits.topk(top_k, dim=-1).indices
        assert (allowed == tokens.long()[:, None]).any(-1).all()
    last = sample(logits, params, torch.full((6,), 1 - 2**-24), 20)
    assert torch.equal(last.long(), logits.topk(top_k, dim=-1).indices[:, -1])


# --- empirical frequencies against the exact filtered distribution ---------------------------


@pytest.mark.parametrize(
    ("top_k", "top_p", "temperature", "width"),
    [
        (32, 1.0, 1.0, 32),
        (32, 1.0, 0.5, 32),
        (32, 1.0, 3.0, 32),
        (6, 1.0, 1.0, 32),
        (32, 0.8, 1.0, 32),
        (10, 0.5, 0.7, 32),
        (16, 0.95, 1.3, 16),  # top_k disabled: width 16
        (3, 0.99, 0.25, 8),
    ],
)
def test_grid_frequencies_match_reference(top_k, top_p, temperature, width):
    n = 8192
    g = torch.Generator().manual_seed(top_k * 100 + width)
    logits = torch.randn(32, generator=g) * 1.5
    tokens = draw_grid(logits, [float(top_k), top_p, temperature], width, n=n)
    freq = frequencies(tokens, 32)
    ref = reference_probs(logits.tolist(), top_k, top_p, temperature, width)
    assert {i for i, f in enumerate(freq) if f > 0} <= {i for i, r in enumerate(ref) if r > 0}
    for i, (f, r) in enumerate(zip(freq, ref)):
        assert f == pytest.approx(r, abs=2 / n + 1e-5), f"token {i}"


@given(
    seed=st.integers(0, 2**16),
    top_k=st.integers(1, 24),
    top_p=st.floats(0.01, 1.0),
    temperature=st.floats(0.05, 4.0),
    rand=st.floats(0.0, 1 - 2**-24),
)
def test_drawn_token_is_in_reference_support(seed, top_k, top_p, temperature, rand):
    logits = torch.randn(24, generator=torch.Generator().manual_seed(seed))
    token = sample(logits[None], torch.tensor([[float(top_k), top_p, temperature]]), torch.tensor([rand]), 24)
    ref = reference_probs(logits.tolist(), top_k, top_p, temperature, 24)
    # the kept set is decided in float32: a token whose preceding mass is within 1e-5 of top_p
    # may be kept there and dropped in the float64 reference
    assert ref[int(token)] > 0 or abs(mass_ranked_above(logits, top_k, temperature, int(token)) - top_p) < 1e-5


def mass_ranked_above(logits: torch.Tensor, top_k: int, temperature: float, token: int) -> float:
    order = sorted(range(len(logits)), key=lambda i: -logits[i])[:top_k]
    probs = torch.softmax(logits[order].double() / temperature, 0).tolist()
    return sum(p for i, p in zip(order, probs) if logits[i] > logits[token])
