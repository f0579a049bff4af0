"""Attention-mask builders, checked against a naive Python loop and hand-written tensors."""

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from neuronfx.config import decode_mask, prefill_mask


def naive_prefill(prompt_lens: list[int], bucket: int) -> list:
    """M[b][0][i][j] = key j is a real token and not in the future of query i."""
    return [[[[j <= i and j < n for j in range(bucket)] for i in range(bucket)]] for n in prompt_lens]


def naive_decode(positions: list[int], bucket: int) -> list:
    """M[b][0][0][j] = key j is at or before the new token's position (its K/V is written first)."""
    return [[[[j <= p for j in range(bucket)]]] for p in positions]


@st.composite
def prefill_case(draw):
    bucket = draw(st.integers(min_value=1, max_value=48))
    lens = draw(st.lists(st.integers(min_value=1, max_value=bucket), min_size=1, max_size=5))
    return lens, bucket


@st.composite
def decode_case(draw):
    bucket = draw(st.integers(min_value=1, max_value=64))
    positions = draw(st.lists(st.integers(min_value=0, max_value=bucket - 1), min_size=1, max_size=5))
    return positions, bucket


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# prefill_mask
# ---------------------------------------------------------------------------------------------


@given(prefill_case())
@example(([1], 1))
@example(([4, 4], 4))  # full rows: plain causal
@example(([1, 2, 3], 3))
def test_prefill_mask_matches_naive(case):
    lens, bucket = case
    mask = prefill_mask(_i32(lens), bucket)
    assert mask.dtype == torch.bool
    assert mask.shape == (len(lens), 1, bucket, bucket)
    assert mask.tolist() == naive_prefill(lens, bucket)


@given(prefill_case())
def test_prefill_mask_has_no_fully_masked_query_row(case):
    lens, bucket = case
    mask = prefill_mask(_i32(lens), bucket)
    assert bool(mask.any(dim=-1).all())  # every (row, query) attends at least one key
    assert bool(mask[..., 0].all())  # ... namely at least position 0


@given(prefill_case())
def test_prefill_mask_never_attends_pad_keys_or_the_future(case):
    lens, bucket = case
    mask = prefill_mask(_i32(lens), bucket)
    j = torch.arange(bucket)
    for b, n in enumerate(lens):
        assert not bool(mask[b, 0][:, j >= n].any())  # pad keys
        assert not bool(torch.triu(mask[b, 0].int(), diagonal=1).any())  # future keys
        # The real-token block is exactly the causal lower triangle.
        real = mask[b, 0, :n, :n]
        assert torch.equal(real, torch.tril(torch.ones(n, n, dtype=torch.bool)))


def test_prefill_mask_exact_small_example():
    # Row 0: 3 real tokens in a bucket of 4 (pad at position 3).
    #   query 0 sees key 0; query 1 sees 0..1; query 2 sees 0..2 (causal over real keys);
    #   query 3 is a pad query: causality allows 0..3 but key 3 is pad, so it sees 0..2.
    # Row 1: 1 real token (positions 1..3 are pad).
    #   every query sees only key 0: causality allows j <= i, but only key 0 is real,
    #   so pad queries 1..3 still attend the real key and no row is empty.
    expected = torch.tensor(
        [
            [
                [
                    [1, 0, 0, 0],
                    [1, 1, 0, 0],
                    [1, 1, 1, 0],
                    [1, 1, 1, 0],
                ]
            ],
            [
                [
                    [1, 0, 0, 0],
                    [1, 0, 0, 0],
                    [1, 0, 0, 0],
                    [1, 0, 0, 0],
                ]
            ],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(prefill_mask(_i32([3, 1]), 4), expected)


def test_prefill_mask_full_row_is_causal():
    # A prompt that fills the bucket gets the plain lower-triangular causal mask.
    expected = torch.tensor([[[[1, 0, 0], [1, 1, 0], [1, 1, 1]]]], dtype=torch.bool)
    assert torch.equal(prefill_mask(_i32([3]), 3), expected)


# ---------------------------------------------------------------------------------------------
# decode_mask
# ---------------------------------------------------------------------------------------------


@given(decode_case())
@example(([0], 1))
@example(([0, 63], 64))
def test_decode_mask_matches_naive(case):
    positions, bucket = case
    mask = decode_mask(_i32([[p] for p in positions]), bucket)
    assert mask.dtype == torch.bool
    assert mask.shape == (len(positions), 1, 1, bucket)
    assert mask.tolist() == naive_decode(positions, bucket)
    # A decode row attends exactly position + 1 keys: the cache plus its own new K/V.
    assert mask.sum(dim=-1).flatten().tolist() == [p + 1 for p in positions]


def test_decode_mask_exact_small_example():
    # Row 0: new token at position 2 (cache_len 2 before the step): it wrote K/V at 2 first,
    #   so it sees 0, 1, 2 and not 3.
    # Row 1: new token at position 0 (empty cache): sees only its own key 0.
    # Row 2: new token at position 3, the last slot of the bucket: sees all 4 keys.
    expected = torch.tensor(
        [
            [[[1, 1, 1, 0]]],
            [[[1, 0, 0, 0]]],
            [[[1, 1, 1, 1]]],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(decode_mask(_i32([[2], [0], [3]]), 4), expected)


def test_masks_agree_at_the_prefill_decode_boundary():
    # Decoding the token after a prompt of n tokens sees the same keys as the prompt's last query
    # plus its own position n.
    n, bucket = 5, 8
    last_query = prefill_mask(_i32([n]), bucket)[0, 0, n - 1]
    next_token = decode_mask(_i32([[n]]), bucket)[0, 0, 0]
    assert next_token.tolist() == [j <= n for j in range(bucket)]
    assert torch.equal(next_token & ~last_query, torch.arange(bucket) == n)


# ---------------------------------------------------------------------------------------------
# sliding-window and chunked layers
# ---------------------------------------------------------------------------------------------


def naive_window(i: int, j: int, kind: str, size: int) -> bool:
    """transformers' overlays (masking_utils): sliding ``j > i - size``, chunked same chunk."""
    return j > i - size if kind == "sliding" else j // size == i // size


@given(prefill_case(), st.sampled_from(["sliding", "chunked"]), st.integers(min_value=1, max_value=12))
@example(([5, 2], 8), "sliding", 1)
def test_windowed_prefill_mask_matches_naive(case, kind, size):
    lens, bucket = case[:2]
    mask = prefill_mask(_i32(lens), bucket, kind, size)
    assert mask.shape == (len(lens), 1, bucket, bucket)
    for b, n in enumerate(lens):
        for i in range(bucket):
            row = [j <= i and j < n and naive_window(i, j, kind, size) for j in range(bucket)]
            if i >= n and not any(row):  # a pad query with no real key in reach attends itself
                row[i] = True
            assert mask[b, 0, i].tolist() == row, (b, i)


@given(decode_case(), st.sampled_from(["sliding", "chunked"]), st.integers(min_value=1, max_value=12),
       st.integers(min_value=1, max_value=4))
def test_windowed_decode_mask_matches_naive(case, kind, size, k):
    positions, bucket = case
    pos = [[min(p + t, bucket - 1) for t in range(k)] for p in positions]  # speculate: k new tokens per row
    mask = decode_mask(_i32(pos), bucket, kind, size)
    assert mask.shape == (len(positions), 1, k, bucket)
    expected = [[[[j <= p and naive_window(p, j, kind, size) for j in range(bucket)] for p in row]] for row in pos]
    assert mask.tolist() == expected
    assert bool(mask.any(-1).all())  # a new token always attends itself


def test_windowed_masks_agree_at_the_prefill_decode_boundary():
    # The token after a prompt of n sees the prompt's last query's keys shifted by one step.
    n, bucket, w = 9, 12, 4
    last_query = prefill_mask(_i32([n]), bucket, "sliding", w)[0, 0, n - 1]
    next_token = decode_mask(_i32([[n]]), bucket, "sliding", w)[0, 0, 0]
    assert last_query.nonzero().flatten().tolist() == [5, 6, 7, 8]
    assert next_token.nonzero().flatten().tolist() == [6, 7, 8, 9]
    chunk = decode_mask(_i32([[n]]), bucket, "chunked", w)[0, 0, 0]
    assert chunk.nonzero().flatten().tolist() == [8, 9]  # chunk [8, 12) up to the token itself
