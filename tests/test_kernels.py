"""The kernel ops (graphs/ops.py: small_gemm, small_gemm_multi, small_glu, the cached attention
kernel and its fused-torch fallback)
against float64 references and against the reference ops, and the kernel choice of the CPU ops
bundle inside compiled graphs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from neuronfx.config.masks import decode_mask
from neuronfx.graphs.kernels.bundles import (
    REFERENCE_OPS,
    cpu_kernel_ops,
    fused_cached_attention,
    gathered_attention,
    kernel_cached_attention,
    kernel_causal_attention,
)
from neuronfx.graphs.kernels.library import (
    FP32_KERNEL_MAX_ROWS,
    SMALL_GEMM_MAX_ROWS,
    argmax_rows,
    causal_attention,
    causal_attention_isa,
    small_gemm,
    small_gemm_available,
    small_gemm_multi,
    small_glu,
    topk_rows,
)
from neuronfx.graphs.models.kv_rows import load_rows, store_rows

CPU_OPS = cpu_kernel_ops("float32")
linear = CPU_OPS.linear

# Tolerances: fp32 accumulation over K <= 200 terms of O(1) products; the output is rounded to
# x's dtype (bf16: 8 mantissa bits, relative 2**-8; fp16: 2**-11).
TOL = {torch.float32: 1e-4, torch.bfloat16: 2**-8, torch.float16: 2**-11}


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not small_gemm_available():
        pytest.fail("the small_gemm kernel did not build on this machine (see the warning above)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 11, 30])
@pytest.mark.parametrize("bias", [False, True])
def test_small_gemm_matches_float64(dtype: torch.dtype, rows: int, bias: bool) -> None:
    # K = 197 and N = 67 leave tails after the 8-wide vector loop and the 4/2-row tiles.
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 197, generator=g).to(dtype)
    w = torch.randn(67, 197, generator=g).to(dtype)
    b = torch.randn(67, generator=g).to(dtype) if bias else None
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    out = small_gemm(x.view(1, rows, 197), w, b)
    assert out.shape == (1, rows, 67) and out.dtype == dtype
    err = (out[0].double() - ref).abs() / ref.abs().clamp(min=1.0)
    assert err.max().item() <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_gemm_rows_equal_each_row_alone(dtype: torch.dtype) -> None:
    """Batch invariance: every row of an M-row product (M = 1..8, 11, and fp32's 4 x 3 tiles up to
    FP32_KERNEL_MAX_ROWS with each remainder of four) has the bits of that row multiplied alone
    (a verify row of a speculate step reduces as its decode row); the same for small_glu.
    N = 67 leaves one weight row after the groups of three, K = 197 a tail after the 8-wide loop."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(FP32_KERNEL_MAX_ROWS, 197, generator=g).to(dtype)
    w, gate, up = (torch.randn(67, 197, generator=g).to(dtype) for _ in range(3))
    alone = torch.cat([small_gemm(x[i : i + 1], w, None) for i in range(len(x))])
    glu_alone = torch.cat([small_glu(x[i : i + 1], gate, up) for i in range(len(x))])
    for rows in [1, 2, 3, 4, 5, 6, 7, 8, 11, 13, 14, 32, FP32_KERNEL_MAX_ROWS - 1, FP32_KERNEL_MAX_ROWS]:
        assert torch.equal(small_gemm(x[:rows], w, None), alone[:rows]), rows
        assert torch.equal(small_glu(x[:rows], gate, up), glu_alone[:rows]), rows


def _ops_run(fn: object, *args: torch.Tensor) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args)
    return {e.name for e in prof.events()}


@pytest.mark.parametrize(("dtype", "rows", "kernel"), [
    ("float32", 1, True), ("float32", SMALL_GEMM_MAX_ROWS + 1, True), ("float32", FP32_KERNEL_MAX_ROWS, True),
    ("float32", FP32_KERNEL_MAX_ROWS + 1, False), ("bfloat16", SMALL_GEMM_MAX_ROWS, True),
    ("bfloat16", SMALL_GEMM_MAX_ROWS + 1, False)])
def test_compiled_linear_uses_kernel_up_to_max_rows(dtype: str, rows: int, kernel: bool) -> None:
    """small_gemm serves up to SMALL_GEMM_MAX_ROWS rows, fp32 weights up to FP32_KERNEL_MAX_ROWS."""
    dt = getattr(torch, dtype)
    x, w = torch.randn(rows, 64).to(dt), torch.randn(32, 64).to(dt)
    fn = torch.compile(cpu_kernel_ops(dtype).linear, fullgraph=True, dynamic=False)
    out = fn(x, w)
    tol = 1e-5 if dtype == "float32" else 2**-6
    torch.testing.assert_close(out.float(), x.float() @ w.float().T, rtol=tol, atol=tol)
    ops = _ops_run(fn, x, w)
    assert ("neuronfx::small_gemm" in ops) == kernel, sorted(ops)


@pytest.mark.parametrize(("dtype", "rows", "kernel"), [
    ("float32", 32, True), ("float32", FP32_KERNEL_MAX_ROWS + 1, False), ("bfloat16", SMALL_GEMM_MAX_ROWS + 1, False)])
def test_compiled_projections_and_glu_use_kernels_up_to_max_rows(dtype: str, rows: int, kernel: bool) -> None:
    """Q/K/V as one small_gemm_multi call and SwiGLU as one small_glu call at the same row limits as linear."""
    torch._dynamo.reset()  # cpu_glu's code object is compiled for many shapes across this file: dynamo's recompile limit
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=g).to(dt)
    ws = [torch.randn(n, 64, generator=g).to(dt) for n in (64, 32, 32)]
    ops = cpu_kernel_ops(dtype)
    proj = torch.compile(lambda x, a, b, c: ops.projections(x, [a, b, c], [None, None, None]), fullgraph=True, dynamic=False)
    glu = torch.compile(ops.glu, fullgraph=True, dynamic=False)
    tol = 1e-5 if dtype == "float32" else 2**-6
    for out, w in zip(proj(x, *ws), ws, strict=True):
        torch.testing.assert_close(out.float(), x.float() @ w.float().T, rtol=tol, atol=tol)
    torch.testing.assert_close(glu(x, ws[1], ws[2]).float(), REFERENCE_OPS.glu(x, ws[1], ws[2]).float(), rtol=tol, atol=tol)
    assert ("neuronfx::small_gemm_multi" in _ops_run(proj, x, *ws)) == kernel
    assert ("neuronfx::small_glu" in _ops_run(glu, x, ws[1], ws[2])) == kernel


def test_reference_linear_is_f_linear() -> None:
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    assert "neuronfx::small_gemm" not in _ops_run(REFERENCE_OPS.linear, x, w)
    assert torch.equal(REFERENCE_OPS.linear(x, w, None), torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("rows", [1, 8, 12])
def test_16bit_kernel_ops_match_reference_ops(rows: int) -> None:
    """The bf16 bundle (widened to fp32 where this CPU has no native bf16 GEMM) against the
    reference ops on the same bf16 tensors; both round to bf16 (8 mantissa bits) at the end,
    the reference also inside, so they agree within a few bf16 roundings of O(1) values."""
    ops = cpu_kernel_ops("bfloat16")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 64, generator=g).bfloat16()
    w, gate, up = (torch.randn(n, 64, generator=g).div(8).bfloat16() for n in (32, 48, 48))
    tol = {"rtol": 2**-6, "atol": 2**-6}
    torch.testing.assert_close(ops.linear(x, w, None).float(), REFERENCE_OPS.linear(x, w, None).float(), **tol)
    torch.testing.assert_close(ops.glu(x, gate, up).float(), REFERENCE_OPS.glu(x, gate, up).float(), **tol)
    q, k, v = (torch.randn(2, h, rows, 16, generator=g).bfloat16() for h in (4, 2, 2))
    mask = torch.ones(2, 1, rows, rows, dtype=torch.bool).tril()
    torch.testing.assert_close(ops.attention(q, k, v, mask).float(), REFERENCE_OPS.attention(q, k, v, mask).float(), **tol)


@pytest.mark.parametrize("rows", [1, 8, 12])
def test_kernel_ops_match_reference_ops(rows: int) -> None:
    """Every product op of the CPU bundle against the same op of the reference bundle."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 64, generator=g)
    ws = [torch.randn(n, 64, generator=g) for n in (64, 32, 32)]
    bs = [torch.randn(n, generator=g) for n in (64, 32, 32)]
    torch.testing.assert_close(CPU_OPS.linear(x, ws[0], bs[0]), REFERENCE_OPS.linear(x, ws[0], bs[0]), rtol=1e-5, atol=1e-5)
    for a, b in zip(CPU_OPS.projections(x, ws, bs), REFERENCE_OPS.projections(x, ws, bs), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(CPU_OPS.glu(x, ws[1], ws[2]), REFERENCE_OPS.glu(x, ws[1], ws[2]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_small_gemm_multi_matches_float64(wdtype: torch.dtype, xdtype: torch.dtype, rows: int) -> None:
    # Three weights of 70, 5 and 33 rows: the parallel tasks straddle weight boundaries.
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 197, generator=g).to(xdtype)
    ws = [torch.randn(n, 197, generator=g).to(wdtype) for n in (70, 5, 33)]
    bs = [torch.randn(70, generator=g).to(wdtype), None, torch.randn(33, generator=g)]
    outs = small_gemm_multi(x, ws, bs)
    for out, w, b in zip(outs, ws, bs):
        ref = x[0].double() @ w.double().T + (0 if b is None else b.double())
        assert out.shape == (1, rows, w.shape[0]) and out.dtype == xdtype
        err = (out[0].double() - ref).abs() / ref.abs().clamp(min=1.0)
        assert err.max().item() <= max(TOL[xdtype], TOL[wdtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_small_glu_matches_float64(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 197, generator=g).to(dtype)
    gate, up = (torch.randn(67, 197, generator=g).to(dtype) for _ in range(2))
    a, b = x.double() @ gate.double().T, x.double() @ up.double().T
    ref = a * torch.sigmoid(a) * b
    out = small_glu(x, gate, up)
    assert out.shape == (rows, 67) and out.dtype == dtype
    err = (out.double() - ref).abs() / ref.abs().clamp(min=1.0)
    assert err.max().item() <= 4 * TOL[dtype]  # silu and the product add a few roundings in fp32


def test_small_gemm_multi_rejects_mismatched_weights() -> None:
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="weight has 32 features, expected 64"):
        small_gemm_multi(x, [torch.randn(8, 64), torch.randn(8, 32)], [None, None])
    with pytest.raises(RuntimeError, match="share a dtype"):
        small_gemm_multi(x, [torch.randn(8, 64), torch.randn(8, 64).bfloat16()], [None, None])


def naive_rows(cache: torch.Tensor, block_table: torch.Tensor, bucket: int) -> torch.Tensor:
    """(B, H_kv, bucket, W) stored rows of each row's first ``bucket`` positions, copied one
    position at a time: position j of row b is block ``block_table[b, j // block_size]``, offset
    ``j % block_size``."""
    bs = cache.shape[2]
    rows = [torch.stack([cache[int(block_table[b, j // bs]), :, j % bs] for j in range(bucket)], dim=1)
            for b in range(block_table.shape[0])]
    return torch.stack(rows)


def naive_window(cache: torch.Tensor, block_table: torch.Tensor, bucket: int) -> torch.Tensor:
    """:func:`naive_rows` as float64 values (int8 rows dequantized with their scale)."""
    return load_rows(naive_rows(cache, block_table, bucket), torch.float64)


VALUE_SPAN = 256
"""Positions per span over which the kernel rounds the value weights of an int8 cache to int16
(``kValueSpan`` in csrc/small_gemm.cpp); spans start at multiples of it."""


def int16_value_weights(weights: torch.Tensor, scales: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The weights (n,) float64 as the kernel multiplies an int8 cache's values (n,) positions
    (window indices, int64) with: each weight times its value row's scale (n,) rounded to int16
    (half to even) against the largest of its span of :data:`VALUE_SPAN` positions, then divided
    by the scale again, so that they multiply the dequantized values."""
    p = weights * scales
    rounded = torch.zeros_like(p)
    spans = positions.div(VALUE_SPAN, rounding_mode="floor")
    for span in spans.unique():
        sel = spans == span
        top = p[sel].abs().max()
        if top.isnan():  # a NaN weight (a NaN score): the row's output is NaN, as the kernel's (its sum is NaN)
            rounded[sel] = float("nan")
        elif top > 0:
            rounded[sel] = torch.round(p[sel] / top * 32767) * top / 32767
    return torch.where(scales != 0, rounded / scales, 0.0)  # a zero row's scale is 0 (its values too)


def naive_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    bucket: int, mask: torch.Tensor, int16_weights: bool = False) -> torch.Tensor:
    """float64 loops over rows, heads and queries: softmax over the attended positions only, of
    the window :func:`naive_window` reads through the block table (B, N); ``int16_weights``: the
    weights of an int8 cache's values rounded as the kernel rounds them (:func:`int16_value_weights`)."""
    b, h, t, d = q.shape
    group = h // k_cache.shape[1]
    out = torch.zeros(b, h, t, d, dtype=torch.float64)
    k_window, v_window = naive_window(k_cache, block_table, bucket), naive_window(v_cache, block_table, bucket)
    v_scales = naive_rows(v_cache, block_table, bucket)[..., d:].contiguous().view(torch.float32)[..., 0].double() if int16_weights else None
    for i in range(b):
        for head in range(h):
            keys, values = k_window[i, head // group], v_window[i, head // group]
            for j in range(t):
                seen = mask[i, 0, j].nonzero()[:, 0]
                scores = keys[seen] @ q[i, head, j].double() / d**0.5
                weights = torch.softmax(scores, 0)
                if v_scales is not None:
                    weights = int16_value_weights(weights, v_scales[i, head // group, seen], seen)
                out[i, head, j] = weights @ values[seen]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,tokens", [(1, 1), (3, 1), (2, 4)])
@pytest.mark.parametrize("op", ["kernel", "kernel-compiled", "fused", "fused-compiled", "reference"])
def test_cached_attention_matches_naive(dtype: torch.dtype, batch: int, tokens: int, op: str) -> None:
    # 6 query heads over 2 KV heads, 4 slots of 40 positions, a 32-position window; positions
    # past each row's last token hold NaN, which must not reach the output.
    g = torch.Generator().manual_seed(batch * 10 + tokens)
    k_cache, v_cache = (torch.randn(4, 2, 40, 16, generator=g).to(dtype) for _ in range(2))
    seq_ids = torch.tensor([3, 0, 2][:batch], dtype=torch.int32)
    last = torch.tensor([20, 31, 7][:batch])
    position_ids = last[:, None] - tokens + 1 + torch.arange(tokens)  # (B, T), the row's newest tokens
    for i, s in enumerate(seq_ids.tolist()):
        k_cache[s, :, last[i] + 1:] = float("nan")
        v_cache[s, :, last[i] + 1:] = float("nan")
    mask = decode_mask(position_ids, 32)
    q = torch.randn(batch, 6, tokens, 16, generator=g).to(dtype)
    fns = {"fused": fused_cached_attention, "reference": gathered_attention, "kernel": kernel_cached_attention,
           "fused-compiled": torch.compile(fused_cached_attention, fullgraph=True, dynamic=False),
           "kernel-compiled": torch.compile(kernel_cached_attention, fullgraph=True, dynamic=False)}
    out = fns[op](q, k_cache, v_cache, seq_ids[:, None], 32, mask)
    ref = naive_attention(q, k_cache, v_cache, seq_ids[:, None], 32, mask)
    assert out.dtype == dtype and out.shape == (batch, 6, tokens, 16)
    # fp32 math throughout (the reference op: SDPA in the input dtype, so bf16 rounds inside too);
    # bf16 rounds the output once (relative 2**-8 of values of O(1)).
    atol = 1e-5 if dtype == torch.float32 else 2**-7 if op != "reference" else 2**-5
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=atol)


def int16_queries(q: torch.Tensor) -> torch.Tensor:
    """q as the kernel multiplies it with int8 keys, in float64: each row (last dim) rounded to
    int16 with one scale, its largest |q| / 32767 (half to even, as ``std::nearbyint``); a row
    whose largest |q| is below 1e-30 (or not finite: not used here) is zeros."""
    q = q.float()
    top = q.abs().amax(-1, keepdim=True)
    usable = top >= 1e-30
    inv = torch.where(usable, torch.full_like(top, 32767.0) / top, 0.0)  # not 32767 / top: torch takes 1 / top first
    rounded = torch.where(usable, torch.round(q * inv), 0.0)
    return rounded.double() * torch.where(usable, top.double() / 32767.0, 0.0)


def kernel_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, bucket: int,
                     mask: torch.Tensor) -> torch.Tensor:
    """:func:`naive_attention` of what the kernel computes: over an int8 cache its queries are
    rounded to int16 first (:func:`int16_queries`), so that q . k sums in integers, and so are
    the weights of its values (:func:`int16_value_weights`)."""
    int8 = k_cache.dtype == torch.int8
    return naive_attention(int16_queries(q) if int8 else q, k_cache, v_cache, block_table, bucket, mask, int16_weights=int8)


INT16_WEIGHT_ATOL = 5e-5
"""How far the kernel's int8-cache outputs may be from :func:`kernel_reference`'s: both round the
value weights to int16, the kernel from its fp32 softmax (relative error about 4e-7, 0.013 of a
unit at the top), the reference from float64, so a weight within that of a half unit rounds
apart; each such position moves the output by its span's largest weight / 32767 times its value
(at most 3e-5 x max |v|; the tests' weights are well below the top and their values O(1)),
beside the float paths' 1e-5."""


def reference_atol(cache_dtype: torch.dtype) -> float:
    """The tolerance of a kernel output against :func:`kernel_reference` for this cache dtype."""
    return INT16_WEIGHT_ATOL if cache_dtype == torch.int8 else 1e-5


INT16_QUERY_ATOL = 1e-4
"""How far the kernel's int8-cache outputs may be from the unrounded queries' (the values here are
O(1); rounding q moves a score by at most 2^-16 of its row's largest |q| times sum |k| / sqrt(D))."""


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("head_dim", [20, 24])
def test_cached_attention_kernel_odd_sizes_and_empty_rows(cache_dtype: torch.dtype, head_dim: int) -> None:
    """Head dims 20 and 24 and 37 positions leave tails after the 8-lane and 4-key loops (int8
    keys: 16 lanes, then 8, then scalar); a random mask (not a prefix) mixes attended and hidden
    keys inside each 4-key block; a token that attends nothing gets zeros. Hidden positions hold
    NaN."""
    g = torch.Generator().manual_seed(7)
    d = head_dim
    k_cache, v_cache = (store_rows(torch.randn(3, 2, 45, d, generator=g), torch.empty(0, dtype=cache_dtype)) for _ in range(2))
    seq_ids = torch.tensor([2, 0], dtype=torch.int64)
    mask = torch.rand(2, 1, 3, 37, generator=g) < 0.6
    mask[1, 0, 2] = False
    hidden = ~mask.any(dim=2)[:, 0]  # (B, S)
    for i, s in enumerate(seq_ids.tolist()):
        for cache in (k_cache, v_cache):
            cache[s, :, :37][:, hidden[i]] = store_rows(torch.full((d,), float("nan")), torch.empty(0, dtype=cache_dtype))
    q = torch.randn(2, 4, 3, d, generator=g)
    out = kernel_cached_attention(q, k_cache, v_cache, seq_ids[:, None], 37, mask)
    for ref, atol in ((kernel_reference(q, k_cache, v_cache, seq_ids[:, None], 37, mask), reference_atol(cache_dtype)),
                      (naive_attention(q, k_cache, v_cache, seq_ids[:, None], 37, mask), INT16_QUERY_ATOL)):
        ref[1, :, 2] = 0.0  # the naive softmax over no positions is NaN; the kernel's answer is zeros
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=atol)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("tokens", [1, 3])
def test_cached_attention_bucket_past_the_live_positions_changes_no_bit(cache_dtype: torch.dtype, tokens: int) -> None:
    """The kernel stops after the last position any row attends: a 61-position bucket whose rows
    attend 21 and 30 positions gives the bits of the same cache read through a 32-position bucket,
    whatever the hidden positions hold (NaN here), and matches the naive reference."""
    g = torch.Generator().manual_seed(11)
    k_cache, v_cache = (store_rows(torch.randn(2, 3, 61, 32, generator=g), torch.empty(0, dtype=cache_dtype)) for _ in range(2))
    for cache in (k_cache, v_cache):
        cache[0, :, 21:] = store_rows(torch.full((32,), float("nan")), torch.empty(0, dtype=cache_dtype))
        cache[1, :, 30:] = store_rows(torch.full((32,), float("nan")), torch.empty(0, dtype=cache_dtype))
    position_ids = torch.tensor([[20], [29]]) - torch.arange(tokens - 1, -1, -1)  # (B, T), each row's newest tokens
    long, short = decode_mask(position_ids, 61), decode_mask(position_ids, 32)
    assert torch.equal(long[..., :32], short) and not long[..., 32:].any()
    q = torch.randn(2, 6, tokens, 32, generator=g)
    table = torch.tensor([[0], [1]])
    out = kernel_cached_attention(q, k_cache, v_cache, table, 61, long)
    assert torch.equal(out, kernel_cached_attention(q, k_cache, v_cache, table, 32, short))
    torch.testing.assert_close(out.double(), kernel_reference(q, k_cache, v_cache, table, 61, long), rtol=0, atol=reference_atol(cache_dtype))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_cached_attention_softmax_chunks_do_not_depend_on_the_other_rows(cache_dtype: torch.dtype) -> None:
    """A token's softmax sums its weights in the same chunks whether the other token of its KV
    head attends 61 positions or, as it does, 21: the passes stop at the last live position
    rounded up to 8 (AVX2's 8-lane chunks: stopping at 21 would sum positions 16-20 in the scalar
    tail; AVX-512's 16-lane ones mask their last chunk)."""
    g = torch.Generator().manual_seed(12)
    k_cache, v_cache = (store_rows(torch.randn(1, 1, 61, 32, generator=g), torch.empty(0, dtype=cache_dtype)) for _ in range(2))
    q = torch.randn(1, 2, 2, 32, generator=g)
    wide, narrow = torch.zeros(1, 1, 2, 61, dtype=torch.bool), torch.zeros(1, 1, 2, 61, dtype=torch.bool)
    wide[0, 0, 0, :21] = narrow[0, 0, 0, :21] = narrow[0, 0, 1, :21] = True
    wide[0, 0, 1, :] = True
    table = torch.tensor([[0]])
    a = kernel_cached_attention(q, k_cache, v_cache, table, 61, wide)
    b = kernel_cached_attention(q, k_cache, v_cache, table, 61, narrow)
    assert torch.equal(a[:, :, 0], b[:, :, 0])
    assert not torch.equal(a[:, :, 1], b[:, :, 1])


def int8_rows(values: torch.Tensor, scale: float) -> torch.Tensor:
    """int8 cache rows (..., D + 4) of raw int8 ``values`` (-128 allowed, which quantize_rows never
    writes) and one fp32 ``scale`` per row, as ``kv_rows.quantize_rows`` lays them out."""
    scale_bytes = torch.tensor([scale], dtype=torch.float32).view(torch.int8).expand(*values.shape[:-1], 4)
    return torch.cat([values.to(torch.int8), scale_bytes], dim=-1)


def test_cached_attention_int8_keys_at_the_head_dim_limit() -> None:
    """Head dim 512, every q entry its row's largest (int16 32767) and keys of -128 or +127: the
    integer sums reach -512 x 32767 x 128, the most int32 holds exactly; a wrapped sum would flip
    their sign and the softmax with it."""
    d, s = 512, 4
    keys = torch.stack([torch.full((d,), -128), torch.full((d,), 127), torch.full((d,), -128), torch.full((d,), 127)])
    k = int8_rows(keys, 1e-3)[None, None]  # (1 block, 1 KV head, 4 positions, d + 4)
    v = store_rows(torch.randn(1, 1, s, d, generator=torch.Generator().manual_seed(3)), torch.empty(0, dtype=torch.int8))
    q = torch.full((1, 2, 1, d), 0.5)
    q[0, 1] = -0.5
    table, mask = torch.tensor([[0]]), torch.ones(1, 1, 1, s, dtype=torch.bool)
    out = kernel_cached_attention(q, k, v, table, s, mask)
    torch.testing.assert_close(out.double(), kernel_reference(q, k, v, table, s, mask), rtol=0, atol=INT16_WEIGHT_ATOL)


def test_cached_attention_int8_keys_with_nan_or_tiny_queries() -> None:
    """Over int8 keys a query row holding NaN gets a NaN output, as over the same values in an
    fp32 cache (every score NaN) and as SDPA; a row whose largest |q| is below 1e-30 rounds to zeros, so its
    weights are uniform, as the fp32 cache's scores of about 1e-30 make them (then rounded to int16
    against the largest of the values' scales, :func:`int16_value_weights`)."""
    g = torch.Generator().manual_seed(5)
    k, v = (store_rows(torch.randn(1, 2, 12, 32, generator=g), torch.empty(0, dtype=torch.int8)) for _ in range(2))
    q = torch.randn(1, 4, 1, 32, generator=g)
    q[0, 1, 0, 3] = float("nan")
    q[0, 2] *= 1e-32
    table, mask = torch.tensor([[0]]), torch.ones(1, 1, 1, 12, dtype=torch.bool)
    out = kernel_cached_attention(q, k, v, table, 12, mask)
    as_fp32 = kernel_cached_attention(q, load_rows(k, torch.float32), load_rows(v, torch.float32), table, 12, mask)
    assert out[0, 1].isnan().all() and as_fp32[0, 1].isnan().all() and not out[0, [0, 2, 3]].isnan().any()
    uniform = int16_value_weights(torch.full((12,), 1 / 12, dtype=torch.float64), v[0, 1, :, 32:].contiguous().view(torch.float32)[:, 0].double(),
                                  torch.arange(12))
    torch.testing.assert_close(out[0, 2].double(), (uniform @ load_rows(v, torch.float64)[0, 1])[None], rtol=0, atol=1e-6)
    torch.testing.assert_close(out, as_fp32, rtol=0, atol=INT16_QUERY_ATOL, equal_nan=True)


def nan_key_case(cache_dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((q, k_cache, v_cache, block_table, mask), expected): 3 new tokens per row of 2 (a verify
    pass), 4 query heads over 2 KV heads, a 40-position window of slots 0 and 2, with a NaN key
    that all 3 of row 0's tokens attend (KV head 1), one only row 1's tokens 1 and 2 attend (KV
    head 0), and (float caches) an infinite key component under query components of both signs
    (row 1, KV head 1); expected (B, H, T) bool: the tokens whose output the float64 softmax over
    the attended positions makes NaN (the NaN keys' tokens, and the inf key's where q . k = +inf:
    inf - inf; -inf drops the position). Also run on the AVX2 and scalar builds by
    scripts/check_quant_paths.py."""
    g = torch.Generator().manual_seed(11)
    k_cache, v_cache = (torch.randn(3, 2, 48, 16, generator=g) for _ in range(2))
    last = torch.tensor([30, 39])
    position_ids = last[:, None] - 2 + torch.arange(3)  # (2, 3)
    k_cache[0, 1, 12, 3] = float("nan")
    k_cache[2, 0, 38, 5] = float("nan")
    if cache_dtype != torch.int8:  # (an int8 row's scale would be inf, its values 0: NaN or inf by the query)
        k_cache[2, 1, 20, 7] = float("inf")
    empty = torch.empty(0, dtype=cache_dtype)
    k_cache, v_cache = store_rows(k_cache, empty), store_rows(v_cache, empty)
    q = torch.randn(2, 4, 3, 16, generator=g)
    q[1, 2:, :, 7] = torch.tensor([[1.0, -1.0, 0.5], [-2.0, 0.25, 1.0]])  # both signs at the inf key
    expected = torch.zeros(2, 4, 3, dtype=torch.bool)
    expected[0, 2:] = True
    expected[1, :2, 1:] = True
    expected[1, 2:] = (q[1, 2:, :, 7] > 0) & (cache_dtype != torch.int8)
    return (q, k_cache, v_cache, torch.tensor([[0], [2]], dtype=torch.int32), decode_mask(position_ids, 40)), expected


NAN_KEY_ATOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.int8: INT16_QUERY_ATOL}
"""How far :func:`nan_key_case`'s finite outputs may be from :func:`naive_attention`'s, by cache dtype
(the tolerances of the other cached-attention tests)."""


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("op", ["kernel", "kernel-compiled"])
def test_cached_attention_nan_or_inf_at_an_attended_key_makes_its_tokens_nan(cache_dtype: torch.dtype, op: str) -> None:
    """A NaN or infinite key at an attended position makes NaN exactly the outputs the float64
    softmax over the attended positions makes NaN (SDPA's math; :func:`nan_key_case`), each such
    token NaN throughout, the others within the usual tolerance. The step's NaN report depends
    on this: before, the kernel's SIMD max skipped a NaN score and its weight became 0, so a
    compiled graph over a poisoned slot stayed finite."""
    (q, k_cache, v_cache, table, mask), expected = nan_key_case(cache_dtype)

    def attend(*args: object) -> torch.Tensor:  # its own code object: dynamo's recompile limit (8) counts per code object
        return kernel_cached_attention(*args)

    fn = kernel_cached_attention if op == "kernel" else torch.compile(attend, fullgraph=True, dynamic=False)
    out = fn(q, k_cache, v_cache, table, 40, mask)
    ref = naive_attention(q, k_cache, v_cache, table, 40, mask, int16_weights=cache_dtype == torch.int8)
    nan = out.isnan().any(-1)  # (B, H, T)
    assert torch.equal(nan, ref.isnan().any(-1)) and torch.equal(nan, expected)
    assert torch.equal(out.isnan(), nan[..., None].expand_as(out))
    torch.testing.assert_close(out.double().nan_to_num(0.0), ref.nan_to_num(0.0), rtol=0, atol=NAN_KEY_ATOL[cache_dtype])


def test_cached_attention_kernel_rejects_bad_inputs() -> None:
    q, cache, mask = torch.randn(1, 4, 1, 16), torch.randn(2, 2, 8, 16), torch.ones(1, 1, 1, 8, dtype=torch.bool)
    with pytest.raises(RuntimeError, match=r"block_table\[0, 0\] = 2 is out of \[0, 2\)"):
        kernel_cached_attention(q, cache, cache, torch.tensor([[2]]), 8, mask)
    with pytest.raises(RuntimeError, match=r"mask covers 9 positions, block table holds 8 \(1 blocks of 8\)"):
        kernel_cached_attention(q, cache, cache, torch.tensor([[0]]), 9, torch.ones(1, 1, 1, 9, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="4 query heads over 3 KV heads"):
        kernel_cached_attention(q, torch.randn(2, 3, 8, 16), torch.randn(2, 3, 8, 16), torch.tensor([[0]]), 8, mask)
    wide = torch.zeros(2, 2, 8, 520, dtype=torch.int8)  # head dim 516 + its scale: past int32's exact q . k sums
    with pytest.raises(RuntimeError, match="int8 rows of head dim 516 exceed 512"):
        kernel_cached_attention(torch.randn(1, 4, 1, 516), wide, wide, torch.tensor([[0]]), 8, mask)


def naive_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 reference: softmax(q k^T / sqrt(D)) over keys j <= i, KV heads repeated as HF's
    repeat_kv."""
    t, d = q.shape[2], q.shape[3]
    group = q.shape[1] // k.shape[1]
    keys, values = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    scores = (q.double() @ keys.transpose(-1, -2) / math.sqrt(d)).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(scores, dim=-1) @ values


# (batch, heads, KV heads, tokens, head dim): tokens off the 8-row tiles and 32-key steps, head
# dims off the 32 value columns of a step (16, 40), one token, KV heads shared by 1-3 heads
CAUSAL_SHAPES = [(1, 9, 3, 128, 64), (2, 4, 2, 37, 64), (1, 3, 1, 1, 64), (2, 6, 3, 130, 128), (1, 4, 4, 33, 16),
                 (1, 2, 1, 70, 40)]


@pytest.mark.parametrize("shape", CAUSAL_SHAPES)
def test_causal_attention_matches_float64_and_sdpa(shape: tuple[int, int, int, int, int]) -> None:
    """Prefill's causal attention kernel against the float64 reference and torch's SDPA (fp32
    sums in another order: within 1e-5 for O(1) values), on the graph's layouts: q and k as
    (B, T, heads, D) memory seen (B, heads, T, D), v contiguous. The output is a (B, H, T, D)
    view of (B, T, H, D) memory, as its fake says."""
    batch, heads, kv_heads, tokens, d = shape
    g = torch.Generator().manual_seed(tokens * d)
    q = torch.randn(batch, tokens, heads, d, generator=g).transpose(1, 2)
    k = torch.randn(batch, tokens, kv_heads, d, generator=g).transpose(1, 2)
    v = torch.randn(batch, kv_heads, tokens, d, generator=g)
    out = causal_attention(q, k, v)
    assert out.shape == (batch, heads, tokens, d) and out.dtype == torch.float32 and out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out.double(), naive_causal_attention(q, k, v), rtol=0, atol=1e-5)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    torch.testing.assert_close(out, sdpa, rtol=0, atol=1e-5)


def test_causal_attention_tokens_never_read_later_ones() -> None:
    """Token i's output keeps its bits whatever finite values the later tokens' queries, keys and
    values hold (pad tokens after a short prompt), including within a tile of 8 rows and a step
    of 32 keys (the change starts at token 50, inside both): their scores are masked and their
    values weighted 0. (An inf or NaN there would reach 0 x inf, as in torch's flash attention.)"""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, h, 77, 64, generator=g) for h in (6, 2, 2))
    changed = [x.clone() for x in (q, k, v)]
    for x in changed:
        x[:, :, 50:] = 1e3 * torch.randn(x[:, :, 50:].shape, generator=g)
    before, after = causal_attention(q, k, v), causal_attention(*changed)
    assert torch.equal(before[:, :, :50], after[:, :, :50])
    assert not torch.equal(before[:, :, 50:], after[:, :, 50:])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_causal_attention_skips_the_tokens_past_each_rows_length(dtype: torch.dtype) -> None:
    """With ``lengths``, row b's first lengths[b] tokens keep the bits of the call without it
    (whole tiles and tiles cut inside), its later tokens (a shorter prompt's pads) are zeros
    written by the kernel (the output is not zeroed memory: a call of the same size on NaN ran
    just before); lengths past T or below 0 are clamped."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(4, h, 45, 64, generator=g) for h in (6, 2, 2))
    full = causal_attention(q, k, v)
    nan = causal_attention(torch.full_like(q, float("nan")), k, v)
    assert nan.isnan().all()
    del nan
    out = causal_attention(q, k, v, torch.tensor([45, 20, 0, 99], dtype=dtype))
    for b, n in enumerate([45, 20, 0, 45]):
        assert torch.equal(out[b, :, :n], full[b, :, :n])
        assert torch.equal(out[b, :, n:], torch.zeros_like(out[b, :, n:]))
    assert torch.equal(causal_attention(q, k, v, torch.tensor([-3, 45, 45, 45])), torch.cat([torch.zeros_like(full[:1]), full[1:]]))


def test_causal_attention_nan_reaches_its_own_token_only() -> None:
    """A NaN in token 30's query makes token 30's output NaN (as SDPA's), and no other token's;
    an infinite key 40 makes NaN exactly the rows SDPA makes NaN (those whose score is +inf:
    inf - inf in the softmax; a -inf score only weighs nothing)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 45, 64, generator=g) for h in (4, 2, 2))
    q[0, 1, 30, 7] = float("nan")
    out = causal_attention(q, k, v)
    nan_rows = out.isnan().any(-1)[0]  # (heads, T)
    assert nan_rows[1, 30] and nan_rows.sum() == 1
    q[0, 1, 30, 7] = 0.0
    k[0, 0, 40, 3] = float("inf")
    nan_rows = causal_attention(q, k, v).isnan().any(-1)[0]
    sdpa_nan = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).isnan().any(-1)[0]
    assert torch.equal(nan_rows, sdpa_nan) and nan_rows[:2, 40:].any() and not nan_rows[:, :40].any()


def test_causal_attention_fake_has_the_ops_strides() -> None:
    """Inductor trusts the fake's layout (no stride asserts): the op returns a (B, H, T, D) view
    of (B, T, H, D) memory, and so must the fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = torch.randn(2, 20, 6, 32).transpose(1, 2), torch.randn(2, 3, 20, 32), torch.randn(2, 3, 20, 32)
    lengths = torch.tensor([20, 5])
    real = causal_attention(q, k, v, lengths)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = causal_attention(*(mode.from_tensor(t) for t in (q, k, v, lengths)))
    assert real.shape == fake.shape and real.stride() == fake.stride() and real.dtype == fake.dtype


def test_causal_attention_rejects_bad_inputs() -> None:
    q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="must be float32"):
        causal_attention(q.double(), kv.double(), kv.double())
    with pytest.raises(RuntimeError, match="4 query heads over 3 KV heads"):
        causal_attention(q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16))
    with pytest.raises(RuntimeError, match=r"k and v must be \(B, H_kv, T, D\)"):
        causal_attention(q, torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16))
    with pytest.raises(RuntimeError, match="must be 4-D"):
        causal_attention(q[0], kv, kv)
    with pytest.raises(RuntimeError, match=r"lengths must be int32 or int64 of shape \(1\)"):
        causal_attention(q, kv, kv, torch.tensor([8, 8]))
    with pytest.raises(RuntimeError, match="lengths must be int32 or int64"):
        causal_attention(q, kv, kv, torch.tensor([8.0]))


def test_causal_attention_op_choice_follows_the_isa() -> None:
    """fp32 plans (and 16-bit plans that widen) take the kernel where it has vector tiles (AVX-512
    or AVX2 with FMA), SDPA elsewhere (the scalar loops are slower); a bf16 input is computed in
    fp32 and cast back."""
    isa = causal_attention_isa()
    flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split())
    assert isa == ("avx512" if {"avx512f", "avx2", "fma"} <= flags else "avx2" if {"avx2", "fma"} <= flags else "scalar")
    op = cpu_kernel_ops("float32").causal_attention
    assert (op is kernel_causal_attention) == (isa != "scalar")
    q, k, v = (torch.randn(1, h, 20, 32).bfloat16() for h in (4, 2, 2))
    out = kernel_causal_attention(q, k, v)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, causal_attention(q.float(), k.float(), v.float()).bfloat16(), rtol=0, atol=0)


BLOCK_CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn]
BLOCK_POSITIONS = 37  # not a multiple of any block size below: every row's last block is partly used


def paged_case(cache_dtype: torch.dtype, block_size: int, tokens: int,
               seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (3, 6, tokens, 16), K and V caches (num_blocks, 2, block_size, W) of ``cache_dtype``
    (``kv_rows.store_rows``), a block table (3, N) int32 and a decode mask (3, 1, tokens, 37) of
    three rows' first 37 positions. Each row's blocks are drawn from a shuffled pool (not in
    order), rows 0 and 2 share their first block (a common prefix), and the table has two
    columns more than 37 positions need, pointing at a block of NaN. NaN also fills the
    positions past 37 in each row's last block and row 1's positions past its last token (which
    its mask hides): no reader may use any of them."""
    g = torch.Generator().manual_seed(seed)
    s, d = BLOCK_POSITIONS, 16
    count = -(-s // block_size)
    order = torch.randperm(3 * count + 3, generator=g)
    table = order[: 3 * count].reshape(3, count)
    table[2, 0] = table[0, 0]
    nan_block = order[-1]
    table = torch.cat([table, nan_block.expand(3, 2)], dim=1).to(torch.int32)
    empty = torch.empty(0, dtype=cache_dtype)
    k, v = (store_rows(torch.randn(len(order), 2, block_size, d, generator=g), empty) for _ in range(2))
    nan = store_rows(torch.full((d,), float("nan")), empty)
    last = torch.tensor([s - 1, s - 6, s - 3])
    for cache in (k, v):
        cache[nan_block] = nan
        cache[table[:, count - 1].long(), :, s - (count - 1) * block_size:] = nan
        for j in range(int(last[1]) + 1, s):
            cache[int(table[1, j // block_size]), :, j % block_size] = nan
    mask = decode_mask(last[:, None] - tokens + 1 + torch.arange(tokens), s)
    q = torch.randn(3, 6, tokens, d, generator=g)
    return q, k, v, table, mask


@pytest.mark.parametrize("cache_dtype", BLOCK_CACHE_DTYPES)
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("tokens", [1, 4])
def test_cached_attention_blocks_match_naive(cache_dtype: torch.dtype, block_size: int, tokens: int) -> None:
    """The paged layout: the kernel, the fused form and the reference read each row's window
    through its block table as the naive loop over positions does (fp32 math on the same stored
    values); the kernel's bits are those of the same rows laid out as one contiguous block per
    row (the slots layout), with an int64 table, and with the unused columns out of range."""
    s = BLOCK_POSITIONS
    q, k, v, table, mask = paged_case(cache_dtype, block_size, tokens, seed=block_size + tokens)
    ref = naive_attention(q, k, v, table, s, mask)
    assert torch.isfinite(ref).all()
    outs = {fn.__name__: fn(q, k, v, table, s, mask) for fn in (kernel_cached_attention, fused_cached_attention, gathered_attention)}
    for name, out in outs.items():
        assert out.shape == q.shape and out.dtype == q.dtype, name
        atol = INT16_QUERY_ATOL if name == "kernel_cached_attention" and cache_dtype == torch.int8 else 1e-5
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
    kernel = outs["kernel_cached_attention"]
    torch.testing.assert_close(kernel.double(), kernel_reference(q, k, v, table, s, mask), rtol=0, atol=reference_atol(cache_dtype))
    slots = torch.arange(3, dtype=torch.int32)[:, None]
    assert torch.equal(kernel_cached_attention(q, naive_rows(k, table, s), naive_rows(v, table, s), slots, s, mask), kernel)
    assert torch.equal(kernel_cached_attention(q, k, v, table.long(), s, mask), kernel)
    unused = table.clone()
    unused[:, -(-s // block_size):] = -1  # never read: only the first ceil(S / block_size) columns are checked
    assert torch.equal(kernel_cached_attention(q, k, v, unused, s, mask), kernel)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize(("block_size", "tokens"), [(4, 2), (16, 1)])
def test_cached_attention_blocks_per_row_tasks_match_per_head_tasks(cache_dtype: torch.dtype, block_size: int, tokens: int) -> None:
    """Over several blocks the kernel takes one task per batch row, walking each block's KV heads
    in turn, where the rows split evenly over the threads (3 rows, 1 thread here) or are at least
    4 per thread, and one task per (row, KV head) otherwise (3 rows, 4 threads): the same products
    in the same order, so the same bits, and the bits of the slots layout (T = 2: a wrong query or
    output offset per KV head would mix the tokens' rows)."""
    s = BLOCK_POSITIONS
    q, k, v, table, mask = paged_case(cache_dtype, block_size, tokens, seed=21 + block_size)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        per_row = kernel_cached_attention(q, k, v, table, s, mask)
        torch.set_num_threads(4)
        per_head = kernel_cached_attention(q, k, v, table, s, mask)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(per_row, per_head)
    slots = torch.arange(3, dtype=torch.int32)[:, None]
    assert torch.equal(kernel_cached_attention(q, naive_rows(k, table, s), naive_rows(v, table, s), slots, s, mask), per_row)
    torch.testing.assert_close(per_row.double(), kernel_reference(q, k, v, table, s, mask), rtol=0, atol=reference_atol(cache_dtype))


@pytest.mark.parametrize("block_size", [12, 16, 20])
def test_cached_attention_int8_value_spans_over_blocks(block_size: int) -> None:
    """Over an int8 cache the kernel rounds the value weights per span of 256 positions: 600
    positions (three spans, the last partial) through shuffled blocks of 12, 16 and 20 (12 and 20
    do not divide a span: a block holds positions of two) give the bits of the slots layout and
    the rounded reference; head dim 64 (the 32-lane path), 2 rows x 2 KV heads x 3 query heads."""
    g = torch.Generator().manual_seed(block_size)
    s, d = 600, 64
    count = -(-s // block_size)
    table = torch.randperm(2 * count, generator=g).reshape(2, count).to(torch.int32)
    empty = torch.empty(0, dtype=torch.int8)
    k, v = (store_rows(torch.randn(2 * count, 2, block_size, d, generator=g), empty) for _ in range(2))
    mask = decode_mask(torch.tensor([[s - 1], [s - 40]]), s)
    q = torch.randn(2, 6, 1, d, generator=g) * 2  # a sharper softmax: weights far apart within a span
    out = kernel_cached_attention(q, k, v, table, s, mask)
    slots = torch.arange(2, dtype=torch.int32)[:, None]
    assert torch.equal(out, kernel_cached_attention(q, naive_rows(k, table, s), naive_rows(v, table, s), slots, s, mask))
    torch.testing.assert_close(out.double(), kernel_reference(q, k, v, table, s, mask), rtol=0, atol=INT16_WEIGHT_ATOL)


@pytest.mark.parametrize("head_dim", [32, 48, 20])
def test_cached_attention_int8_value_sums_at_their_bound(head_dim: int) -> None:
    """A span's int32 sums at their largest: 300 positions of equal weight (zero keys) and scale
    whose values are all -128 (int8's extreme, which quantize_rows never writes) round every weight
    to 32767 and sum 256 x 32767 x -128 in the first span's lanes, within int32: the output is
    -128 x the scale. Head dims 32, 48 and 20 take the 32-lane, 16-lane and scalar paths."""
    s, scale = 300, 0.01
    k = int8_rows(torch.zeros(1, 1, s, head_dim), scale)
    v = int8_rows(torch.full((1, 1, s, head_dim), -128.0), scale)
    q = torch.randn(1, 3, 1, head_dim, generator=torch.Generator().manual_seed(0))
    out = kernel_cached_attention(q, k, v, torch.tensor([[0]]), s, torch.ones(1, 1, 1, s, dtype=torch.bool))
    torch.testing.assert_close(out, torch.full_like(out, -128 * scale), rtol=1e-6, atol=0)


@pytest.mark.parametrize(("cache_dtype", "block_size", "tokens"), [(torch.bfloat16, 4, 4), (torch.int8, 16, 1)])
def test_compiled_fused_cached_attention_reads_blocks(cache_dtype: torch.dtype, block_size: int, tokens: int) -> None:
    """Inductor's fusion of the block-table gather against the naive loop. Each graph costs
    2.5-3.5 s of cold compile here, so two: a widened float cache (float32 and fp8 differ only
    in the cast) and the int8 rows with their scale bytes; the eager form runs every dtype."""
    q, k, v, table, mask = paged_case(cache_dtype, block_size, tokens, seed=7)

    def fused(*args: object) -> torch.Tensor:  # a code object of its own: dynamo's recompile limit (8) counts per code object
        return fused_cached_attention(*args)

    out = torch.compile(fused, fullgraph=True, dynamic=False)(q, k, v, table, BLOCK_POSITIONS, mask)
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, table, BLOCK_POSITIONS, mask), rtol=0, atol=1e-5)


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("heads,kv_heads,tokens,head_dim", [(9, 3, 1, 64), (8, 2, 1, 64), (8, 2, 5, 16), (6, 3, 2, 32),
                                                           (6, 2, 1, 24)])
def test_cached_attention_query_heads_sharing_a_kv_head_equal_each_head_alone(cache: str, heads: int, kv_heads: int,
                                                                               tokens: int, head_dim: int) -> None:
    """The query heads of a KV head go through its keys and values together (each chunk widened
    once for up to 3 or 4 of them); every head's output must be the one it gets alone (one query
    head over one KV head), bit for bit, whatever the group size, tokens or cache dtype."""
    g = torch.Generator().manual_seed(heads * 100 + tokens)
    B, S = 2, 45  # a key past the last group of four
    k, v = (torch.randn(B, kv_heads, S, head_dim, generator=g) for _ in range(2))
    k, v = (store_rows(x, torch.empty(0, dtype=getattr(torch, cache))) for x in (k, v))
    q = torch.randn(B, heads, tokens, head_dim, generator=g)
    mask = torch.rand(B, 1, tokens, S, generator=g) < 0.9
    table = torch.arange(B, dtype=torch.int32)[:, None]
    together = kernel_cached_attention(q, k, v, table, S, mask)
    group = heads // kv_heads
    for h in range(heads):
        kh, vh = (x[:, h // group : h // group + 1].contiguous() for x in (k, v))
        alone = kernel_cached_attention(q[:, h : h + 1].contiguous(), kh, vh, table, S, mask)
        assert torch.equal(together[:, h : h + 1], alone), f"head {h}"


def test_cached_attention_kernel_rejects_bad_block_tables() -> None:
    q, mask = torch.randn(2, 4, 1, 16), torch.ones(2, 1, 1, 10, dtype=torch.bool)
    cache = torch.randn(5, 2, 4, 16)  # 5 blocks of 4 positions
    good = torch.tensor([[0, 1, 2], [3, 4, 0]], dtype=torch.int32)
    torch.testing.assert_close(kernel_cached_attention(q, cache, cache, good, 10, mask).double(),
                               naive_attention(q, cache, cache, good, 10, mask), rtol=0, atol=1e-5)
    for b, c, entry in [(1, 2, 5), (0, 1, -1)]:
        bad = good.clone()
        bad[b, c] = entry
        with pytest.raises(RuntimeError, match=rf"block_table\[{b}, {c}\] = {entry} is out of \[0, 5\)"):
            kernel_cached_attention(q, cache, cache, bad, 10, mask)
    with pytest.raises(RuntimeError, match=r"mask covers 10 positions, block table holds 8 \(2 blocks of 4\)"):
        kernel_cached_attention(q, cache, cache, good[:, :2], 10, mask)
    six = torch.randn(5, 2, 6, 16)
    with pytest.raises(RuntimeError, match=r"block_size 6 must be a multiple of 4 .*\(N = 2\)"):
        kernel_cached_attention(q, six, six, good[:, :2], 10, mask)
    mask6 = torch.ones(2, 1, 1, 6, dtype=torch.bool)  # one block per row (N = 1): any block size
    torch.testing.assert_close(kernel_cached_attention(q, six, six, good[:, :1], 6, mask6).double(),
                               naive_attention(q, six, six, good[:, :1], 6, mask6), rtol=0, atol=1e-5)
    for table in (torch.tensor([0, 3]), good[:1]):
        with pytest.raises(RuntimeError, match=r"block_table must be 2-D \(B, N\) with B = 2"):
            kernel_cached_attention(q, cache, cache, table, 10, mask)
    with pytest.raises(RuntimeError, match="block_table must be int32 or int64, got Float"):
        kernel_cached_attention(q, cache, cache, good.float(), 10, mask)


@pytest.mark.parametrize(("rows", "vocab", "k"), [(8, 49152, 256), (1, 49152, 20), (3, 300, 300), (2, 17, 1), (5, 1000, 37)])
def test_topk_rows_matches_torch_topk(rows: int, vocab: int, k: int) -> None:
    """Random logits (no ties): values and indices of torch.topk, sorted descending; 16-lane
    scans with tails (17, 1000), k = V, k = 1."""
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab + k))
    values, indices = topk_rows(x, k)
    want = torch.topk(x, k, dim=-1)
    assert torch.equal(values, want.values) and torch.equal(indices, want.indices) and indices.dtype == torch.int64


def argmax_cases() -> torch.Tensor:
    """Rows of 1,003 logits (62 16-lane chunks and a tail of 11 on AVX-512; 125 8-lane chunks and
    a tail of 3 on AVX2) for :func:`argmax_rows`: random; ties of the largest value in several
    lanes and chunks; the largest in the AVX-512 tail; a NaN (two, the later first in its lane);
    +inf; -inf elsewhere; all -inf; +0.0 after -0.0 as the largest; integers 0-3 (ties
    everywhere); a NaN first in the last tail value; +inf only in the AVX-512 tail. Also run on
    the AVX2 and scalar builds by scripts/check_quant_paths.py."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(12, 1003, generator=g)
    x[1, [700, 37, 38, 515]] = 9.0
    x[2, 997] = 9.0
    x[3, [600, 40]] = float("nan")
    x[4, 300] = float("inf")
    x[5, 11] = float("-inf")
    x[6] = float("-inf")
    x[7] = -1.0
    x[7, 21], x[7, 500] = -0.0, 0.0
    x[8] = torch.randint(0, 4, (1003,), generator=g).float()
    x[9, 0] = float("nan")
    x[10, 1002] = float("nan")
    x[11, 995] = float("inf")
    return x


@pytest.mark.parametrize("vocab", [1003, 40, 31, 1, 49152])
def test_argmax_rows_is_torch_argmax_and_isfinite(vocab: int) -> None:
    """Each row's first index of its largest value (NaN above every number) and whether it is all
    finite: torch.argmax and torch.isfinite(...).all() exactly, over :func:`argmax_cases` cut
    to ``vocab`` (40: one AVX-512 chunk and a tail; 31: no AVX-512 vector pass; V = 1) and random
    rows of SmolLM2's vocabulary."""
    x = argmax_cases()[:, :vocab].contiguous() if vocab <= 1003 else torch.randn(5, vocab, generator=torch.Generator().manual_seed(1))
    arg, finite = argmax_rows(x)
    assert arg.dtype == torch.int32 and finite.dtype == torch.bool
    assert arg.tolist() == x.argmax(-1).tolist() and finite.tolist() == torch.isfinite(x).all(-1).tolist()
    if vocab == 1003:
        assert arg.tolist()[1:4] == [37, 997, 40] and arg.tolist()[10:] == [1002, 995] and finite.tolist()[3:7] == [False] * 4
        assert finite.tolist()[10:] == [False, False]
    arg, finite = CPU_OPS.argmax(x.view(1, *x.shape))  # the ops record's form: leading dims kept
    assert arg.shape == finite.shape == (1, x.shape[0]) and torch.equal(arg[0], x.argmax(-1).int())
    with pytest.raises(RuntimeError, match="argmax_rows: x must be"):
        argmax_rows(x.double())


def test_topk_rows_orders_ties_by_index_and_nan_first() -> None:
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, 3.0, 3.0, nan, -inf, 3.0, 2.0, inf] + [0.5] * 40 + [3.0]])
    values, indices = topk_rows(x, 6)
    assert indices.tolist() == [[3, 7, 1, 2, 5, 48]]
    assert torch.equal(values[0, 1:], torch.tensor([inf, 3.0, 3.0, 3.0, 3.0])) and values[0, 0].isnan()
    with pytest.raises(RuntimeError, match=r"k = 50 must be in \[1, 49\]"):
        topk_rows(x, 50)


def _naive_topk(row: list[float], k: int) -> tuple[list[float], list[int]]:
    """The k first of ``row``'s (value, index) pairs in topk_rows' order: NaN first, then larger
    values, equal ones by lower index."""
    order = sorted(range(len(row)), key=lambda i: (not math.isnan(row[i]), -row[i] if not math.isnan(row[i]) else 0.0, i))
    return [row[i] for i in order[:k]], order[:k]


# a tail past the last chunk of 64 and of 16 lanes; whole chunks; k = the full chunks (the bound
# their smallest maximum, the tail's chunk one more)
@pytest.mark.parametrize("vocab", [49152 + 37, 64 * 300, 64 * 256 + 37])
def test_topk_rows_bound_by_chunk_maxima_keeps_torch_order(vocab: int) -> None:
    """k = 256 takes the chunk maxima's bound (csrc/topk.cpp): rows of heavy ties (a few values
    only, so the bound falls on a tie), NaNs and infinities in chunks and tails, an all-NaN row
    and an all -inf row give the naive order's values and indices."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[1] = torch.randint(0, 4, (vocab,), generator=g).float()  # ties everywhere, the bound among them
    x[2, torch.randint(0, vocab, (40,), generator=g)] = float("nan")
    x[2, vocab - 1], x[2, vocab - 5] = float("nan"), float("inf")
    x[3] = float("nan")
    x[4] = float("-inf")
    x[5, : vocab // 2] = float("-inf")  # the bitmask or min_tokens bias: half the vocabulary masked
    values, indices = topk_rows(x, 256)
    for r in range(6):
        want_values, want_ids = _naive_topk(x[r].tolist(), 256)
        assert indices[r].tolist() == want_ids, r
        want = torch.tensor(want_values)
        assert torch.equal(values[r].isnan(), want.isnan()) and torch.equal(values[r].nan_to_num(), want.nan_to_num()), r


@pytest.mark.parametrize("weights", ["float", "int4"])
def test_compiled_decode_layer_uses_fused_kernels(weights: str) -> None:
    from transformers import LlamaConfig

    from neuronfx.config.model import ModelConfig
    from neuronfx.graphs.models import quant as Q
    from neuronfx.graphs.models.layers import rope_cos_sin, rope_inv_freq
    from neuronfx.graphs.models.llama import decoder_layer

    hf = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, vocab_size=50)
    cfg = ModelConfig.from_hf(hf)
    gen = torch.Generator().manual_seed(0)
    shapes = {"attn_norm": (64,), "mlp_norm": (64,), "wq": (64, 64), "wk": (32, 64), "wv": (32, 64), "wo": (64, 64),
              "gate": (96, 64), "up": (96, 64), "down": (64, 96)}
    lw = {k: torch.randn(s, generator=gen) / 8 for k, s in shapes.items()}
    if weights == "int4":  # every product quantized (K = 64 and 96: whole groups of 32)
        lw = {k: Q.quantize_int4(w, 32) if w.dim() == 2 else w for k, w in lw.items()}
    h = torch.randn(2, 1, 64, generator=gen)
    cos, sin = rope_cos_sin(torch.tensor([[3], [5]]), rope_inv_freq(cfg), torch.float32)

    def layer(lw: dict, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ops=CPU_OPS) -> torch.Tensor:
        return decoder_layer(cfg, ops, lw, h, cos, sin, lambda q, k, v: q)  # attention stubbed: kernels only

    fn = torch.compile(layer, fullgraph=True, dynamic=False)
    torch.testing.assert_close(fn(lw, h, cos, sin), layer(lw, h, cos, sin, REFERENCE_OPS), rtol=1e-5, atol=1e-5)
    ops = _ops_run(fn, lw, h, cos, sin)
    fused = {"float": {"neuronfx::small_gemm_multi", "neuronfx::small_glu"}, "int4": {"neuronfx::quant_gemm_multi", "neuronfx::quant_glu"}}
    assert fused[weights] <= ops, sorted(ops)


def test_build_lock_clears_a_killed_builds_baton(tmp_path, monkeypatch):
    """A process killed mid-build leaves torch's ``lock`` file (a FileBaton, no owner): under
    neuronfx's OS lock it is removed, so the next build does not wait on it forever."""
    from torch.utils.cpp_extension import _get_build_directory

    from neuronfx.graphs.kernels.library import build_lock

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    baton = Path(_get_build_directory("neuronfx_kernels_test", verbose=False)) / "lock"
    baton.touch()
    with build_lock("neuronfx_kernels_test"):
        assert not baton.exists()
        assert (baton.parent / "neuronfx.lock").exists()


def test_library_name_differs_per_torch_install(monkeypatch):
    """Two virtualenvs with the same torch version share ~/.cache/torch_extensions; torch's
    build.ninja names each install's include paths, so one library name for both rebuilt it
    whenever the other had run. The name carries the install directory: one build per install."""
    from neuronfx.graphs.kernels.library import library_name

    here = library_name()
    assert library_name() == here  # stable in one install
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/lib/python3.11/site-packages/torch/__init__.py")
    other = library_name()
    assert other != here and other.startswith("neuronfx_kernels_") and len(other) == len(here)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_attention_matches_the_prefill_mask_on_real_tokens(dtype: torch.dtype) -> None:
    """``causal_attention`` with the prompts' lengths (SDPA's causal flag, or the kernel, which
    skips the pads) gives every real token of right-padded prompts what ``attention`` with
    ``prefill_mask`` gives it (pad rows may differ: nothing reads them), in the reference bundle
    and the CPU kernel bundle of each dtype, v a view of a (B, T, heads, D) tensor as prefill's."""
    from neuronfx.config.masks import prefill_mask
    from neuronfx.graphs.kernels.bundles import REFERENCE_OPS

    g = torch.Generator().manual_seed(4)
    lens = torch.tensor([37, 64, 1])
    q, k, v = (torch.randn(3, 64, h, 16, generator=g).to(dtype).transpose(1, 2) for h in (6, 2, 2))
    mask = prefill_mask(lens, 64)
    for ops in (REFERENCE_OPS, cpu_kernel_ops(str(dtype).removeprefix("torch."))):
        got, want = ops.causal_attention(q, k, v, lens), ops.attention(q, k, v, mask)
        for row, n in enumerate(lens.tolist()):
            tol = 1e-6 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got[row, :, :n].float(), want[row, :, :n].float(), rtol=tol, atol=tol)
        assert not torch.equal(got[0, :, 37:], want[0, :, 37:])  # pad rows really differ: the flag is not the mask


def test_build_units_include_every_source_once() -> None:
    """The compiler is given the two build units (``library.BUILD_UNITS``); together they must
    include each of ``library.SOURCES`` exactly once (a source left out would leave its ops
    unregistered; one included twice would not compile), and the library's name hashes both."""
    import re

    from neuronfx.graphs.kernels import library

    included = [m for unit in library.BUILD_UNITS for m in re.findall(r'^#include "([^"]+)"', unit.read_text(), re.M)]
    assert sorted(included) == sorted(p.name for p in library.SOURCES)


def test_c_shim_declarations_equal_their_cpp_definitions() -> None:
    """Each decode op's C shim declaration, made from its schema (Tensor a handle, Tensor? a
    pointer to one, int int64_t, bool int32_t, then ``ret0``), is the signature the C++ sources
    define (inductor's wrapper calls through the declaration: a mismatch would pass wrong
    arguments), and its symbol is visible process-wide (the library reopened ``RTLD_GLOBAL``),
    as a compiled part needs."""
    import ctypes
    import re

    from neuronfx.graphs.kernels.c_shims import C_SHIM_OPS, c_shims
    from neuronfx.graphs.kernels.library import SOURCES

    defined = {name: " ".join(args.split()) for path in SOURCES
               for name, args in re.findall(r"NFX_SHIM\((\w+),([^)]*)\)", path.read_text())}
    shims = c_shims()
    assert sorted(defined) == sorted(op.name().split("::")[1] for op in shims) == sorted(C_SHIM_OPS)
    process = ctypes.CDLL(None)
    for op, (declaration,) in shims.items():
        name = op.name().split("::")[1]
        assert declaration == f"AOTITorchError aoti_torch_cpu_{name}({defined[name]})", name
        assert getattr(process, f"aoti_torch_cpu_{name}") is not None


def test_compiled_calls_through_c_shims_equal_the_ops() -> None:
    """inductor's C++ wrapper with the shims calls every shimmed kernel directly (no
    dispatcher call in the generated code) and gets the ops' own outputs: optional tensors given
    and None, bools true and false, two and three fused weights, the int8 format's scale, the
    packed int8 and 4-bit layouts, a block table and mask."""
    from torch._inductor.utils import run_and_get_cpp_code

    from neuronfx.graphs.backends.inductor_parts import INDUCTOR_OPTIONS
    from neuronfx.graphs.kernels.c_shims import C_SHIM_OPS, c_shims
    from neuronfx.graphs.models.quant import pack_int4, pack_int8, quantize_int4, quantize_int8

    g = torch.Generator().manual_seed(0)
    wq, wk = quantize_int8(torch.randn(48, 64, generator=g)), quantize_int8(torch.randn(16, 64, generator=g))
    pq, pk = pack_int8(wq), pack_int8(wk)
    f4, u4 = (pack_int4(quantize_int4(torch.randn(32, 64, generator=g), 32)) for _ in range(2))
    w0, w1, bias = torch.randn(32, 64, generator=g), torch.randn(16, 64, generator=g), torch.randn(48, generator=g)
    x = torch.randn(1, 2, 64, generator=g)
    q, cache = torch.randn(1, 4, 2, 16, generator=g), torch.randn(3, 2, 8, 16, generator=g)
    table, mask = torch.tensor([[1]], dtype=torch.int32), torch.rand(1, 1, 2, 8, generator=g) > 0.3
    nfx = torch.ops.neuronfx

    def calls(x):
        return (nfx.quant_gemm(x, wq.data, wq.scale, None, 0, bias, False),
                nfx.quant_gemm_multi(x, 0, True, wq.data, wq.scale, None, None, wk.data, wk.scale, None, None,
                                     None, None, None, None),
                nfx.quant_glu(x, wk.data, wk.scale, None, wk.data, wk.scale, None, 0, True),
                nfx.small_gemm(x, w0, None),
                nfx.small_gemm_multi(x, w0, w1, None, None, None, None),
                nfx.small_glu(x, w0, w0),
                nfx.cached_attention(q, cache, cache, table, mask),
                nfx.w8a8_gemm(x, wq.data, wq.scale, bias),
                nfx.w8a8_packed(x, pq.data, pq.scale, None),
                nfx.w8a8_packed_multi(x, pq.data, pq.scale, bias, pk.data, pk.scale, None, None, None, None),
                nfx.w8a8_packed_glu(x, pk.data, pk.scale, pk.data, pk.scale),
                nfx.w4a8_packed(x, f4.data, None),
                nfx.w4a8_packed_multi(x, f4.data, None, u4.data, None, None, None),
                nfx.w4a8_packed_glu(x, f4.data, u4.data))

    compiled = torch.compile(calls, fullgraph=True, options=INDUCTOR_OPTIONS | {"cpp_wrapper": True,
                             "aot_inductor.custom_ops_to_c_shims": c_shims()})
    with torch.no_grad():
        got, code = run_and_get_cpp_code(compiled, x)
        want = calls(x)
    assert "aoti_torch_call_dispatcher(" not in code and "custom_op_wrapper" not in code
    for name in C_SHIM_OPS:
        assert f"AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_{name}(" in code, name
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), (i, (a - b).abs().max())
