"""Quantized weight formats (graphs/quant.py) and the quantized product kernel
(``kernels.quant_gemm``, csrc/quant_gemm.cpp): quantizers against their error bound, the torch
dequantization against the ``gguf`` package (an independent implementation of ggml's blocks),
and the kernel against float64 products of the dequantized weights at odd sizes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from neuronfx.graphs.kernels.library import (
    quant_gemm,
    quant_gemm_multi,
    quant_glu,
    quant_int8_x_isa,
    quant_isa,
    quant_prefill,
    small_gemm_available,
    w8a8_gemm,
    w8a8_packed,
    w8a8_packed_glu,
    w8a8_packed_multi,
)
from neuronfx.graphs.models import int8_x
from neuronfx.graphs.models import quant as Q

GGUF_TYPES = {Q.Q4_0Blocks: GGMLQuantizationType.Q4_0, Q.Q4_1Blocks: GGMLQuantizationType.Q4_1, Q.Q8_0Blocks: GGMLQuantizationType.Q8_0}
U32 = 2.0**-24
"""fp32 unit roundoff."""


def gguf_blocks(w: torch.Tensor, cls: type) -> Q.QuantizedWeight:
    """w (N, K) float -> GGUF blocks made by the gguf package (ggml's reference quantizers)."""
    return cls(torch.from_numpy(quants.quantize(w.numpy(), GGUF_TYPES[cls])))


def test_quantize_int8_error_bound_and_zero_row() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 75, generator=g) * torch.tensor([1, 10, 0.01, 0, 3, 1])[:, None]  # row 3 is all zero
    q = Q.quantize_int8(w)
    assert q.data.dtype == torch.int8 and q.data.shape == (6, 75) and q.scale.dtype == torch.float32 and q.scale.shape == (6,)
    assert q.scale[3] == 0 and not q.data[3].any()
    torch.testing.assert_close(q.scale, w.abs().amax(1) / 127)
    err = (w - Q.dequantize(q, 75)).abs()
    # round-to-nearest: |w/s - q| <= 1/2; the division and the product each round once in fp32.
    assert (err <= q.scale[:, None] / 2 + 4 * U32 * w.abs()).all()
    assert (q.data.abs() == 127).sum(1)[[0, 1, 2, 4, 5]].min() >= 1  # the absmax hits the grid end


@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantize_int4_error_bound_padding_and_constant_groups(group: int) -> None:
    g = torch.Generator().manual_seed(group)
    k = 200  # not a multiple of any group: the last group is zero-padded
    w = torch.randn(5, k, generator=g)
    w[1, :group] = 0.375  # a constant group: scale 0, exact
    q = Q.quantize_int4(w, group)
    groups = -(-k // group)
    assert q.data.shape == (5, groups * group // 2) and q.data.dtype == torch.uint8
    assert q.scale.shape == q.offset.shape == (5, groups) and q.scale.dtype == q.offset.dtype == torch.float32
    assert q.scale[1, 0] == 0 and q.offset[1, 0] == 0.375
    deq = Q.dequantize(q, k)
    assert deq.shape == (5, k) and deq[1, :group].eq(0.375).all()
    scale = q.scale.repeat_interleave(group, 1)[:, :k]
    assert ((w - deq).abs() <= scale / 2 + 4 * U32 * w.abs().clamp(min=1)).all()
    # the padding holds zeros (q for 0 in the last group)
    full = Q.dequantize(q, groups * group)
    assert full[:, k:].abs().max() <= q.scale[:, -1:].max() / 2 + 1e-6


def test_int4_nibble_order_is_gguf_q4_1() -> None:
    """An int4 weight of group 32 with fp16-exact scales, rewritten byte for byte as Q4_1 blocks
    (fp16 d, fp16 m, the same 16 bytes), dequantizes identically through the gguf package: the
    nibble order within a group is ggml's."""
    g = torch.Generator().manual_seed(1)
    q = Q.quantize_int4(torch.randn(3, 64, generator=g), 32)
    d, m = q.scale.half(), q.offset.half()
    blocks = torch.cat([d[..., None].view(torch.uint8), m[..., None].view(torch.uint8), q.data.view(3, 2, 16)], dim=-1)
    ref = quants.dequantize(blocks.reshape(3, 40).numpy(), GGMLQuantizationType.Q4_1)
    ours = Q.dequantize(Q.Int4Weight(q.data, d.float(), m.float()), 64)
    np.testing.assert_array_equal(ours.numpy(), ref)


@pytest.mark.parametrize("cls", list(GGUF_TYPES))
def test_gguf_dequantize_matches_gguf_package(cls: type) -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(7, 96, generator=g) * 3
    q = gguf_blocks(w, cls)
    assert q.data.shape == (7, 3 * Q.GGUF_BLOCK_BYTES[Q.FORMAT_NAMES[cls]]) and q.data.dtype == torch.uint8
    ref = quants.dequantize(q.data.numpy(), GGUF_TYPES[cls])
    np.testing.assert_array_equal(Q.dequantize(q, 96).numpy(), ref)  # the same fp32 operations: exact


def all_formats(w: torch.Tensor) -> list[Q.QuantizedWeight]:
    out = [Q.quantize_int8(w), Q.quantize_int4(w, 32)]
    return out + [gguf_blocks(w, cls) for cls in GGUF_TYPES] if w.shape[1] % 32 == 0 else out


def test_gather_rows_and_weight_bytes() -> None:
    w = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([[4, 0, 8], [4, 4, 1]])
    for q in all_formats(w):
        rows = Q.gather_rows(q, ids)
        assert type(rows) is type(q) and rows.data.shape[:2] == (2, 3)
        assert torch.equal(Q.dequantize(rows, 64), Q.dequantize(q, 64)[ids])
    assert Q.weight_bytes(Q.quantize_int4(w, 32)) == 9 * 32 + 2 * 9 * 2 * 4  # nibbles + fp32 scale and offset
    assert Q.weight_bytes(Q.quantize_int8(w)) == 9 * 64 + 9 * 4
    assert Q.weight_bytes(gguf_blocks(w, Q.Q4_1Blocks)) == 9 * 2 * 20


def test_reference_linear() -> None:
    g = torch.Generator().manual_seed(4)
    w, x, b = torch.randn(5, 64, generator=g), torch.randn(2, 3, 64, generator=g).bfloat16(), torch.randn(5, generator=g)
    q = Q.quantize_int4(w, 32)
    out = Q.reference_linear(x, q, b)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 5)
    torch.testing.assert_close(out, torch.nn.functional.linear(x.float(), Q.dequantize(q, 64), b).bfloat16(), rtol=0, atol=0)


# ---- the kernel ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernel() -> None:
    if not small_gemm_available():
        pytest.fail("the neuronfx kernels did not build on this machine (see the warning above)")


def _isa_from_cpu() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((line.split() for line in text.splitlines() if line.startswith("flags")), [])
    if {"avx512f", "f16c"} <= set(flags):
        return "avx512"
    return "avx2" if {"avx2", "fma", "f16c"} <= set(flags) else "scalar"


def test_quant_isa_matches_this_cpu(kernel: None) -> None:
    assert quant_isa() == _isa_from_cpu()


def _offsets(q: Q.QuantizedWeight, k: int) -> torch.Tensor:
    """Each weight's group offset o (int4 / Q4_1: the offset, Q4_0: -8 d, int8 / Q8_0: 0): the
    weights of the same format with every quantized value set to 0."""
    if isinstance(q, Q.Int8Weight):
        return torch.zeros(q.data.shape)
    if isinstance(q, Q.Int4Weight):
        return Q.dequantize(Q.Int4Weight(torch.zeros_like(q.data), q.scale, q.offset), k)
    fmt = Q.FORMAT_NAMES[type(q)]
    blocks = q.data.view(q.data.shape[0], -1, Q.GGUF_BLOCK_BYTES[fmt]).clone()
    blocks[..., 4 if fmt == "q4_1" else 2:] = 0
    return Q.dequantize(type(q)(blocks.view(q.data.shape)), k)


def _tolerance(x: torch.Tensor, q: Q.QuantizedWeight, w: torch.Tensor, ref: torch.Tensor, k: int) -> torch.Tensor:
    """What fp32 accumulation in another order may change. An output sums k products; each
    rounding is within u = 2**-24 of a partial sum, and rounding errors of a sum in any order
    add up like a random walk, so 4 * sqrt(k) * u * sum_k |products| is a generous bound (the
    deterministic worst case is k * u; measured errors stay below 1/10 of this one). The
    products are |x_k| (|w_k - o_k| + |o_k|): two of the kernel's paths split each group's sum
    into d * sum x q + o * sum x, whose terms are these. A bf16 output adds one rounding to 8
    significant bits: exactly at most 2**-8 relative, which the largest errors nearly reach.
    Measured: fp32 errors at most 1/14 of the tolerance on all three SIMD paths; weights off by
    a bf16 rounding (a scale read wrong) exceed it 15-150x (fp32 x) and 3-26x (bf16 x)."""
    o = _offsets(q, k)
    mag = x.double().abs() @ ((w - o).abs() + o.abs()).double().T
    rounding = 2.0**-8 if x.dtype == torch.bfloat16 else U32
    return 4 * k**0.5 * U32 * mag + rounding * ref.abs()


FORMATS = {
    "int8": lambda w: Q.quantize_int8(w),
    "int8-bf16-scale": lambda w: Q.Int8Weight(Q.quantize_int8(w).data, Q.quantize_int8(w).scale.bfloat16()),
    "int4-g32": lambda w: Q.quantize_int4(w, 32),
    "int4-g64": lambda w: Q.quantize_int4(w, 64),
    "int4-g128": lambda w: Q.quantize_int4(w, 128),
    "int4-g96-bf16": lambda w: Q.Int4Weight(*(t if t.dtype == torch.uint8 else t.bfloat16() for t in Q.quantize_int4(w, 96))),
    "q4_0": lambda w: gguf_blocks(w, Q.Q4_0Blocks),
    "q4_1": lambda w: gguf_blocks(w, Q.Q4_1Blocks),
    "q8_0": lambda w: gguf_blocks(w, Q.Q8_0Blocks),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_quant_gemm_matches_float64(kernel: None, fmt: str, xdtype: torch.dtype) -> None:
    # N = 67 leaves tails after the 8-, 4- and 2-row tiles; K = 197 / 200 are not multiples of the
    # 16-lane loop (int8) or of any group (int4, padded); GGUF rows are whole blocks (K = 224).
    # Rows 1-8 cover every x-row chunking, 11 (as (1, 11, K)) chunks of 8 plus a tail.
    k = {"int8": 197, "int8-bf16-scale": 197, "q4_0": 224, "q4_1": 224, "q8_0": 224}.get(fmt, 200)
    g = torch.Generator().manual_seed(k)
    w = torch.randn(67, k, generator=g)
    q = FORMATS[fmt](w)
    wq = Q.dequantize(q, k)
    bias = torch.randn(67, generator=g)
    for rows in [1, 2, 3, 4, 5, 6, 7, 8, 11]:
        x = torch.randn(1, rows, k, generator=g).to(xdtype)
        for b in (None, bias):
            out = quant_gemm(x, q, b)
            assert out.shape == (1, rows, 67) and out.dtype == xdtype
            ref = x[0].double() @ wq.double().T + (0 if b is None else b.double())
            err = (out[0].double() - ref).abs()
            assert (err <= _tolerance(x[0], q, wq, ref, k)).all(), (rows, b is None, err.max().item())


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("int8_x", [False, True])
def test_quant_gemm_rows_equal_each_row_alone(kernel: None, fmt: str, int8_x: bool) -> None:
    """Batch invariance: every row of an M-row product (M = 1..8 and 11: each chunking of x rows;
    N = 67 for the column tails) has the bits of that row multiplied alone, so a verify row of a
    speculate step reduces as the decode row it stands for."""
    k = {"int8": 197, "int8-bf16-scale": 197, "q4_0": 224, "q4_1": 224, "q8_0": 224}.get(fmt, 256)
    g = torch.Generator().manual_seed(k + 1)
    q = FORMATS[fmt](torch.randn(67, k, generator=g))
    int8_x = int8_x and Q.int8_x_group_size(q) is not None  # formats without the int8-x path ignore it
    x = torch.randn(11, k, generator=g)
    alone = torch.cat([quant_gemm(x[i : i + 1], q, None, int8_x) for i in range(11)])
    for rows in [1, 2, 3, 4, 5, 6, 7, 8, 11]:
        assert torch.equal(quant_gemm(x[:rows], q, None, int8_x), alone[:rows]), rows


@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "int4-g96-bf16", "q4_1", "q8_0"])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_quant_gemm_multi_and_glu_match_float64(kernel: None, fmt: str, xdtype: torch.dtype) -> None:
    # Three weights of 67, 19 and 40 rows share x (one call splits its rows across them); gate
    # and up of 67 rows make the GLU, checked against silu(x @ gate.T) * (x @ up.T) in float64
    # with the products' tolerance carried through (silu and the product are 1-Lipschitz-ish
    # near the values here: the bound is scaled by |up| + |silu(gate)| + 1).
    k = {"int8": 197}.get(fmt, 224)
    g = torch.Generator().manual_seed(11)
    ws = [torch.randn(n, k, generator=g) for n in (67, 19, 40)]
    qs = [FORMATS[fmt](w) for w in ws]
    wqs = [Q.dequantize(q, k) for q in qs]
    biases = [torch.randn(67, generator=g), None, torch.randn(40, generator=g)]
    for rows in [1, 3, 8]:
        x = torch.randn(rows, k, generator=g).to(xdtype)
        outs = quant_gemm_multi(x, qs, biases)
        for out, q, wq, b in zip(outs, qs, wqs, biases, strict=True):
            assert out.dtype == xdtype and out.shape == (rows, wq.shape[0])
            ref = x.double() @ wq.double().T + (0 if b is None else b.double())
            assert ((out.double() - ref).abs() <= _tolerance(x, q, wq, ref, k)).all()
        gate, up = qs[0], FORMATS[fmt](torch.randn(67, k, generator=g))
        wg, wu = wqs[0], Q.dequantize(up, k)
        a, u = x.double() @ wg.double().T, x.double() @ wu.double().T
        ref = torch.nn.functional.silu(a) * u
        tol_a, tol_u = _tolerance(x, gate, wg, a, k), _tolerance(x, up, wu, u, k)
        tol = tol_a * (u.abs() + 1) + tol_u * (torch.nn.functional.silu(a).abs() + 1)
        if xdtype == torch.bfloat16:
            tol = tol + 2.0**-8 * ref.abs()
        out = quant_glu(x, gate, up)
        assert out.dtype == xdtype and ((out.double() - ref).abs() <= tol).all()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quant_prefill_matches_float64(kernel: None, fmt: str) -> None:
    """The tiled prefill product: K = 4128 (4127 for int8) makes a tile 48 weight rows, so 67
    rows are two tiles, the second partial; x has 9 and 2 x 65 rows; the bias is added once."""
    k = 4127 if fmt.startswith("int8") else 4128
    g = torch.Generator().manual_seed(3)
    q = FORMATS[fmt](torch.randn(67, k, generator=g))
    wq = Q.dequantize(q, k)
    bias = torch.randn(67, generator=g)
    for shape, b in (((9, k), None), ((2, 65, k), bias)):
        x = torch.randn(shape, generator=g)
        out = quant_prefill(x, q, b)
        assert out.shape == (*shape[:-1], 67) and out.dtype == torch.float32
        x2, o2 = x.reshape(-1, k), out.reshape(-1, 67)
        ref = x2.double() @ wq.double().T + (0 if b is None else b.double())
        assert ((o2.double() - ref).abs() <= _tolerance(x2, q, wq, ref, k)).all()


def test_quant_prefill_rejects_what_it_cannot_serve(kernel: None) -> None:
    w = torch.randn(8, 64)
    with pytest.raises(RuntimeError, match="x must be float32"):
        quant_prefill(torch.randn(9, 64).bfloat16(), Q.quantize_int8(w))
    with pytest.raises(RuntimeError, match="int8 data has 64 columns, x has K = 32"):
        quant_prefill(torch.randn(9, 32), Q.quantize_int8(w))
    with pytest.raises(RuntimeError, match="blocks do not match K = 96"):
        quant_prefill(torch.randn(9, 96), gguf_blocks(w, Q.Q4_1Blocks))
    with pytest.raises(RuntimeError, match="x has K = 96, the int4 weight holds 2 groups of 32"):
        quant_prefill(torch.randn(9, 96), Q.quantize_int4(w, 32))


def test_quant_prefill_checks_the_weight_as_quant_gemm_does(kernel: None) -> None:
    """Layouts that used to give a silent wrong answer (x narrower than an int4 weight: only its
    first group multiplied; float bytes read as int8; a (N, 1) bias broadcast across rows) or
    read past a tensor (int4 scales and offsets of fewer rows) are RuntimeErrors; 0 rows of x
    give an empty product."""
    w = torch.randn(8, 64)
    q4, q8 = Q.quantize_int4(w, 32), Q.quantize_int8(w)
    op = torch.ops.neuronfx.quant_prefill
    with pytest.raises(RuntimeError, match="x has K = 32, the int4 weight holds 2 groups of 32"):
        quant_prefill(torch.randn(9, 32), q4)
    with pytest.raises(RuntimeError, match="needs int8 data, got Float"):
        op(torch.randn(9, 64), q8.data.float(), q8.scale, None, 0, None)
    with pytest.raises(RuntimeError, match="scale and offset must be contiguous \\(N, groups\\)"):
        op(torch.randn(9, 64), q4.data, q4.scale[:4].contiguous(), q4.offset[:4].contiguous(), 1, None)
    with pytest.raises(RuntimeError, match="scale must be a contiguous float32 or bfloat16"):
        op(torch.randn(9, 64), q8.data, q8.scale.half(), None, 0, None)
    with pytest.raises(RuntimeError, match="bias must be 1-D of 8 values"):
        quant_prefill(torch.randn(8, 64), q8, torch.randn(8, 1))
    empty = quant_prefill(torch.randn(0, 64), q4, torch.randn(8))
    assert empty.shape == (0, 8) and empty.dtype == torch.float32


def test_quant_gemm_multi_rejects_mixed_layouts(kernel: None) -> None:
    w = torch.randn(8, 64)
    with pytest.raises(RuntimeError, match="share format and group size"):
        quant_gemm_multi(torch.randn(1, 64), [Q.quantize_int4(w, 32), Q.quantize_int4(w, 64)], [None, None])
    with pytest.raises(RuntimeError, match="gate has 8 rows, up has 4"):
        quant_glu(torch.randn(1, 64), Q.quantize_int8(w), Q.quantize_int8(w[:4]))


def test_quant_gemm_rejects_mismatched_shapes(kernel: None) -> None:
    w = torch.randn(8, 64)
    with pytest.raises(RuntimeError, match="x has 32 features"):
        quant_gemm(torch.randn(1, 32), Q.quantize_int4(w, 32))
    with pytest.raises(RuntimeError, match="int8 data must be int8"):
        quant_gemm(torch.randn(1, 32), Q.quantize_int8(w))
    with pytest.raises(RuntimeError, match="x has 96 features, blocks hold 64"):
        quant_gemm(torch.randn(1, 96), gguf_blocks(w, Q.Q8_0Blocks))
    with pytest.raises(RuntimeError, match="bias has 3 values"):
        quant_gemm(torch.randn(1, 64), Q.quantize_int8(w), torch.randn(3))


def test_quant_ops_trace_with_fullgraph(kernel: None) -> None:
    """The kernel (through its fake impl) and the torch dequantization (uint8 slicing and fp16
    views) trace with fullgraph=True; aot_eager runs dynamo and the fake-tensor trace inductor
    starts from, without its code generation."""
    g = torch.Generator().manual_seed(5)
    q = gguf_blocks(torch.randn(40, 64, generator=g), Q.Q4_1Blocks)
    ids, x = torch.tensor([[3, 39]]), torch.randn(1, 2, 64, generator=g)

    def fn(q: Q.Q4_1Blocks, ids: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quant_gemm(x, q), Q.dequantize(Q.gather_rows(q, ids), 64)

    compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend="aot_eager")
    for a, b in zip(compiled(q, ids, x), fn(q, ids, x), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---- int8 activations (``int8_x``) ---------------------------------------------------------

INT8_X_FORMATS = ["q4_0", "q4_1", "int4-g32", "int4-g64", "int4-g128"]


def test_quant_int8_x_isa_matches_this_cpu(kernel: None) -> None:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = set(next((line.split() for line in text.splitlines() if line.startswith("flags")), []))
    assert quant_int8_x_isa() == ("avx512-vnni" if {"avx512f", "f16c", "avx512_vnni"} <= flags else "scalar")


@pytest.mark.parametrize("fmt", INT8_X_FORMATS)
def test_int8_x_lane_order_one_hot(kernel: None, fmt: str) -> None:
    """x = e_k gives column k of the dequantized weight: each lane of the kernel's chunks meets
    the x value its nibble belongs to (a one-hot block rounds exactly: 127 * (1 / 127)). K = 224
    (7 groups of 32: an odd last pair) or 256 (int4 groups of 64 / 128)."""
    k = 224 if fmt in ("q4_0", "q4_1", "int4-g32") else 256
    g = torch.Generator().manual_seed(3)
    q = FORMATS[fmt](torch.randn(5, k, generator=g))
    wq = Q.dequantize(q, k)
    out = quant_gemm(torch.eye(k), q, None, True)  # row i: x = e_i
    torch.testing.assert_close(out, wq.T, rtol=4 * U32, atol=4 * U32 * wq.abs().max().item())


@pytest.mark.parametrize("fmt", INT8_X_FORMATS)
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_int8_x_matches_reference(kernel: None, fmt: str, xdtype: torch.dtype) -> None:
    """The int8-activation products against ``reference_int8_x_linear`` (x rounded per lane
    block as the kernel does, float64 products; the integer sums are exact, so what is left is
    fp32 accumulation: :func:`_tolerance`), at every x-row chunking, with bias; and against the
    exact product within the rounding of x (absmax / 254 per value of each 32, summed)."""
    k = {"q4_0": 224, "q4_1": 224}.get(fmt, 200)
    g = torch.Generator().manual_seed(k + len(fmt))
    q = FORMATS[fmt](torch.randn(67, k, generator=g))
    wq = Q.dequantize(q, k)
    bias = torch.randn(67, generator=g)
    for rows in [1, 2, 3, 4, 5, 8, 11]:
        x = torch.randn(rows, k, generator=g).to(xdtype)
        out = quant_gemm(x, q, bias, True)
        assert out.dtype == xdtype and out.shape == (rows, 67)
        ref = int8_x.reference_int8_x_linear(x, q) + bias.double()
        assert ((out.double() - ref).abs() <= _tolerance(x, q, wq, ref, k)).all()
        exact = x.double() @ wq.double().T + bias.double()
        rounding = (x.double().abs().amax(dim=-1, keepdim=True) / 254) @ wq.double().abs().sum(dim=1, keepdim=True).T
        assert ((out.double() - exact).abs() <= rounding + _tolerance(x, q, wq, exact, k)).all()
        assert (out.double() - exact).abs().max() > 0  # x was rounded: not the float path


def test_int8_x_multi_glu_and_formats_it_does_not_serve(kernel: None) -> None:
    """quant_gemm_multi and quant_glu round x once for all their weights; int8, Q8_0 and int4
    groups of 96 keep float x (results identical to int8_x=False)."""
    g = torch.Generator().manual_seed(21)
    k = 224
    qs = [FORMATS["q4_1"](torch.randn(n, k, generator=g)) for n in (40, 19)]
    x = torch.randn(3, k, generator=g)
    for out, q in zip(quant_gemm_multi(x, qs, [None, None], True), qs, strict=True):
        assert torch.equal(out, quant_gemm(x, q, None, True))
    gate, up = qs[0], FORMATS["q4_1"](torch.randn(40, k, generator=torch.Generator().manual_seed(21 + 1)))
    out = quant_glu(x, gate, up, True)
    a, u = quant_gemm(x, gate, None, True), quant_gemm(x, up, None, True)
    torch.testing.assert_close(out, torch.nn.functional.silu(a) * u, rtol=1e-6, atol=1e-6)
    for fmt in ("int8", "q8_0", "int4-g96-bf16"):
        q = FORMATS[fmt](torch.randn(9, k, generator=g))
        assert Q.int8_x_group_size(q) is None
        assert torch.equal(quant_gemm(x, q, None, True), quant_gemm(x, q))


def test_cpu_kernel_ops_bind_int8_activations(kernel: None) -> None:
    """The plan option reaches the kernels: the ops bundle of ``activation_format="int8"`` runs
    the int8-activation products for decode rows, and prefill rows (> 8) keep the dequantized
    float GEMM; the default bundle keeps float x."""
    from neuronfx.graphs.kernels.activation_choice import ALL_PATHS
    from neuronfx.graphs.kernels.bundles import cpu_kernel_ops

    g = torch.Generator().manual_seed(8)
    k = 224
    q, up = (FORMATS["q4_1"](torch.randn(40, k, generator=g)) for _ in range(2))
    x, prefill = torch.randn(2, k, generator=g), torch.randn(12, k, generator=g)
    int8_ops, float_ops = cpu_kernel_ops("float32", ALL_PATHS), cpu_kernel_ops("float32")
    assert "int8_activations=4bit/batch, 4bit/one, 4bit/prefill, int8/batch" in int8_ops.name and "int8_activations=none" in float_ops.name
    assert torch.equal(int8_ops.linear(x, q), quant_gemm(x, q, None, True))
    assert torch.equal(int8_ops.projections(x, [q, up], [None, None])[1], quant_gemm(x, up, None, True))
    assert torch.equal(int8_ops.glu(x, q, up), quant_glu(x, q, up, True))
    assert torch.equal(float_ops.linear(x, q), quant_gemm(x, q))
    torch.testing.assert_close(int8_ops.linear(prefill, q), prefill @ Q.dequantize(q, k).T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("k", [197, 576])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_w8a8_gemm_equals_w8a8_linear_bit_for_bit(kernel: None, k: int, xdtype: torch.dtype) -> None:
    """The decode-rows integer kernel against ``int8_x.w8a8_linear`` (torch._int_mm): the same bits
    at every row count (a K tail short of 64 included), with and without bias, an all-zero row
    (scale 0) among them; each row equal to that row alone; 0 rows give (0, N)."""
    g = torch.Generator().manual_seed(k)
    q = Q.quantize_int8(torch.randn(67, k, generator=g))
    bias = torch.randn(67, generator=g)
    x = torch.randn(11, k, generator=g).to(xdtype)
    x[3] = 0
    for rows in [1, 2, 3, 4, 5, 6, 7, 8, 11]:
        for b in (None, bias):
            assert torch.equal(w8a8_gemm(x[:rows], q, b), int8_x.w8a8_linear(x[:rows], q, b)), (rows, b is None)
    alone = torch.cat([w8a8_gemm(x[i : i + 1], q) for i in range(11)])
    assert torch.equal(w8a8_gemm(x, q), alone) and not alone[3].any()
    assert w8a8_gemm(x.view(1, 11, k), q).shape == (1, 11, 67) and w8a8_gemm(x[:0], q).shape == (0, 67)


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_w8a8_packed_equals_w8a8_linear_bit_for_bit(kernel: None, xdtype: torch.dtype) -> None:
    """The packed int8 weights' kernel against ``int8_x.w8a8_linear`` (torch._int_mm on the
    row-major weight): the same bits at decode and prefill row counts (8-row tiles and their
    tails, rows rounded in parallel past 16), with and without bias, an all-zero row among them;
    each row equal to that row alone."""
    g = torch.Generator().manual_seed(5)
    q = Q.quantize_int8(torch.randn(80, 196, generator=g))  # 5 blocks of 16 channels: the 4-wide and 2-wide tiles' tails
    p = Q.pack_int8(q)
    bias = torch.randn(80, generator=g)
    x = torch.randn(37, 196, generator=g).to(xdtype)
    x[3] = 0
    for rows in [1, 2, 3, 4, 5, 8, 9, 13, 37]:
        for b in (None, bias):
            assert torch.equal(w8a8_packed(x[:rows], p, b), int8_x.w8a8_linear(x[:rows], q, b)), (rows, b is None)
    alone = torch.cat([w8a8_packed(x[i : i + 1], p) for i in range(37)])
    assert torch.equal(w8a8_packed(x, p), alone) and not alone[3].any()
    assert w8a8_packed(x.view(1, 37, 196), p).shape == (1, 37, 80) and w8a8_packed(x[:0], p).shape == (0, 80)


def test_w8a8_packed_multi_and_glu_are_the_single_products(kernel: None) -> None:
    """Q/K/V of packed weights in one call: each weight's columns the bits of its own
    ``w8a8_packed`` (biases on some); the gated product within fp32 rounding of silu(gate) * up
    (its exp is std::exp, torch's silu its own)."""
    g = torch.Generator().manual_seed(8)
    ws = [Q.pack_int8(Q.quantize_int8(torch.randn(n, 96, generator=g))) for n in (48, 16, 80)]
    biases = [None, torch.randn(16, generator=g), torch.randn(80, generator=g)]
    for rows in (1, 5, 13):
        x = torch.randn(rows, 96, generator=g)
        got = w8a8_packed_multi(x, ws, biases)
        assert [tuple(t.shape) for t in got] == [(rows, 48), (rows, 16), (rows, 80)]
        for out, w, b in zip(got, ws, biases):
            assert torch.equal(out, w8a8_packed(x, w, b))
        gate, up = ws[2], Q.pack_int8(Q.quantize_int8(torch.randn(80, 96, generator=g)))
        want = torch.nn.functional.silu(w8a8_packed(x, gate)) * w8a8_packed(x, up)
        torch.testing.assert_close(w8a8_packed_glu(x, gate, up), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="gate has 80 rows, up has 48"):
        w8a8_packed_glu(x, ws[2], ws[0])
    with pytest.raises(ValueError, match="1 to 3 weights"):
        w8a8_packed_multi(x, ws + ws[:1], biases + [None])


def test_int8_packing_keeps_the_values() -> None:
    """pack_int8 lays 16 channels x 4 features per 64 bytes, offset by 128 (read back exactly) and
    keeps the row-major data for prefill; dequantize gives the weight back exactly; shapes it
    cannot pack are a ValueError."""
    g = torch.Generator().manual_seed(6)
    q = Q.quantize_int8(torch.randn(32, 12, generator=g))
    p = Q.pack_int8(q)
    assert p.data.shape == (2, 3, 64) and p.data.dtype == torch.uint8 and p.shape == (32, 12)
    assert int(p.data[1, 2, 4 * 5 + 3]) == int(q.data[16 + 5, 4 * 2 + 3]) + 128  # block 1, quad 2, channel 5, feature 3
    assert torch.equal(Q.packed_values(p), q.data) and p.rows is q.data and torch.equal(Q.dequantize(p, 12), Q.dequantize(q, 12))
    assert Q.weight_bytes(p) == Q.weight_bytes(q) == 32 * 12 + 32 * 4  # a decode product reads the packed copy
    assert Q.packable(q) and not Q.packable(Q.quantize_int8(torch.randn(24, 12))) and not Q.packable(Q.quantize_int4(torch.randn(32, 64), 32))
    with pytest.raises(ValueError, match=r"N % 16 == 0 and K % 4 == 0, got \(32, 10\)"):
        Q.pack_int8(Q.quantize_int8(torch.randn(32, 10)))


def test_w8a8_packed_rejects_what_it_cannot_serve(kernel: None) -> None:
    p = Q.pack_int8(Q.quantize_int8(torch.randn(16, 64)))
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        w8a8_packed(torch.randn(1, 32), p)
    with pytest.raises(RuntimeError, match="bias must be"):
        w8a8_packed(torch.randn(1, 64), p, torch.randn(3))
    with pytest.raises(RuntimeError, match=r"contiguous uint8 \(N / 16, K / 4, 64\)"):
        w8a8_packed(torch.randn(1, 64), p._replace(data=p.data.view(16, 64)))


def test_w8a8_gemm_rejects_what_it_cannot_serve(kernel: None) -> None:
    q = Q.quantize_int8(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        w8a8_gemm(torch.randn(1, 32), q)
    with pytest.raises(RuntimeError, match="bias must be"):
        w8a8_gemm(torch.randn(1, 64), q, torch.randn(3))
    with pytest.raises(RuntimeError, match="contiguous int8"):
        w8a8_gemm(torch.randn(1, 64), Q.Int8Weight(data=q.data.float(), scale=q.scale))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        w8a8_gemm(torch.randn(1, 64).half(), q)
