"""KV-cache layout and the per-step read/attend/write specs, including a whole-request simulation."""

import attrs
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from neuronfx.config import KVAccess, KVLayout, decode_access, generate_buckets, prefill_access, select_bucket
from neuronfx.config.buckets import MIN_BUCKET
from neuronfx.errors import BucketOverflowError

# ---------------------------------------------------------------------------------------------
# KVLayout
# ---------------------------------------------------------------------------------------------


def test_kv_layout_exact_values():
    layout = KVLayout(num_layers=2, num_slots=5, num_kv_heads=3, sequence_length=7, head_dim=11, dtype="bfloat16")
    assert layout.shape == (5, 3, 7, 11)
    assert layout.scratch_slot == 4
    # 2 (K and V) * 2 layers * 5*3*7*11 elements * 2 bytes
    assert layout.nbytes == 2 * 2 * (5 * 3 * 7 * 11) * 2 == 9240


@pytest.mark.parametrize("dtype, nbytes", [("float32", 4 * 4096), ("bfloat16", 2 * 4096), ("float16", 2 * 4096)])
def test_kv_layout_nbytes_per_dtype(dtype, nbytes):
    # 2 * num_layers * num_slots * num_kv_heads * sequence_length * head_dim = 2*4*2*8*16*2 = 4096
    layout = KVLayout(num_layers=4, num_slots=2, num_kv_heads=8, sequence_length=16, head_dim=2, dtype=dtype)
    assert layout.nbytes == nbytes


def test_kv_layout_llama_1b_like_size():
    # Llama-3.2-1B-like cache: 16 layers, 8 KV heads, head_dim 64, batch 1 (+1 scratch), 4096 tokens, bf16.
    layout = KVLayout(num_layers=16, num_slots=2, num_kv_heads=8, sequence_length=4096, head_dim=64, dtype="bfloat16")
    assert layout.shape == (2, 8, 4096, 64)
    assert layout.nbytes == 256 * 1024 * 1024  # 2*16*2*8*4096*64*2 bytes = 256 MiB


def test_kv_layout_is_frozen():
    layout = KVLayout(num_layers=1, num_slots=2, num_kv_heads=1, sequence_length=8, head_dim=4, dtype="float32")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        layout.num_slots = 3  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# prefill_access / decode_access
# ---------------------------------------------------------------------------------------------


@st.composite
def prompt_in_bucket(draw):
    bucket = draw(st.integers(min_value=1, max_value=4096))
    return draw(st.integers(min_value=1, max_value=bucket)), bucket


@given(prompt_in_bucket())
@example((1, 1))
@example((128, 128))
@example((1, 128))
def test_prefill_access(case):
    prompt_len, bucket = case
    acc = prefill_access(prompt_len, bucket)
    assert acc == KVAccess(read=range(0), attend=range(prompt_len), write=range(bucket), cache_len_after=prompt_len)
    assert len(acc.read) == 0  # prefill reads nothing from the cache
    assert set(acc.attend) <= set(acc.write)  # it attends only what it writes itself
    assert acc.cache_len_after == len(acc.attend)


@given(st.integers(min_value=1, max_value=4096), st.integers(min_value=0, max_value=4096))
@example(bucket=128, extra=1)
@example(bucket=1, extra=0)
def test_prefill_access_overflow(bucket, extra):
    prompt_len = bucket + 1 + extra
    with pytest.raises(BucketOverflowError, match=rf"prompt_len={prompt_len}.*bucket {bucket}"):
        prefill_access(prompt_len, bucket)


@pytest.mark.parametrize("prompt_len", [0, -1])
def test_prefill_access_rejects_empty_prompt(prompt_len):
    with pytest.raises(BucketOverflowError):
        prefill_access(prompt_len, 128)


@st.composite
def cache_in_bucket(draw):
    bucket = draw(st.integers(min_value=1, max_value=4096))
    return draw(st.integers(min_value=0, max_value=bucket - 1)), bucket


@given(cache_in_bucket())
@example((0, 1))
@example((127, 128))
@example((128, 256))
def test_decode_access(case):
    cache_len, bucket = case
    acc = decode_access(cache_len, bucket)
    assert acc.read == range(bucket)
    assert acc.attend == range(cache_len + 1)
    assert acc.write == range(cache_len, cache_len + 1)
    assert acc.cache_len_after == cache_len + 1
    # One token written, inside the window read, and attended by its own query.
    assert len(acc.write) == 1
    assert set(acc.write) <= set(acc.read)
    assert set(acc.attend) <= set(acc.read)
    assert acc.write[0] == acc.attend[-1]


@given(st.integers(min_value=1, max_value=4096), st.integers(min_value=0, max_value=64))
@example(bucket=128, extra=0)  # cache_len == bucket: the new token needs bucket + 1 positions
def test_decode_access_overflow(bucket, extra):
    cache_len = bucket + extra
    with pytest.raises(BucketOverflowError, match=rf"cache_len={cache_len}.*bucket {bucket}"):
        decode_access(cache_len, bucket)


def test_decode_access_rejects_negative_cache_len():
    with pytest.raises(BucketOverflowError):
        decode_access(-1, 128)


# ---------------------------------------------------------------------------------------------
# Whole-request simulation: prefill then decode steps, buckets chosen by select_bucket.
# ---------------------------------------------------------------------------------------------


@st.composite
def request(draw):
    sequence_length = draw(st.integers(min_value=1, max_value=2048))
    max_context_length = draw(st.integers(min_value=1, max_value=sequence_length))
    min_bucket = draw(st.sampled_from([1, 16, MIN_BUCKET]))
    prompt_len = draw(st.integers(min_value=1, max_value=max_context_length))
    steps = draw(st.integers(min_value=0, max_value=sequence_length - prompt_len))
    return sequence_length, max_context_length, min_bucket, prompt_len, steps


@given(request())
@example((512, 256, MIN_BUCKET, 256, 256))  # prompt fills its last bucket, cache fills completely
@example((512, 256, MIN_BUCKET, 128, 0))  # prompt exactly a bucket, no decode
@example((512, 256, MIN_BUCKET, 1, 511))  # shortest prompt, longest generation
@example((1, 1, MIN_BUCKET, 1, 0))
@example((724, 724, MIN_BUCKET, 129, 595))
def test_request_only_attends_positions_written_with_real_tokens(case):
    sequence_length, max_context_length, min_bucket, prompt_len, steps = case
    prefill_ladder = generate_buckets(min_bucket, max_context_length)
    decode_ladder = generate_buckets(min_bucket, sequence_length)

    real = set()  # positions holding this request's real token K/V
    written = set()  # positions this request wrote at all (real or pad garbage)

    bucket = select_bucket(prefill_ladder, prompt_len, what="prompt_len")
    acc = prefill_access(prompt_len, bucket)
    assert max(acc.write) < bucket <= max_context_length <= sequence_length
    written |= set(acc.write)
    real |= set(range(prompt_len))  # the prompt's own tokens; [prompt_len, bucket) is pad
    assert set(acc.attend) <= real
    cache_len = acc.cache_len_after
    assert cache_len == prompt_len

    for _ in range(steps):
        bucket = select_bucket(decode_ladder, cache_len + 1, what="cache_len + 1")
        acc = decode_access(cache_len, bucket)
        assert bucket <= sequence_length
        assert max(acc.read) < bucket and max(acc.write) < bucket
        assert acc.write == range(cache_len, cache_len + 1)
        written |= set(acc.write)
        real |= set(acc.write)  # a decode writes its real token before attending
        assert set(acc.attend) <= real, "attended a position holding pad garbage or a stale token"
        assert set(acc.attend) <= written
        assert all(p < acc.cache_len_after for p in acc.attend)
        cache_len = acc.cache_len_after

    assert cache_len == prompt_len + steps <= sequence_length
    assert real == set(range(cache_len))  # exactly the tokens of this request
    assert max(written) < sequence_length
