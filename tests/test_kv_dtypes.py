"""KV cache dtypes (``InferenceConfig.kv_cache_dtype``): the stored rows (int8 with their scale,
saturated fp8, bf16), the C++ ``cached_attention`` reading each against the reference ops,
the layout's bytes and the named errors, and tiny models on eager and inductor: greedy tokens and
logits against the float cache, eager against inductor, speculation equal to plain greedy, and
prefix-cache copies that move an int8 row's scale with it.
"""

from __future__ import annotations

import pytest
import torch
from helpers import random_prompt, run_steps, tiny_hf_model, tiny_plan, tiny_runtime
from hypothesis import given
from hypothesis import strategies as st

import neuronfx
from neuronfx import InferenceConfig, Request, SamplingParams
from neuronfx.config.kv import KV_CACHE_DTYPES, kv_storage_dtype
from neuronfx.errors import ConfigError
from neuronfx.graphs.kernels.bundles import fused_cached_attention, gathered_attention, kernel_store_kv
from neuronfx.graphs.kernels.library import cached_attention, small_gemm_available, store_int8_kv
from neuronfx.graphs.models.kv_rows import FP8_MAX, dequantize_rows, load_rows, quantize_rows, store_rows
from neuronfx.graphs.models.ops import write_kv

CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn]
PROMPTS = [random_prompt(11, 1), random_prompt(5, 2), random_prompt(20, 3)]
NO_EOS: frozenset[int] = frozenset()

# Max |logit - float-cache logit| of the tiny llama over 12 tokens (logits of size ~1): the stored
# values' rounding, relative 2**-9 (bf16), 1/254 of a row's absmax (int8), 2**-4 (fp8 e4m3).
LOGIT_TOL = {"bf16": 5e-3, "int8": 1e-2, "fp8": 5e-2}


def empty_cache(dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype)


@given(st.integers(1, 6), st.sampled_from([4, 16, 64, 128]), st.floats(1e-3, 1e3), st.integers(0, 2**16))
def test_int8_rows_round_trip_within_half_a_step(rows: int, d: int, magnitude: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, d, generator=g) * magnitude
    stored = quantize_rows(x)
    assert stored.dtype == torch.int8 and stored.shape == (rows, 3, d + 4)
    scale = x.abs().amax(-1, keepdim=True) / 127
    assert torch.equal(stored[..., d:].contiguous().view(torch.float32), scale)  # the scale's exact bytes
    assert stored[..., :d].abs().max() <= 127
    err = (dequantize_rows(stored) - x).abs()
    assert (err <= scale * 0.5 * (1 + 1e-5) + 1e-30).all()


def test_int8_zero_row_and_fp8_saturation() -> None:
    rows = quantize_rows(torch.zeros(2, 8))
    assert torch.equal(rows, torch.zeros(2, 12, dtype=torch.int8))
    assert torch.equal(dequantize_rows(rows), torch.zeros(2, 8))
    big = torch.tensor([1e4, -1e4, 300.0, 0.5])
    fp8 = store_rows(big, empty_cache(torch.float8_e4m3fn))
    assert load_rows(fp8, torch.float32).tolist() == [FP8_MAX, -FP8_MAX, 288.0, 0.5]  # saturated, never NaN
    assert store_rows(big, empty_cache(torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize(("t", "d"), [(1, 64), (3, 64), (2, 20)])
def test_cached_attention_kernel_reads_each_stored_dtype(cache_dtype: torch.dtype, t: int, d: int) -> None:
    """The kernel, inductor's fused form and the reference on the same stored rows: within fp32
    reordering (they dequantize the same values); a NaN at hidden positions never leaks. Head
    dim 64 takes the kernel's 16-lane path (where AVX-512 is), 20 the 8-lane one with tails;
    over int8 rows q . k sums in integers, 16 lanes then a scalar tail."""
    if not small_gemm_available():
        pytest.fail("the kernel library did not build on this machine")
    g = torch.Generator().manual_seed(t)
    b, h, h_kv, s, slots = 3, 6, 2, 37, 5
    k = store_rows(torch.randn(slots, h_kv, 48, d, generator=g), empty_cache(cache_dtype))
    v = store_rows(torch.randn(slots, h_kv, 48, d, generator=g), empty_cache(cache_dtype))
    k[:, :, s:] = store_rows(torch.full((d,), float("nan")), empty_cache(cache_dtype))  # past S: never read
    q = torch.randn(b, h, t, d, generator=g)
    seq_ids = torch.tensor([3, 0, 1])
    mask = torch.rand(b, 1, t, s, generator=g) > 0.3
    mask[..., -2:] = False
    k[seq_ids, :, s - 2:] = store_rows(torch.full((d,), float("nan")), empty_cache(cache_dtype))  # hidden NaN
    v[seq_ids, :, s - 2:] = store_rows(torch.full((d,), float("nan")), empty_cache(cache_dtype))
    table = seq_ids[:, None]  # the slots layout: one block of the whole sequence per row
    want = gathered_attention(q, k, v, table, s, mask)
    assert torch.isfinite(want).all()
    # over int8 rows the kernel rounds q to int16 (2^-16 of its largest entry) and the value weights
    # to int16 per span of 256 positions, so that both products sum in integers; test_kernels.py
    # checks it at 5e-5 against a reference that rounds them the same way
    kernel_atol = 1e-4 if cache_dtype == torch.int8 else 1e-5
    torch.testing.assert_close(cached_attention(q, k, v, table, mask), want, atol=kernel_atol, rtol=1e-5)
    torch.testing.assert_close(fused_cached_attention(q, k, v, table, s, mask), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("b", "t", "d", "x_dtype"), [(2, 3, 64, torch.float32), (2, 3, 20, torch.bfloat16), (4, 200, 64, torch.float32)])
def test_store_int8_kv_writes_the_reference_bits(b: int, t: int, d: int, x_dtype: torch.dtype) -> None:
    """The CPU bundle's cache write (``neuronfx::store_int8_kv``) against the reference ops'
    (``ops.write_kv``: index_put of ``quantize_rows``, eager) on the same caches: bit-equal,
    zero, tiny, NaN and infinite rows included, K and V as the phases pass them (transposed
    views; and once with the head dim strided), rows at any offsets of their blocks; 4 x 200 rows
    is a prefill's size (no prefetch, run on 2 threads). A bf16 cache only checks the dispatch:
    the kernel bundle sends it to the reference write."""
    if not small_gemm_available():
        pytest.fail("the kernel library did not build on this machine")
    g = torch.Generator().manual_seed(d + t)
    h_kv, blocks_n, bs = 2, 7, 256
    caches = [torch.randint(-128, 128, (blocks_n, h_kv, bs, d + 4), dtype=torch.int8, generator=g) for _ in range(2)]
    k, v = (torch.randn(b, h_kv, t, d, generator=g).to(x_dtype) for _ in range(2))  # as the phases hold them
    k[0, 1, 0] = 0.0
    k[1, 0, 1, 3] = float("nan")
    v[1, 1, 2, 5] = float("inf")
    v[0, 0, 1] *= 1e-30
    v[1, 1, 0] *= 1e-40  # a subnormal largest |x|: 1 / it overflows to inf, every value 0
    blocks = torch.randperm(blocks_n, generator=g)[:b, None].expand(b, t).contiguous()  # a block per row
    offsets = torch.stack([torch.randperm(bs, generator=g)[:t] for _ in range(b)])  # distinct: no two rows share a place
    want = [c.clone() for c in caches]
    write_kv(*want, blocks, offsets, k.transpose(1, 2), v.transpose(1, 2))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite's processes run on one: a prefill's rows split over two here
    try:
        got = [c.clone() for c in caches]
        kernel_store_kv(*got, blocks, offsets, k.transpose(1, 2), v.transpose(1, 2))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(got[0], caches[0])  # it wrote
    strided = k.transpose(-1, -2).contiguous().transpose(-1, -2).transpose(1, 2)  # head dim stride != 1
    assert strided.stride(-1) != 1
    got_strided = [c.clone() for c in caches]
    kernel_store_kv(*got_strided, blocks, offsets, strided, v.transpose(1, 2))
    assert torch.equal(got_strided[0], want[0]) and torch.equal(got_strided[1], want[1])
    bf16 = [torch.zeros(blocks_n, h_kv, bs, d, dtype=torch.bfloat16) for _ in range(4)]
    write_kv(bf16[0], bf16[1], blocks, offsets, k.transpose(1, 2), v.transpose(1, 2))
    kernel_store_kv(bf16[2], bf16[3], blocks, offsets, k.transpose(1, 2), v.transpose(1, 2))
    for got_bf16, want_bf16 in ((bf16[2], bf16[0]), (bf16[3], bf16[1])):
        torch.testing.assert_close(got_bf16, want_bf16, rtol=0, atol=0, equal_nan=True)


def test_store_int8_kv_named_errors() -> None:
    """Bad places and shapes are errors naming the problem, and the caches stay as they were."""
    if not small_gemm_available():
        pytest.fail("the kernel library did not build on this machine")
    cache = torch.zeros(3, 2, 8, 68, dtype=torch.int8)
    other = cache.clone()
    x = torch.randn(1, 2, 2, 64)
    with pytest.raises(RuntimeError, match="block 3 offset 1 outside the caches' 3 blocks of 8"):
        store_int8_kv(cache, other, x, x, torch.tensor([[0, 3]]), torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="D = its row width - 4"):
        store_int8_kv(cache, other, x[..., :32], x[..., :32], torch.tensor([[0, 1]]), torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="blocks and offsets must be"):
        store_int8_kv(cache, other, x, x, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="block 1 offset -1 outside"):
        store_int8_kv(cache, other, x, x, torch.tensor([[0, 1]]), torch.tensor([[0, -1]]))
    with pytest.raises(RuntimeError, match="block 0 offset 8 outside"):
        store_int8_kv(cache, other, x, x, torch.tensor([[0, 0]]), torch.tensor([[8, 0]]))
    with pytest.raises(RuntimeError, match="a cache must be an int8"):
        store_int8_kv(cache.float(), other, x, x, torch.tensor([[0, 1]]), torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="one shape"):
        store_int8_kv(cache, torch.zeros(4, 2, 8, 68, dtype=torch.int8), x, x, torch.tensor([[0, 1]]), torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        store_int8_kv(cache, other, x.double(), x, torch.tensor([[0, 1]]), torch.tensor([[0, 1]]))
    assert not cache.any() and not other.any()


def test_layout_bytes_and_named_errors() -> None:
    hf = tiny_hf_model("llama")
    plans = {kv: tiny_plan(hf, kv_cache_dtype=kv) for kv in ("auto", "bf16", "int8", "fp8")}
    d = hf.config.hidden_size // hf.config.num_attention_heads
    assert [plans[kv].kv.dtype for kv in plans] == ["float32", "bfloat16", "int8", "float8_e4m3fn"]
    assert plans["int8"].kv.shape[-1] == d + 4 and plans["bf16"].kv.shape[-1] == d
    assert plans["int8"].kv.nbytes / plans["bf16"].kv.nbytes == (d + 4) / (2 * d)
    assert plans["fp8"].kv.nbytes * 4 == plans["auto"].kv.nbytes
    assert kv_storage_dtype("auto", "bfloat16", 64) == "bfloat16"
    # vLLM's aliases spelled one way: one plan (and cache key, and saved-runtime check) per stored dtype
    assert InferenceConfig(kv_cache_dtype="bfloat16") == InferenceConfig(kv_cache_dtype="bf16")
    assert InferenceConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='fp4'.*one of"):
        InferenceConfig(kv_cache_dtype="fp4")
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='int8' needs head_dim divisible by 4 \(got 30\)"):
        kv_storage_dtype("int8", "float32", 30)
    assert kv_storage_dtype("int8", "float32", 512) == "int8"
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='int8' supports head_dim up to 512 \(got 516\).*'bf16'"):
        kv_storage_dtype("int8", "float32", 516)
    with pytest.raises(ConfigError, match="neuron backend keeps the KV cache"):
        InferenceConfig(kv_cache_dtype="int8", backend="neuron")
    with pytest.raises(ConfigError, match="kv_cache_dtype='int8'"):
        InferenceConfig(kv_cache_dtype="int8", task="embed")
    assert set(LOGIT_TOL) < set(KV_CACHE_DTYPES)


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=3)


@pytest.fixture(scope="module")
def float_cache(hf):
    rt = tiny_runtime(hf, "eager", output_logits=True)
    tokens, logits, _, _ = run_steps(rt, neuronfx.init_state(rt), [0, 1, 2], PROMPTS, 12)
    return tokens, logits


def max_logit_error(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> float:
    return max((x - y).abs().max().item() for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.parametrize("kv", ["bf16", "int8", "fp8"])
def test_eager_tokens_and_logits_against_the_float_cache(hf, float_cache, kv: str) -> None:
    rt = tiny_runtime(hf, "eager", output_logits=True, kv_cache_dtype=kv)
    tokens, logits, _, state = run_steps(rt, neuronfx.init_state(rt), [0, 1, 2], PROMPTS, 12)
    assert state.kv[0].k.dtype == {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv]
    assert tokens == float_cache[0]
    assert 0 < max_logit_error(logits, float_cache[1]) < LOGIT_TOL[kv]


def test_inductor_int8_cache_equals_eager(hf) -> None:
    """The default backend (the C++ kernel, the ``store_int8_kv`` cache write) against the eager reference
    ops on the same int8 cache: tokens equal, logits within fp32 reordering. One bucket per phase
    (2 graphs: the suite's time)."""
    one = dict(output_logits=True, kv_cache_dtype="int8", prefill_buckets=(32,), decode_buckets=(64,))
    eager = tiny_runtime(hf, "eager", **one)
    compiled = tiny_runtime(hf, "inductor", **one)
    want, want_logits, _, want_state = run_steps(eager, neuronfx.init_state(eager), [0, 1, 2], PROMPTS, 12)
    got, got_logits, _, got_state = run_steps(compiled, neuronfx.init_state(compiled), [0, 1, 2], PROMPTS, 12)
    assert got == want
    assert max_logit_error(got_logits, want_logits) < 1e-4
    # the stored rows agree too: int8 values within one step of rounding, scales within fp32
    # reordering. The positions each slot holds only: a pad token after a prompt is written at
    # prefill but never read, and the prefill attention kernel does not compute it.
    assert got_state.cache_lens == want_state.cache_lens
    for slot, n in enumerate(got_state.cache_lens[:3]):
        k_eager, k_ind = want_state.kv[1].k[slot, :, :n], got_state.kv[1].k[slot, :, :n]
        assert (k_eager[..., :-4].int() - k_ind[..., :-4].int()).abs().max() <= 1
        torch.testing.assert_close(load_rows(k_ind, torch.float32), load_rows(k_eager, torch.float32), atol=0.05, rtol=0)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_greedy_self_speculation_equals_plain_greedy(hf, kv: str) -> None:
    """A verify pass reads the stored rows as a decode step does: the same tokens."""
    plain = tiny_runtime(hf, "eager", kv_cache_dtype=kv)
    spec = tiny_runtime(hf, "eager", kv_cache_dtype=kv, speculation_length=4, draft_layers=1)
    want, _ = neuronfx.generate(plain, neuronfx.init_state(plain), PROMPTS, max_new_tokens=17, eos_token_ids=NO_EOS)
    got, _ = neuronfx.generate(spec, neuronfx.init_state(spec), PROMPTS, max_new_tokens=17, eos_token_ids=NO_EOS)
    assert got.token_ids == want.token_ids
    assert sum(s.drafted for s in got.speculation) > 0


def test_prefix_hit_copies_int8_rows_with_their_scales(hf) -> None:
    """A prefix hit copies pool blocks (int8 values and scale bytes) into the slot: the hit
    request's cached prefix rows equal, bit for bit, those its first request wrote."""
    rt = tiny_runtime(hf, "eager", kv_cache_dtype="int8", prefill_chunk_size=8, prefill_buckets=(8,),
                      enable_prefix_caching=True, prefix_block_size=4)
    prompt = random_prompt(13, seed=5)
    state = neuronfx.init_state(rt)
    assert state.prefix.pool[0].k.dtype == torch.int8 and state.prefix.pool[0].k.shape[-1] == rt.plan.kv.row_width
    rows = []
    for _ in range(2):
        for event in neuronfx.schedule(rt, state, [Request(prompt=tuple(prompt), sampling=SamplingParams(max_tokens=1))],
                                       frozenset()):
            if not isinstance(event, neuronfx.TokenEvent):
                state = event.state
        rows.append(state.kv[0].k[0, :, :12].clone())  # slot 0, the 3 full blocks
    assert neuronfx.prefix_stats(state).hits == 12
    assert torch.equal(rows[0], rows[1])
