"""neuronfx.graphs.sampling.sample (vLLM V1 semantics) against a naive float64 reference of the
filtered distribution, plus check_sampling / pack_sampling.

Two kinds of draws:
- a deterministic rand grid ``(arange(N) + 0.5) / N`` makes inverse-CDF sampling exact up to the
  grid: token i is drawn for about ``N * p_i`` of the N values (within one per CDF boundary);
- seeded uniform rand for a chi-square goodness-of-fit test at alpha = 1e-3.
"""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from neuronfx.config.inputs import SamplerInputs
from neuronfx.config.sampling import (
    MAX_SEED,
    NUM_PARAM_COLUMNS,
    PARAM_COLUMNS,
    SamplingParams,
    check_sampling,
    pack_sampling,
)
from neuronfx.errors import SamplingParamsError
from neuronfx.graphs.phases.sampling import apply_penalties, inverse_cdf, sample

torch.set_num_threads(1)

ALPHA = 1e-3  # significance of the chi-square goodness-of-fit tests


# --- helpers --------------------------------------------------------------------------------


def row(width: int, **fields) -> list[float]:
    """The packed (7,) params row of SamplingParams(**fields) for a graph of top-k width ``width``."""
    return pack_sampling([SamplingParams(**fields)], width)[0]


def reference_probs(
    logits: list[float],
    params: list[float],
    width: int,
    counts: list[int] | None = None,
    prompt: list[bool] | None = None,
    bias: list[float] | None = None,
    slack: float = 0.0,
) -> list[float]:
    """Exact (float64) distribution over the full vocab that ``sample`` draws from, written
    naively per row: bias, penalties (vLLM formulas), greedy argmax or temperature, sort, keep
    the ``min(width, top_k)`` best, min_p against the top probability, renormalise, top-p
    keeping the token crossing p, renormalise. ``slack`` > 0 relaxes the min_p and top-p
    thresholds (keeps tokens within float32 rounding of a boundary)."""
    t, k, top_p, min_p, rep, presence, frequency = params
    vocab = len(logits)
    counts = counts or [0] * vocab
    prompt = prompt or [False] * vocab
    bias = bias or [0.0] * vocab
    x = []
    for i in range(vocab):
        v = logits[i] + bias[i]
        if prompt[i] or counts[i] > 0:
            v = v / rep if v > 0 else v * rep
        x.append(v - frequency * counts[i] - presence * (counts[i] > 0))
    if t <= 1e-5:
        best = max(range(vocab), key=lambda i: (x[i], -i))  # lowest index among ties
        return [1.0 if i == best else 0.0 for i in range(vocab)]
    order = sorted(range(vocab), key=lambda i: -x[i])[: min(width, int(k))]
    peak = x[order[0]] / t
    weights = [math.exp(x[i] / t - peak) for i in order]
    probs = [w / sum(weights) for w in weights]
    kept = [(i, p) for i, p in zip(order, probs) if p >= min_p * probs[0] - slack]
    mass = sum(p for _, p in kept)
    final, before = [], 0.0
    for i, p in kept:
        if before < top_p + slack:
            final.append((i, p))
        before += p / mass
    out = [0.0] * vocab
    for i, p in final:
        out[i] = p / sum(q for _, q in final)
    return out


def all_allowed(b: int, v: int) -> torch.Tensor:
    """The token bitmask of b rows without a constraint: (b, ceil(v / 32)) int32 of -1."""
    return torch.full((b, -(-v // 32)), -1, dtype=torch.int32)


def run(logits, params, rand, width, counts=None, prompt=None, bias=None, num_logprobs=0, bitmask=None):
    """sample() with zero counts / empty prompts / zero bias / no constraint unless given. logits (B, V)."""
    b, v = logits.shape
    counts = torch.zeros(b, v, dtype=torch.int32) if counts is None else counts
    prompt = torch.zeros(b, v, dtype=torch.bool) if prompt is None else prompt
    bias = torch.zeros(b, v) if bias is None else bias
    bitmask = all_allowed(b, v) if bitmask is None else bitmask
    return sample(logits, SamplerInputs(params, counts, prompt, bias, rand, bitmask), width, num_logprobs)


def grid(n: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) + 0.5).div(n).float()


def draw(logits: torch.Tensor, params: list[float], rand: torch.Tensor, width: int, **rows) -> torch.Tensor:
    """Token drawn for each rand value, same logits row, params and (B=1) extra rows everywhere."""
    n, v = rand.numel(), logits.numel()
    extra = {name: t[None].expand(n, v) for name, t in rows.items()}
    p = torch.tensor([params], dtype=torch.float32).expand(n, NUM_PARAM_COLUMNS)
    return run(logits[None].expand(n, v), p, rand, width, **extra)["tokens"]


def frequencies(tokens: torch.Tensor, vocab: int) -> list[float]:
    return (torch.bincount(tokens.long(), minlength=vocab).double() / tokens.numel()).tolist()


def chi_square_pvalue(observed: list[int], probs: list[float]) -> float:
    """P-value of Pearson's chi-square goodness-of-fit test of ``observed`` counts against
    ``probs`` (zero-probability tokens excluded; cells with expected count < 5 pooled).

    The upper tail of chi-square with d dof at x is the regularised upper incomplete gamma
    Q(d/2, x/2), computed exactly with ``torch.special.gammaincc`` (scipy is not installed;
    checked against table values in ``test_chi_square_pvalue_matches_tables``)."""
    n = sum(observed)
    cells, pool_o, pool_e = [], 0, 0.0
    for o, p in zip(observed, probs):
        if p > 0:
            if n * p >= 5:
                cells.append([o, n * p])
            else:
                pool_o, pool_e = pool_o + o, pool_e + n * p
    if pool_e > 0:
        if pool_e >= 5 or not cells:
            cells.append([pool_o, pool_e])
        else:  # still too small: merge into the smallest cell
            smallest = min(cells, key=lambda c: c[1])
            smallest[0] += pool_o
            smallest[1] += pool_e
    dof = len(cells) - 1
    if dof == 0:
        return 1.0
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)).item()


# --- greedy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [1, 5, 50])
def test_greedy_rows_are_argmax(width):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=g) * 3
    greedy = torch.tensor(pack_sampling([SamplingParams()], width) * 16)
    assert greedy[0].tolist() == [0.0, float(width), 1.0, 0.0, 1.0, 0.0, 0.0]
    for rand in (torch.zeros(16), torch.full((16,), 1 - 2**-24), torch.rand(16, generator=g)):
        tokens = run(logits, greedy, rand, width)["tokens"]
        assert tokens.dtype == torch.int32 and tokens.shape == (16,)
        assert torch.equal(tokens.long(), logits.argmax(-1))


def test_greedy_ties_take_the_lowest_index():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]])
    assert run(logits, torch.tensor([row(5)]), torch.tensor([0.9]), 5)["tokens"].tolist() == [1]


def test_top_k_one_is_argmax_at_any_temperature():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 40, generator=g)
    for t in (0.1, 1.0, 5.0):
        params = torch.tensor([[t, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]] * 8)  # raw row, not packed greedy
        tokens = run(logits, params, torch.rand(8, generator=g), 40)["tokens"]
        assert torch.equal(tokens.long(), logits.argmax(-1))


def test_mixed_rows_are_independent():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 30, generator=g)
    sps = [SamplingParams(), SamplingParams(temperature=1.0, top_k=3), SamplingParams(presence_penalty=1.0),
           SamplingParams(temperature=0.7, top_k=30, top_p=0.9, min_p=0.05, repetition_penalty=1.3)]
    params = torch.tensor(pack_sampling(sps, 30))
    counts = torch.randint(0, 3, (4, 30), generator=g, dtype=torch.int32)
    prompt = torch.rand(4, 30, generator=g) < 0.3
    rand = torch.rand(4, generator=g)
    tokens = run(logits, params, rand, 30, counts, prompt)["tokens"]
    for b in range(4):
        alone = run(logits[b : b + 1], params[b : b + 1], rand[b : b + 1], 30, counts[b : b + 1], prompt[b : b + 1])
        assert tokens[b] == alone["tokens"][0]
    assert tokens[0] == logits[0].argmax()


# --- top-p ----------------------------------------------------------------------------------


def test_top_p_seven_tenths_keeps_exactly_two_of_half_three_tenths_fifth():
    """probs [0.5, 0.3, 0.2], top_p 0.7: 0.5 < 0.7 so token 1 (crossing p) is kept, token 2 is
    not; the kept mass renormalises to 0.5/0.8 = 0.625 and 0.3/0.8 = 0.375."""
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    params = row(3, temperature=1.0, top_p=0.7)
    n = 20000
    for rand in (grid(n), torch.rand(n, generator=torch.Generator().manual_seed(7))):
        tokens = draw(logits, params, rand, 3)
        assert set(tokens.tolist()) == {0, 1}
        freq = frequencies(tokens, 3)
        assert freq[2] == 0.0
        assert freq[0] == pytest.approx(0.625, abs=0.015) and freq[1] == pytest.approx(0.375, abs=0.015)
    grid_freq = frequencies(draw(logits, params, grid(n), 3), 3)
    assert grid_freq[0] == pytest.approx(0.625, abs=2 / n)


@pytest.mark.parametrize(("top_p", "support"), [(0.4, {0}), (0.5, {0}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2})])
def test_top_p_support_on_half_three_tenths_fifth(top_p, support):
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    tokens = draw(logits, row(3, temperature=1.0, top_p=top_p), grid(1000), 3)
    assert set(tokens.tolist()) == support


def test_top_p_follows_rank_not_token_index():
    perm = [3, 0, 4, 1, 2]  # token perm[r] has the r-th largest probability
    probs = torch.zeros(5)
    probs[perm] = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    tokens = draw(probs.log(), row(5, temperature=1.0, top_p=0.6), grid(1000), 5)  # 0.4 < 0.6 < 0.65
    assert set(tokens.tolist()) == {3, 0}


# --- min_p ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("min_p", "support"), [(0.0, {0, 1, 2, 3}), (0.09, {0, 1, 2, 3}), (0.11, {0, 1, 2}), (0.2, {0, 1, 2}), (0.31, {0, 1}), (1.0, {0})]
)
def test_min_p_drops_tokens_below_min_p_times_top(min_p, support):
    """probs [0.5, 0.3, 0.15, 0.05]: min_p 0.2 -> threshold 0.1 keeps 0.15 and drops 0.05;
    min_p 0.09 -> threshold 0.045 keeps 0.05, min_p 0.11 -> 0.055 drops it."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64).log().float()
    tokens = draw(logits, row(4, temperature=1.0, min_p=min_p), grid(4000), 4)
    assert set(tokens.tolist()) == support


def test_top_p_acts_on_the_min_p_renormalised_set():
    """probs [0.4, 0.3, 0.2, 0.1], min_p 0.3 (threshold 0.12) keeps three tokens, renormalised
    to [4/9, 3/9, 2/9]; top_p 0.75 then keeps two (4/9 < 0.75 <= 7/9) -> [4/7, 3/7]. Without
    renormalisation top_p would keep three (0.7 < 0.75)."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    n = 7000
    tokens = draw(logits, row(4, temperature=1.0, min_p=0.3, top_p=0.75), grid(n), 4)
    freq = frequencies(tokens, 4)
    assert freq[2] == freq[3] == 0.0
    assert freq[0] == pytest.approx(4 / 7, abs=2 / n) and freq[1] == pytest.approx(3 / 7, abs=2 / n)


# --- top-k ----------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [2, 5, 17])
def test_top_k_masks_everything_below_rank_k(top_k):
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(64, generator=g)
    tokens = draw(logits, row(64, temperature=2.0, top_k=top_k), grid(4096), 64)  # t=2 flattens
    assert set(tokens.tolist()) == set(logits.topk(top_k).indices.tolist())


def test_top_k_width_caps_the_candidates():
    """top_k disabled (= width): only the ``width`` best logits can be drawn."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, generator=g) * 0.1  # near flat
    params = row(8, temperature=1.0)
    assert params == [1.0, 8.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    tokens = draw(logits, params, grid(4096), 8)
    assert set(tokens.tolist()) == set(logits.topk(8).indices.tolist())


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_rand_just_below_one_never_draws_a_masked_token(top_k):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 20, generator=g)
    params = torch.tensor([[1.0, float(top_k), 1.0, 0.0, 1.0, 0.0, 0.0]] * 6)
    last = run(logits, params, torch.full((6,), 1 - 2**-24), 20)["tokens"]
    assert torch.equal(last.long(), logits.topk(top_k, dim=-1).indices[:, -1])
    first = run(logits, params, torch.zeros(6), 20)["tokens"]
    assert torch.equal(first.long(), logits.argmax(-1))


def test_inverse_cdf_intervals_are_half_open():
    """Token i is drawn iff rand * total lies in [cdf[i-1], cdf[i]); zero-probability tokens never."""
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.25]] * 5)
    rand = torch.tensor([0.0, 0.4999, 0.5, 0.75, 1 - 2**-24])
    assert inverse_cdf(probs, rand).tolist() == [0, 0, 2, 3, 3]


def test_inverse_cdf_clamps_to_the_last_kept_token():
    """If rounding puts the target on the total (rand = 1 here, outside the contract), the last
    token with nonzero probability is drawn, not a dropped one behind it."""
    probs = torch.tensor([[0.5, 0.0, 0.5, 0.0, 0.0]])
    assert inverse_cdf(probs, torch.tensor([1.0])).tolist() == [2]


# --- penalties and bias ---------------------------------------------------------------------


def test_penalties_match_hand_computed_values():
    """repetition 2, presence 0.5, frequency 0.25:
    token 0: prompt only, 2.0 > 0 -> 2.0 / 2 = 1.0
    token 1: prompt only, -1.0 -> -1.0 * 2 = -2.0
    token 2: output x2, 0.5 -> 0.25, - 0.25 * 2 - 0.5 = -0.75
    token 3: output x1, -0.5 -> -1.0, - 0.25 - 0.5 = -1.75
    token 4: prompt, 0.0 (not > 0) -> 0.0 * 2 = 0.0
    token 5: unseen, 3.0 unchanged."""
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 0.0, 3.0]])
    params = torch.tensor([row(6, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)])
    counts = torch.tensor([[0, 0, 2, 1, 0, 0]], dtype=torch.int32)
    prompt = torch.tensor([[True, True, False, False, True, False]])
    out = apply_penalties(logits, params, counts, prompt)
    assert out.tolist() == [[1.0, -2.0, -0.75, -1.75, 0.0, 3.0]]
    ref = reference_penalized(logits[0].tolist(), 2.0, 0.5, 0.25, counts[0].tolist(), prompt[0].tolist())
    assert out[0].tolist() == pytest.approx(ref)


def reference_penalized(logits, rep, presence, frequency, counts, prompt):
    out = []
    for x, c, seen in zip(logits, counts, prompt):
        if seen or c > 0:
            x = x / rep if x > 0 else x * rep
        out.append(x - frequency * c - presence * (1.0 if c > 0 else 0.0))
    return out


def test_repetition_applies_to_both_prompt_and_output_but_presence_only_to_output():
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    counts = torch.tensor([[0, 1, 0]], dtype=torch.int32)
    prompt = torch.tensor([[True, False, False]])
    rep = apply_penalties(logits, torch.tensor([row(3, repetition_penalty=4.0)]), counts, prompt)
    assert rep.tolist() == [[0.25, 0.25, 1.0]]
    pres = apply_penalties(logits, torch.tensor([row(3, presence_penalty=2.0)]), counts, prompt)
    assert pres.tolist() == [[1.0, -1.0, 1.0]]
    freq = apply_penalties(logits, torch.tensor([row(3, frequency_penalty=-1.5)]), counts * 2, prompt)
    assert freq.tolist() == [[1.0, 4.0, 1.0]]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, [0, 0, 0, 0]),  # no penalty: raw argmax (token 0 everywhere)
        ({"repetition_penalty": 2.0}, [0, 1, 1, 1]),  # token 0: 3.0 -> 1.5 < 2.0 where seen (prompt or output)
        ({"presence_penalty": 1.5}, [0, 1, 0, 1]),  # 3.0 - 1.5 < 2.0 where generated
        ({"frequency_penalty": 0.4}, [0, 0, 0, 1]),  # 3.0 - 0.4 * 3 < 2.0 only with 3 counts
        ({"repetition_penalty": 0.5}, [0, 0, 0, 0]),  # < 1 boosts: 6.0
    ],
)
def test_greedy_rows_take_the_penalized_argmax(fields, expected):
    logits = torch.tensor([[3.0, 2.0, -1.0, 0.5]] * 4)
    counts = torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [3, 0, 0, 0]], dtype=torch.int32)
    prompt = torch.tensor([[False] * 4, [False] * 4, [True, False, False, False], [False] * 4])
    params = torch.tensor([row(4, **fields)] * 4)
    tokens = run(logits, params, torch.rand(4), 4, counts, prompt)["tokens"]
    assert tokens.tolist() == expected


@pytest.mark.parametrize("fields", [{}, {"temperature": 1.0}, {"temperature": 0.5, "top_k": 1}, {"temperature": 3.0, "top_p": 0.5}])
def test_logits_bias_minus_inf_suppresses_the_argmax(fields):
    logits = torch.tensor([[0.0, 9.0, 1.0, 0.5, -2.0]] * 3)
    bias = torch.zeros(3, 5)
    bias[:, 1] = float("-inf")
    params = torch.tensor([row(5, **fields)] * 3)
    for rand in (torch.zeros(3), torch.full((3,), 0.5), torch.full((3,), 1 - 2**-24)):
        tokens = run(logits, params, rand, 5, bias=bias)["tokens"]
        assert 1 not in tokens.tolist()
    assert run(logits, params, torch.zeros(3), 5, bias=bias)["tokens"].tolist() == [2, 2, 2]


def test_logits_bias_is_added_before_penalties():
    """bias +1 turns -0.5 into 0.5 > 0, so repetition 2 divides: 0.25 (not -1.0 + 1 = 0.0)."""
    logits = torch.tensor([[-0.5, 0.2]])
    prompt = torch.tensor([[True, False]])
    params = torch.tensor([row(2, repetition_penalty=2.0)])
    bias = torch.tensor([[1.0, 0.0]])
    assert run(logits, params, torch.zeros(1), 2, prompt=prompt, bias=bias)["tokens"].tolist() == [0]  # 0.25 > 0.2


# --- logprobs -------------------------------------------------------------------------------


@pytest.mark.parametrize("num_logprobs", [1, 4, 12])
def test_logprobs_are_raw_log_softmax(num_logprobs):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 12, generator=g) * 2
    sps = [SamplingParams(temperature=0.3, repetition_penalty=1.8, presence_penalty=2.0, frequency_penalty=-2.0, min_p=0.1),
           SamplingParams(), SamplingParams(temperature=2.0, top_k=4, top_p=0.5)] * 2
    params = torch.tensor(pack_sampling(sps, 12))
    counts = torch.randint(0, 4, (6, 12), generator=g, dtype=torch.int32)
    prompt = torch.rand(6, 12, generator=g) < 0.5
    bias = torch.randn(6, 12, generator=g)
    out = run(logits, params, torch.rand(6, generator=g), 12, counts, prompt, bias, num_logprobs)
    raw = torch.log_softmax(logits, -1)
    expect_lp, expect_ids = raw.topk(num_logprobs, dim=-1)
    assert out["top_logprobs"].dtype == torch.float32 and out["top_ids"].dtype == torch.int32
    assert out["top_logprobs"].shape == out["top_ids"].shape == (6, num_logprobs)
    torch.testing.assert_close(out["top_logprobs"], expect_lp)
    assert torch.equal(out["top_ids"].long(), expect_ids)
    assert out["sampled_logprobs"].shape == (6,) and out["sampled_logprobs"].dtype == torch.float32
    torch.testing.assert_close(out["sampled_logprobs"], raw.gather(1, out["tokens"].long()[:, None])[:, 0])
    assert (out["top_logprobs"][:, 1:] <= out["top_logprobs"][:, :-1]).all()


def test_no_logprobs_keys_without_num_logprobs():
    out = run(torch.randn(2, 5), torch.tensor([row(5)] * 2), torch.rand(2), 5)
    assert set(out) == {"tokens"}


# --- empirical frequencies against the exact filtered distribution ---------------------------


@pytest.mark.parametrize(
    ("fields", "width"),
    [
        ({"temperature": 1.0}, 32),
        ({"temperature": 0.5}, 32),
        ({"temperature": 3.0}, 32),
        ({"temperature": 1.0, "top_k": 6}, 32),
        ({"temperature": 1.0, "top_p": 0.8}, 32),
        ({"temperature": 0.7, "top_k": 10, "top_p": 0.5}, 32),
        ({"temperature": 1.3, "top_p": 0.95}, 16),  # top_k off: width 16
        ({"temperature": 0.25, "top_k": 3, "top_p": 0.99}, 8),
        ({"temperature": 1.0, "min_p": 0.05}, 32),
        ({"temperature": 2.0, "min_p": 0.2, "top_p": 0.9, "top_k": 20}, 32),
        ({"temperature": 1.0, "repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 0.3}, 32),
    ],
)
def test_grid_frequencies_match_reference(fields, width):
    n = 8192
    g = torch.Generator().manual_seed(width * 31 + len(fields))
    logits = torch.randn(32, generator=g) * 1.5
    counts = torch.randint(0, 3, (32,), generator=g, dtype=torch.int32)
    prompt = torch.rand(32, generator=g) < 0.3
    params = row(width, **fields)
    tokens = draw(logits, params, grid(n), width, counts=counts, prompt=prompt)
    freq = frequencies(tokens, 32)
    ref = reference_probs(logits.tolist(), params, width, counts.tolist(), prompt.tolist())
    assert {i for i, f in enumerate(freq) if f > 0} <= {i for i, r in enumerate(ref) if r > 0}
    for i, (f, r) in enumerate(zip(freq, ref)):
        assert f == pytest.approx(r, abs=2 / n + 1e-5), f"token {i}"


def test_chi_square_pvalue_matches_tables():
    """Upper 0.1% points of chi-square (NIST/SEMATECH e-Handbook table 1.3.6.7.4):
    1 dof 10.828, 5 dof 20.515, 11 dof 31.264."""
    for dof, critical in ((1, 10.828), (5, 20.515), (11, 31.264)):
        p = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(critical / 2, dtype=torch.float64))
        assert p.item() == pytest.approx(1e-3, rel=1e-3)
    assert chi_square_pvalue([500, 500], [0.5, 0.5]) == 1.0
    assert chi_square_pvalue([600, 400], [0.5, 0.5]) < 1e-9


CHI_SQUARE_CASES = [
    {"temperature": 1.0},
    {"temperature": 0.6},
    {"temperature": 2.5, "top_k": 5},
    {"temperature": 1.0, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.1},
    {"temperature": 0.8, "top_k": 8, "top_p": 0.9, "min_p": 0.05},
    {"temperature": 1.7, "top_p": 0.6, "min_p": 0.02},
    {"temperature": 1.2, "top_k": 10, "repetition_penalty": 1.4, "presence_penalty": -0.5, "frequency_penalty": 0.7},
]


@pytest.mark.parametrize("case", range(len(CHI_SQUARE_CASES)))
def test_chi_square_goodness_of_fit(case):
    """20000 seeded uniform draws on V = 12 (topk_width = V, so sample() is exact); Pearson's
    chi-square against the naive reference must not reject at alpha = 1e-3."""
    vocab, n = 12, 20000
    g = torch.Generator().manual_seed(100 + case)
    logits = torch.randn(vocab, generator=g) * 1.2
    counts = torch.randint(0, 3, (vocab,), generator=g, dtype=torch.int32)
    prompt = torch.rand(vocab, generator=g) < 0.3
    params = row(vocab, **CHI_SQUARE_CASES[case])
    tokens = draw(logits, params, torch.rand(n, generator=g), vocab, counts=counts, prompt=prompt)
    ref = reference_probs(logits.tolist(), params, vocab, counts.tolist(), prompt.tolist())
    observed = torch.bincount(tokens.long(), minlength=vocab).tolist()
    assert all(o == 0 for o, r in zip(observed, ref) if r == 0), (observed, ref)
    assert sum(r > 0 for r in ref) >= 2  # a real test, not a one-token support
    assert chi_square_pvalue(observed, ref) > ALPHA


# --- compile --------------------------------------------------------------------------------


def test_compiles_fullgraph_static_and_matches_eager():
    g = torch.Generator().manual_seed(6)
    b, v, width = 8, 40, 16
    logits = torch.randn(b, v, generator=g) * 2
    sps = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
           SamplingParams(temperature=1.5, min_p=0.1, repetition_penalty=1.2), SamplingParams(top_k=1, temperature=2.0),
           SamplingParams(temperature=0.9, presence_penalty=1.0, frequency_penalty=0.5, top_p=0.5),
           SamplingParams(repetition_penalty=1.5), SamplingParams(temperature=3.0, top_k=16, min_p=0.3)]
    args = (
        logits,
        torch.tensor(pack_sampling(sps, width)),
        torch.randint(0, 3, (b, v), generator=g, dtype=torch.int32),
        torch.rand(b, v, generator=g) < 0.2,
        torch.where(torch.rand(b, v, generator=g) < 0.1, float("-inf"), 0.0),
        torch.rand(b, generator=g),
        torch.randint(-2**31, 2**31 - 1, (b, -(-v // 32)), generator=g, dtype=torch.int32) | 1,  # a random mask, token 0 allowed
    )
    eager = sample(args[0], SamplerInputs(*args[1:]), width, 3)

    def flat(logits, *sampler):  # compiled code takes tensors; the record is built inside
        return sample(logits, SamplerInputs(*sampler), width, 3)

    compiled = torch.compile(flat, fullgraph=True, dynamic=False)(*args)
    assert set(compiled) == set(eager)
    assert torch.equal(compiled["tokens"], eager["tokens"]) and compiled["tokens"].dtype == torch.int32
    assert torch.equal(compiled["top_ids"], eager["top_ids"])
    torch.testing.assert_close(compiled["top_logprobs"], eager["top_logprobs"])
    torch.testing.assert_close(compiled["sampled_logprobs"], eager["sampled_logprobs"])


# --- property: the drawn token is always allowed ----------------------------------------------


@given(
    seed=st.integers(0, 2**16),
    width=st.integers(1, 16),
    top_k=st.integers(-1, 16),
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 4.0)),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    repetition_penalty=st.floats(0.5, 2.0),
    presence_penalty=st.floats(-2.0, 2.0),
    frequency_penalty=st.floats(-2.0, 2.0),
    rand=st.floats(0.0, 1 - 2**-24),
)
@example(seed=0, width=16, top_k=0, temperature=1.0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
         presence_penalty=0.0, frequency_penalty=0.0, rand=1 - 2**-24)
@example(seed=1, width=3, top_k=-1, temperature=0.05, top_p=0.01, min_p=1.0, repetition_penalty=2.0,
         presence_penalty=2.0, frequency_penalty=2.0, rand=0.0)
def test_drawn_token_has_reference_probability(seed, width, top_k, **fields):
    vocab = 16
    rand = fields.pop("rand")
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g) * 2
    counts = torch.randint(0, 4, (vocab,), generator=g, dtype=torch.int32)
    prompt = torch.rand(vocab, generator=g) < 0.3
    params = row(width, top_k=min(top_k, width), **fields)
    token = draw(logits, params, torch.tensor([rand]), width, counts=counts, prompt=prompt)
    # the kept set is decided in float32: allow a token within 1e-5 of a min_p / top_p boundary
    ref = reference_probs(logits.tolist(), params, width, counts.tolist(), prompt.tolist(), slack=1e-5)
    assert ref[int(token)] > 0


# --- SamplingParams / check_sampling / pack_sampling ------------------------------------------


def test_defaults_and_converters():
    sp = SamplingParams()
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p) == (0.0, 0, 1.0, 0.0)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (sp.seed, sp.min_tokens, sp.max_tokens, sp.stop, sp.stop_token_ids) == (None, 0, None, (), ())
    assert (sp.ignore_eos, sp.logprobs, sp.include_stop_str_in_output) == (False, None, False)
    assert sp.greedy
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(temperature=0.5, top_k=1).greedy and not SamplingParams(temperature=2e-5).greedy
    assert PARAM_COLUMNS == ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                             "presence_penalty", "frequency_penalty") and NUM_PARAM_COLUMNS == 7
    with pytest.raises(AttributeError):
        sp.top_k = 3  # type: ignore[misc]


def test_pack_sampling_rows_follow_param_columns():
    sps = [
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=1, top_p=0.9),  # top_k 1 is greedy
        SamplingParams(temperature=0.8, top_k=-1, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                       presence_penalty=-0.5, frequency_penalty=1.5),
        SamplingParams(temperature=1.5, top_k=7),
    ]
    rows = pack_sampling(sps, 16)
    assert rows[0] == [0.0, 16.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert rows[1] == [0.0, 1.0, 0.9, 0.0, 1.0, 0.0, 0.0]
    assert rows[2] == [0.8, 16.0, 0.9, 0.05, 1.1, -0.5, 1.5]
    assert rows[3] == [1.5, 7.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert dict(zip(PARAM_COLUMNS, rows[2])) == {name: getattr(sps[2], name) for name in PARAM_COLUMNS} | {"top_k": 16.0}
    assert pack_sampling([], 8) == []


# Rejected when constructed: the rule is the field's own.
BAD_SAMPLING = [
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": math.inf}),
    ("temperature", {"temperature": "1.0"}),
    ("temperature", {"temperature": True}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 5.0}),
    ("top_k", {"top_k": True}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.0001}),
    ("top_p", {"top_p": math.nan}),
    ("min_p", {"min_p": -0.01}),
    ("min_p", {"min_p": 1.5}),
    ("min_p", {"min_p": False}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("repetition_penalty", {"repetition_penalty": math.inf}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": math.nan}),
    ("frequency_penalty", {"frequency_penalty": -2.01}),
    ("frequency_penalty", {"frequency_penalty": True}),
    ("seed", {"seed": -1}),
    ("seed", {"seed": MAX_SEED + 1}),
    ("seed", {"seed": 1.0}),
    ("seed", {"seed": True}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 2.0}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": True}),
    ("stop", {"stop": ""}),
    ("stop", {"stop": ["ok", ""]}),
    ("stop", {"stop": [1]}),
    ("stop", {"stop": None}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("stop_token_ids", {"stop_token_ids": [True]}),
    ("stop_token_ids", {"stop_token_ids": 5}),
    ("ignore_eos", {"ignore_eos": 1}),
    ("include_stop_str_in_output", {"include_stop_str_in_output": "yes"}),
    ("logprobs", {"logprobs": -1}),
    ("logprobs", {"logprobs": True}),
]

# Accepted when constructed, rejected by a plan (max_topk=64, max_logprobs=5, vocab_size=100).
BAD_FOR_PLAN = [
    ("top_k", {"top_k": 65}),
    ("stop_token_ids", {"stop_token_ids": [100]}),
    ("logprobs", {"logprobs": 6}),
]


def _converted(field: str, value: object) -> object:
    """The field's value after SamplingParams' converters (a str stop becomes a 1-tuple, lists tuples)."""
    if field == "stop" and isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, list) else value


@pytest.mark.parametrize(("field", "fields"), BAD_SAMPLING, ids=[f"{f}={v!r}" for f, v in BAD_SAMPLING])
def test_construction_rejects(field, fields):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**fields)
    assert f"SamplingParams.{field}={_converted(field, fields[field])!r}" in str(info.value)


@pytest.mark.parametrize(("field", "fields"), BAD_FOR_PLAN, ids=[f"{f}={v!r}" for f, v in BAD_FOR_PLAN])
def test_check_sampling_rejects(field, fields):
    sp = SamplingParams(**fields)
    with pytest.raises(SamplingParamsError) as info:
        check_sampling(sp, max_topk=64, max_logprobs=5, vocab_size=100)
    assert f"{field}={getattr(sp, field)!r}" in str(info.value)


def test_evolve_validates_too():
    with pytest.raises(SamplingParamsError, match="top_p=0.0"):
        attrs.evolve(SamplingParams(), top_p=0.0)


def test_check_sampling_messages_name_limit_and_fix():
    with pytest.raises(SamplingParamsError, match=r"max_topk=64.*recompile with a larger max_topk"):
        check_sampling(SamplingParams(top_k=65), 64, 5)
    with pytest.raises(SamplingParamsError, match=r"max_logprobs=5.*recompile with a larger max_logprobs"):
        check_sampling(SamplingParams(logprobs=6), 64, 5)
    with pytest.raises(SamplingParamsError, match=r"vocab_size=100"):
        check_sampling(SamplingParams(stop_token_ids=[100]), 64, 5, vocab_size=100)
    with pytest.raises(SamplingParamsError, match="SamplingParams"):
        check_sampling({"temperature": 1.0}, 64, 5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_k=-1), SamplingParams(top_k=64),
        SamplingParams(top_p=1), SamplingParams(top_p=1e-9), SamplingParams(min_p=1), SamplingParams(min_p=0),
        SamplingParams(repetition_penalty=1e-3), SamplingParams(presence_penalty=-2, frequency_penalty=2),
        SamplingParams(seed=0), SamplingParams(seed=MAX_SEED), SamplingParams(min_tokens=4, max_tokens=4),
        SamplingParams(min_tokens=10), SamplingParams(max_tokens=1), SamplingParams(stop=["a", "bc"]),
        SamplingParams(stop_token_ids=[0, 99]), SamplingParams(ignore_eos=True, include_stop_str_in_output=True),
        SamplingParams(logprobs=0), SamplingParams(logprobs=5), SamplingParams(temperature=100.0, top_k=1, top_p=0.5),
    ],
)
def test_check_sampling_accepts(sp):
    check_sampling(sp, max_topk=64, max_logprobs=5, vocab_size=100)


def test_stop_token_ids_unbounded_without_vocab_size():
    check_sampling(SamplingParams(stop_token_ids=[10**6]), 64, 5)
