"""4-bit weights packed for VNNI against int8 activations (``quant.Int4Packed``,
``library.w4a8_packed``): the layout round trip, the kernel against ``int8_x.w4a8_linear`` bit
for bit at every row count, the fused Q/K/V and gate/up calls, the ops bundle's routing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, quants

from neuronfx.graphs.kernels import library
from neuronfx.graphs.kernels.activation_choice import FLOAT_PATHS
from neuronfx.graphs.kernels.bundles import cpu_kernel_ops
from neuronfx.graphs.models import int8_x
from neuronfx.graphs.models import quant as Q

GGUF = {"q4_0": (Q.Q4_0Blocks, GGMLQuantizationType.Q4_0), "q4_1": (Q.Q4_1Blocks, GGMLQuantizationType.Q4_1)}


def four_bit(fmt: str, w: torch.Tensor) -> Q.QuantizedWeight:
    """w (N, K) -> an int4 weight in groups of 32 or GGUF blocks made by the gguf package."""
    if fmt == "int4":
        return Q.quantize_int4(w, 32)
    cls, kind = GGUF[fmt]
    return cls(torch.from_numpy(quants.quantize(w.numpy(), kind)))


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not library.small_gemm_available():
        pytest.fail("the neuronfx kernel library did not build on this machine (see the warning above)")


@pytest.mark.parametrize("fmt", ["int4", "q4_0", "q4_1"])
def test_pack_int4_keeps_every_value(fmt: str) -> None:
    """Packing is lossless: the nibbles, scales and offsets read back equal the source's, and
    the dequantized weight equals the source's bit for bit; GGUF keeps fp16 scales (320-byte
    records), int4 fp32 (384)."""
    g = torch.Generator().manual_seed(1)
    q = four_bit(fmt, torch.randn(48, 96, generator=g))
    p = Q.pack_int4(q)
    assert p.data.shape == (3, 3, 384 if fmt == "int4" else 320) and p.data.dtype == torch.uint8 and p.shape == (48, 96)
    for got, want in zip(Q.unpack_int4(p), Q.four_bit_groups(q)):
        assert torch.equal(got, want)
    assert torch.equal(Q.dequantize(p, 96), Q.dequantize(q, 96))
    # the documented byte order: block 1, group 2, line 3, channel 5, feature 2 -> q[21, 64 + 24 + 2] low, q[21, 64 + 28 + 2] high
    values = Q.four_bit_groups(q)[0]
    byte = p.data[1, 2, 3 * 64 + 4 * 5 + 2]
    assert byte & 0x0F == values[21, 2, 26] and byte >> 4 == values[21, 2, 30]


def test_pack_int4_keeps_fp32_where_fp16_would_round() -> None:
    """A Q4_0 block whose -8 d overflows fp16 (|d| > 8188) packs with fp32 records, so its
    values stay exact (fp16 would store an infinite offset)."""
    g = torch.Generator().manual_seed(5)
    q = four_bit("q4_0", torch.randn(16, 64, generator=g) * 1e5)
    p = Q.pack_int4(q)
    assert p.data.shape[-1] == 384 and torch.isfinite(Q.unpack_int4(p)[2]).all()
    assert torch.equal(Q.dequantize(p, 64), Q.dequantize(q, 64))


def test_pack_int4_refuses_what_it_cannot_hold() -> None:
    g = torch.Generator().manual_seed(2)
    with pytest.raises(ValueError, match="groups are 32 wide"):
        Q.pack_int4(Q.quantize_int4(torch.randn(16, 128, generator=g), 64))
    with pytest.raises(ValueError, match="N % 16 == 0"):
        Q.pack_int4(Q.quantize_int4(torch.randn(20, 64, generator=g), 32))
    assert not Q.packable_int4(Q.quantize_int8(torch.randn(16, 64, generator=g)))


@pytest.mark.parametrize("fmt", ["int4", "q4_0", "q4_1"])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_w4a8_packed_equals_w4a8_linear_bit_for_bit(fmt: str, xdtype: torch.dtype) -> None:
    """The kernel against the reference at 1 to 70 rows (tiles of 1-4 rows, a range's last
    blocks alone, rows past one chunk of 64), with and without bias, an all-zero row among them;
    the reference within x's rounding of the float product."""
    g = torch.Generator().manual_seed(3)
    q = four_bit(fmt, torch.randn(80, 160, generator=g))
    p = Q.pack_int4(q)
    bias = torch.randn(80, generator=g)
    for rows in (1, 2, 3, 5, 8, 70):
        x = torch.randn(rows, 160, generator=g).to(xdtype)
        x[rows // 2] = 0
        assert torch.equal(library.w4a8_packed(x, p), int8_x.w4a8_linear(x, p)), rows
        assert torch.equal(library.w4a8_packed(x, p, bias), int8_x.w4a8_linear(x, p, bias)), rows
        xq, xs = int8_x.int8_groups(x)
        rounded = (xq.double() * xs.double()[..., None]).reshape(rows, 160) @ Q.dequantize(q, 160).double().T
        torch.testing.assert_close(int8_x.w4a8_linear(x, p).double(), rounded.to(xdtype).double(), rtol=1e-2 if xdtype == torch.bfloat16 else 1e-5,
                                   atol=1e-2 if xdtype == torch.bfloat16 else 1e-4)
    assert library.w4a8_packed(torch.randn(0, 160), p).shape == (0, 80)
    x = torch.randn(3, 160, generator=g).to(xdtype)
    x[1, 40] = float("nan")  # a NaN reaches every output of its row, as in the reference and a float product
    got = library.w4a8_packed(x, p)
    assert got[1].isnan().all() and torch.equal(got[[0, 2]], int8_x.w4a8_linear(x[[0, 2]], p))
    assert int8_x.w4a8_linear(x, p)[1].isnan().all()


def test_w4a8_fused_calls_and_the_ops_bundle() -> None:
    """Q/K/V in one call equal each product alone; gate/up in one call is silu(gate) * up of the
    same products (its own exp, within an ulp or two); the CPU ops bundle sends packed 4-bit
    weights to these kernels at every row count whatever the paths say (packing is the plan's
    decision); shapes that do not match are RuntimeErrors."""
    g = torch.Generator().manual_seed(4)
    ws = [Q.pack_int4(four_bit("q4_1", torch.randn(n, 96, generator=g))) for n in (64, 32, 32)]
    gate, up = (Q.pack_int4(four_bit("q4_1", torch.randn(48, 96, generator=g))) for _ in range(2))
    biases = [None, torch.randn(32, generator=g), None]
    ops = cpu_kernel_ops("float32", FLOAT_PATHS)
    for rows in (1, 4, 70):
        x = torch.randn(rows, 96, generator=g)
        for got, w, b in zip(library.w4a8_packed_multi(x, ws, biases), ws, biases):
            assert torch.equal(got, int8_x.w4a8_linear(x, w, b))
        for got, w, b in zip(ops.projections(x, ws, biases), ws, biases):
            assert torch.equal(got, int8_x.w4a8_linear(x, w, b))
        want = torch.nn.functional.silu(int8_x.w4a8_linear(x, gate)) * int8_x.w4a8_linear(x, up)
        torch.testing.assert_close(library.w4a8_packed_glu(x, gate, up), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ops.glu(x, gate, up), want, rtol=1e-5, atol=1e-6)
        assert torch.equal(ops.linear(x, ws[0]), int8_x.w4a8_linear(x, ws[0]))
    with pytest.raises(RuntimeError, match="x has 64 features, the weight 96"):
        library.w4a8_packed(torch.randn(1, 64), ws[0])
    with pytest.raises(RuntimeError, match="multiple of 32, got 40"):
        library.w4a8_packed(torch.randn(1, 40), ws[0])
    with pytest.raises(RuntimeError, match="feature dimension"):
        library.w4a8_packed(torch.tensor(1.0), ws[0])
    with pytest.raises(RuntimeError, match="gate has 48 rows, up has 64"):
        library.w4a8_packed_glu(torch.randn(1, 96), gate, ws[0])


def test_w8a8_isa_matches_this_cpu(kernel: None) -> None:
    """The int8-activation kernels' compiled path is the widest this CPU has (``-march=native``)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = set(next((line.split() for line in text.splitlines() if line.startswith("flags")), []))
    want = ("vnni" if {"avx512f", "avx512bw", "avx512_vnni"} <= flags else "avx2" if {"avx2", "fma", "f16c"} <= flags else "scalar")
    assert library.w8a8_isa() == want


def test_w4a8_fakes_give_the_ops_shapes() -> None:
    """Under FakeTensorMode (what dynamo and inductor trace with) each 4-bit op's output has the
    real op's shape and dtype, bf16 x and 3-D x included."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.Generator().manual_seed(6)
    ws = [Q.pack_int4(four_bit("q4_1", torch.randn(n, 64, generator=g))) for n in (32, 16)]
    for x in (torch.randn(3, 64, generator=g), torch.randn(2, 5, 64, generator=g).bfloat16()):
        real = [library.w4a8_packed(x, ws[0]), library.w4a8_packed_multi(x, ws, [None, None])[1], library.w4a8_packed_glu(x, ws[0], ws[0])]
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fx = mode.from_tensor(x)
            fws = [Q.Int4Packed(mode.from_tensor(w.data)) for w in ws]
            fake = [library.w4a8_packed(fx, fws[0]), library.w4a8_packed_multi(fx, fws, [None, None])[1],
                    library.w4a8_packed_glu(fx, fws[0], fws[0])]
        assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]

