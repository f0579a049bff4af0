"""Bucket ladders (generate_buckets) and bucket selection (select_bucket)."""

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from neuronfx.config import generate_buckets, select_bucket
from neuronfx.config.buckets import MIN_BUCKET
from neuronfx.errors import BucketOverflowError, ConfigError


def naive_buckets(min_bucket: int, max_bucket: int) -> tuple[int, ...]:
    """Every power of two in [min_bucket, max_bucket), then max_bucket."""
    powers = [2**i for i in range(64) if min_bucket <= 2**i < max_bucket]
    return tuple(powers) + (max_bucket,)


def naive_select(buckets, needed: int) -> int:
    return min(b for b in buckets if b >= needed)


bounds = st.integers(min_value=1, max_value=1 << 20)


# ---------------------------------------------------------------------------------------------
# generate_buckets
# ---------------------------------------------------------------------------------------------


@given(min_bucket=bounds, max_bucket=bounds)
@example(min_bucket=128, max_bucket=128)  # min == max: one bucket
@example(min_bucket=1, max_bucket=1)
@example(min_bucket=128, max_bucket=129)  # just above a power of two: 128 kept
@example(min_bucket=128, max_bucket=257)
@example(min_bucket=128, max_bucket=724)  # NxD's round(log2) drops 512 here; we keep it
@example(min_bucket=128, max_bucket=100)  # max < min: only max
@example(min_bucket=100, max_bucket=1000)  # min not a power of two: start at 128, not 64
@example(min_bucket=1, max_bucket=1 << 20)
def test_generate_buckets_matches_naive_reference(min_bucket, max_bucket):
    assert generate_buckets(min_bucket, max_bucket) == naive_buckets(min_bucket, max_bucket)


@given(min_bucket=bounds, max_bucket=bounds)
@example(min_bucket=128, max_bucket=128)
@example(min_bucket=128, max_bucket=100)
def test_generate_buckets_shape(min_bucket, max_bucket):
    ladder = generate_buckets(min_bucket, max_bucket)
    assert isinstance(ladder, tuple)
    assert ladder[-1] == max_bucket
    assert all(a < b for a, b in zip(ladder, ladder[1:])), ladder
    # Everything but the last bucket is a power of two in [min, max).
    for b in ladder[:-1]:
        assert b & (b - 1) == 0
        assert min_bucket <= b < max_bucket
    if max_bucket <= min_bucket:
        assert ladder == (max_bucket,)


@given(min_bucket=bounds, max_bucket=bounds, extra=st.integers(min_value=1, max_value=1 << 20))
@example(min_bucket=128, max_bucket=724, extra=1)
@example(min_bucket=128, max_bucket=512, extra=1)
@example(min_bucket=128, max_bucket=127, extra=1)  # growing past min adds min's power of two
def test_generate_buckets_monotone_in_max(min_bucket, max_bucket, extra):
    """A larger max never loses a bucket below the old max (only the old max itself may go)."""
    small = generate_buckets(min_bucket, max_bucket)
    large = generate_buckets(min_bucket, max_bucket + extra)
    assert set(small) - {max_bucket} <= set(large)
    # ... and the new ladder agrees with the old one below the old max.
    assert [b for b in large if b < max_bucket] == [b for b in small if b < max_bucket]


@pytest.mark.parametrize(
    "min_bucket, max_bucket, ours, nxd",
    [
        # (inputs, our ladder, NxD v0.3/v0.4 generate_buckets from NXD_REFERENCE.md §1.E)
        (128, 128, (128,), (128,)),
        (128, 512, (128, 256, 512), (128, 256, 512)),
        (64, 256, (64, 128, 256), (64, 128, 256)),
        (128, 513, (128, 256, 512, 513), (128, 256, 513)),  # differs: round(log2 513) = 9 drops 512
        (128, 724, (128, 256, 512, 724), (128, 256, 724)),  # differs: round(log2 724) = 9 drops 512
        (128, 725, (128, 256, 512, 725), (128, 256, 512, 725)),
        (128, 768, (128, 256, 512, 768), (128, 256, 512, 768)),
        (128, 1000, (128, 256, 512, 1000), (128, 256, 512, 1000)),
        (128, 129, (128, 129), (129,)),  # differs: NxD's range(7, round(7.01)=7) is empty
        (128, 100, (100,), (100,)),
        (100, 1000, (128, 256, 512, 1000), (64, 128, 256, 512, 1000)),  # differs: NxD starts at 2**int(log2 100)=64
        (128, 2048, (128, 256, 512, 1024, 2048), (128, 256, 512, 1024, 2048)),
    ],
)
def test_generate_buckets_nxd_vectors(min_bucket, max_bucket, ours, nxd):
    assert generate_buckets(min_bucket, max_bucket) == ours
    agrees = ours == nxd
    # The rule differs from NxD exactly where its round()/int() of log2 bites.
    expected_disagreements = {(128, 513), (128, 724), (128, 129), (100, 1000)}
    assert agrees == ((min_bucket, max_bucket) not in expected_disagreements)


def test_min_bucket_constant_matches_nxd_floor():
    assert MIN_BUCKET == 128


@pytest.mark.parametrize("min_bucket, max_bucket", [(0, 128), (128, 0), (-1, 128), (128, -5)])
def test_generate_buckets_rejects_non_positive_bounds(min_bucket, max_bucket):
    with pytest.raises(ConfigError, match=rf"min={min_bucket}, max={max_bucket}"):
        generate_buckets(min_bucket, max_bucket)


# ---------------------------------------------------------------------------------------------
# select_bucket
# ---------------------------------------------------------------------------------------------

ladders = st.lists(st.integers(min_value=1, max_value=1 << 16), min_size=1, max_size=12, unique=True).map(
    lambda xs: tuple(sorted(xs))
)


@st.composite
def ladder_and_fitting_need(draw):
    ladder = draw(st.one_of(ladders, st.builds(generate_buckets, st.integers(1, 512), st.integers(1, 1 << 14))))
    needed = draw(st.integers(min_value=1, max_value=ladder[-1]))
    return ladder, needed


@given(ladder_and_fitting_need())
@example(((128, 256), 128))  # needed == bucket fits (NxD's strict first_fit would pick 256)
@example(((128, 256), 129))
@example(((128, 256), 1))
@example(((128, 256), 256))
@example(((7,), 7))
def test_select_bucket_is_smallest_fitting_bucket(case):
    ladder, needed = case
    chosen = select_bucket(ladder, needed)
    assert chosen in ladder
    assert chosen >= needed  # never smaller than needed
    assert chosen == naive_select(ladder, needed)  # and the smallest such bucket
    # Every smaller bucket is too small.
    assert all(b < needed for b in ladder if b < chosen)


@given(ladder_and_fitting_need())
def test_select_bucket_is_idempotent(case):
    ladder, needed = case
    once = select_bucket(ladder, needed)
    assert select_bucket(ladder, once) == once


@given(ladder_and_fitting_need(), st.integers(min_value=1, max_value=1 << 16))
def test_select_bucket_monotone_in_needed(case, more):
    ladder, needed = case
    bigger = min(needed + more, ladder[-1])
    assert select_bucket(ladder, bigger) >= select_bucket(ladder, needed)


@given(ladders, st.integers(min_value=1, max_value=1 << 16))
@example((128, 256), 257)
@example((100,), 101)
def test_select_bucket_overflow(ladder, extra):
    needed = ladder[-1] + extra
    with pytest.raises(BucketOverflowError) as info:
        select_bucket(ladder, needed, what="prompt_len")
    msg = str(info.value)
    assert f"prompt_len={needed}" in msg
    assert str(ladder[-1]) in msg


@pytest.mark.parametrize("needed", [0, -1, -128])
def test_select_bucket_rejects_non_positive_need(needed):
    with pytest.raises(BucketOverflowError, match=rf"length={needed}"):
        select_bucket((128, 256), needed)


@pytest.mark.parametrize(
    "needed, bucket",
    [(1, 128), (127, 128), (128, 128), (129, 256), (256, 256), (257, 512), (512, 512), (513, 1000), (1000, 1000)],
)
def test_select_bucket_table(needed, bucket):
    assert select_bucket(generate_buckets(128, 1000), needed) == bucket
