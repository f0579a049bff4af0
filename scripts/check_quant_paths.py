"""Build the narrower SIMD paths of csrc/quant_gemm.cpp on this CPU and check them like the tests do;
csrc/w8a8_gemm.cpp's AVX2 and scalar integer paths against the references;
csrc/causal_attention.cpp's AVX2 and scalar paths against the float64 causal attention (and
csrc/small_gemm.cpp's cached attention, built with it, over NaN and infinite keys); and
csrc/topk.cpp's AVX2 and scalar paths against tests/test_kernels.py's naive order (and its
argmax_rows against torch.argmax).

Usage: .venv/bin/python scripts/check_quant_paths.py   (about 5 min: eight extra builds)

The kernel picks its path at compile time (AVX-512, AVX2 + FMA + F16C, scalar), so a machine
only ever runs one of them; this builds the AVX2 and scalar paths here (``-DNFX_QUANT_AVX2`` /
``-DNFX_QUANT_SCALAR``), each under its own op namespace (``-Dneuronfx=...`` renames the
``TORCH_LIBRARY`` namespace, the only place the token appears in the file), and runs every
format of tests/test_quant.py against the float64 reference with the tests' tolerance.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_kernels import CAUSAL_SHAPES, NAN_KEY_ATOL, _naive_topk, argmax_cases, naive_attention, naive_causal_attention, nan_key_case  # noqa: E402
from test_quant import FORMATS, _tolerance  # noqa: E402
from test_w4a8 import four_bit  # noqa: E402

from neuronfx.graphs.kernels import library as kernels  # noqa: E402
from neuronfx.graphs.models import int8_x  # noqa: E402
from neuronfx.graphs.models import quant as Q  # noqa: E402

SOURCE = next(s for s in kernels.SOURCES if s.name == "quant_gemm.cpp")
W8A8_SOURCE = next(s for s in kernels.SOURCES if s.name == "w8a8_gemm.cpp")
TOPK_SOURCE = next(s for s in kernels.SOURCES if s.name == "topk.cpp")
PATHS = {"avx2": "-DNFX_QUANT_AVX2", "scalar": "-DNFX_QUANT_SCALAR"}


def check(ns: str) -> tuple[dict[torch.dtype, float], list[str]]:
    """(worst error / tolerance per x dtype over every format, rows 1-8 and 11, with and without
    bias; the formats and row counts whose rows differ from the same rows multiplied alone)."""
    op = getattr(torch.ops, ns)
    worst = {torch.float32: 0.0, torch.bfloat16: 0.0}
    variant = []
    for name, make in FORMATS.items():
        k = {"int8": 197, "int8-bf16-scale": 197, "q4_0": 224, "q4_1": 224, "q8_0": 224}.get(name, 200)
        g = torch.Generator().manual_seed(k)
        q = make(torch.randn(67, k, generator=g))
        w = Q.dequantize(q, k)
        scale = q.scale if isinstance(q, (Q.Int8Weight, Q.Int4Weight)) else None
        offset = q.offset if isinstance(q, Q.Int4Weight) else None
        fmt = kernels.QUANT_FORMAT_IDS[Q.FORMAT_NAMES[type(q)]]
        for dtype in (torch.float32, torch.bfloat16):
            for rows in [1, 2, 3, 4, 5, 6, 7, 8, 11]:
                x = torch.randn(rows, k, generator=g).to(dtype)
                for bias in (None, torch.randn(67, generator=g)):
                    out = op.quant_gemm(x, q.data, scale, offset, fmt, bias)
                    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
                    worst[dtype] = max(worst[dtype], ((out.double() - ref).abs() / _tolerance(x, q, w, ref, k)).max().item())
                alone = torch.cat([op.quant_gemm(x[i : i + 1], q.data, scale, offset, fmt, None) for i in range(rows)])
                if not torch.equal(op.quant_gemm(x, q.data, scale, offset, fmt, None), alone):
                    variant.append(f"{name} {dtype} rows={rows}")
    return worst, variant


W8A8_PATHS = {"avx2": "-mno-avx512f", "scalar": "-mno-avx2"}
"""w8a8_gemm.cpp's narrower paths and the flag that builds each on an AVX-512 CPU."""


def check_w8a8(build: Path, path: str) -> bool:
    """w8a8_gemm.cpp built for ``path`` (:data:`W8A8_PATHS`): the row-major and packed int8
    products and the packed 4-bit ones against ``int8_x``'s references bit for bit (int4, Q4_0,
    Q4_1; rows 1 to 70, with a bias; K of 96 and 100 for the row-major kernel's tail), the fused
    Q/K/V call equal to the products alone, the gated products within the tests' tolerance."""
    ns = f"nfx_check_w8a8_{path}"
    load(name=ns, sources=[str(W8A8_SOURCE)], extra_cflags=[*kernels.CFLAGS, W8A8_PATHS[path], f"-Dneuronfx={ns}"],
         extra_ldflags=["-fopenmp"], is_python_module=False, build_directory=str(build), verbose=False)
    op = getattr(torch.ops, ns)
    g = torch.Generator().manual_seed(3)
    isa = op.w8a8_isa()
    equal = isa == path
    for fmt in ("int4", "q4_0", "q4_1"):
        p = Q.pack_int4(four_bit(fmt, torch.randn(80, 160, generator=g)))
        bias = torch.randn(80, generator=g)
        for rows in (1, 3, 5, 8, 70):
            x = torch.randn(rows, 160, generator=g)
            want = int8_x.w4a8_linear(x, p, bias)
            equal &= torch.equal(op.w4a8_packed(x, p.data, bias), want)
            equal &= torch.equal(op.w4a8_packed_multi(x, p.data, bias, p.data, None, None, None)[:, :80], want)
            glu = torch.nn.functional.silu(int8_x.w4a8_linear(x, p)) * int8_x.w4a8_linear(x, p)
            equal &= torch.allclose(op.w4a8_packed_glu(x, p.data, p.data), glu, rtol=1e-5, atol=1e-6)
    for k in (96, 100):
        q = Q.quantize_int8(torch.randn(48, k, generator=g))
        bias = torch.randn(48, generator=g)
        for rows in (1, 2, 3, 4, 5, 7, 8):
            x = torch.randn(rows, k, generator=g)
            equal &= torch.equal(op.w8a8_gemm(x, q.data, q.scale, bias), int8_x.w8a8_linear(x, q, bias))
        packed = Q.pack_int8(q)
        for rows in (1, 3, 4, 5, 8, 12, 70):
            x = torch.randn(rows, k, generator=g)
            want = int8_x.w8a8_linear(x, q, bias)
            equal &= torch.equal(op.w8a8_packed(x, packed.data, packed.scale, bias), want)
            equal &= torch.equal(op.w8a8_packed_multi(x, packed.data, packed.scale, bias, packed.data, packed.scale, None, None, None,
                                                      None)[:, :48], want)
            glu = torch.nn.functional.silu(int8_x.w8a8_linear(x, q)) * int8_x.w8a8_linear(x, q)
            equal &= torch.allclose(op.w8a8_packed_glu(x, packed.data, packed.scale, packed.data, packed.scale), glu, rtol=1e-5, atol=1e-6)
    # x's rounding at special rows (abs_max's lanes and tail): NaN, -0, zeros, the maximum in the tail
    q = Q.quantize_int8(torch.randn(32, 100, generator=g))
    x = torch.randn(6, 100, generator=g) * 5
    x[1, 3], x[2, 99], x[3], x[4], x[5, 98] = float("nan"), float("nan"), 0.0, -0.0, 1e4
    got, want = op.w8a8_packed(x, Q.pack_int8(q).data, q.scale, None), int8_x.w8a8_linear(x, q)
    equal &= torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    print(f"w8a8_gemm.cpp built for {path}: compiled path {isa}; int8 and 4-bit products equal to the references: "
          f"{'ok' if equal else 'FAIL'}")
    return equal


def check_causal_attention(build: Path, path: str) -> bool:
    """causal_attention.cpp (with small_gemm.cpp, whose ISA macros it reads) built for ``path``
    (the flags of :data:`W8A8_PATHS`): tests/test_kernels.py's shapes against the float64
    reference within its 1e-5, and NaN in the rows where SDPA has it."""
    ns = f"nfx_check_attention_{path}"
    unit = build / "unit.cpp"
    csrc = W8A8_SOURCE.parent
    unit.write_text(f'#include "{csrc / "small_gemm.cpp"}"\n#include "{csrc / "causal_attention.cpp"}"\n')
    load(name=ns, sources=[str(unit)], extra_cflags=[*kernels.CFLAGS, W8A8_PATHS[path], f"-Dneuronfx={ns}"],
         extra_ldflags=["-fopenmp"], is_python_module=False, build_directory=str(build), verbose=False)
    op = getattr(torch.ops, ns)
    isa, worst = op.causal_attention_isa(), 0.0
    for batch, heads, kv_heads, tokens, d in CAUSAL_SHAPES:
        g = torch.Generator().manual_seed(tokens * d)
        q = torch.randn(batch, tokens, heads, d, generator=g).transpose(1, 2)
        k = torch.randn(batch, tokens, kv_heads, d, generator=g).transpose(1, 2)
        v = torch.randn(batch, kv_heads, tokens, d, generator=g)
        worst = max(worst, (op.causal_attention(q, k, v).double() - naive_causal_attention(q, k, v)).abs().max().item())
    # NaN and infinities where SDPA has them (tests/test_kernels.py's NaN test)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 45, 64, generator=g) for h in (4, 2, 2))
    q[0, 1, 30, 7], k[0, 0, 40, 3] = float("nan"), float("inf")
    nan_rows = op.causal_attention(q, k, v).isnan().any(-1)
    same_nan = torch.equal(nan_rows, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                           .isnan().any(-1))
    # small_gemm.cpp's cached attention, built alongside: NaN and infinite keys (tests/test_kernels.py's case)
    cached_ok = True
    for cache_dtype in (torch.float32, torch.int8):
        (q, kc, vc, table, mask), expected = nan_key_case(cache_dtype)
        out = op.cached_attention(q, kc, vc, table, mask)
        ref = naive_attention(q, kc, vc, table, mask.shape[-1], mask, int16_weights=cache_dtype == torch.int8)
        cached_ok &= torch.equal(out.isnan().any(-1), expected) and torch.equal(ref.isnan().any(-1), expected)
        cached_ok &= (out.double().nan_to_num(0.0) - ref.nan_to_num(0.0)).abs().max().item() <= NAN_KEY_ATOL[cache_dtype]
    ok = isa == path and worst <= 1e-5 and same_nan and cached_ok
    print(f"causal_attention.cpp built for {path}: compiled path {isa}; worst difference from float64 {worst:.2e}; "
          f"NaN rows as SDPA's: {same_nan}; small_gemm.cpp's cached attention over NaN and inf keys as the float64 "
          f"softmax's: {cached_ok} -> {'ok' if ok else 'FAIL'}")
    return ok


def check_topk(build: Path, path: str) -> bool:
    """topk.cpp built for ``path`` (the flags of :data:`W8A8_PATHS`): k = 256 (the chunk maxima's
    bound) and k = 20 (the heap) over rows of ties, NaN, infinities and a masked half, a tail past
    the last chunk, in the naive order (values and indices)."""
    ns = f"nfx_check_topk_{path}"
    load(name=ns, sources=[str(TOPK_SOURCE)], extra_cflags=[*kernels.CFLAGS, W8A8_PATHS[path], f"-Dneuronfx={ns}"],
         extra_ldflags=["-fopenmp"], is_python_module=False, build_directory=str(build), verbose=False)
    op = getattr(torch.ops, ns)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, 49152 + 37, generator=g)
    x[1] = torch.randint(0, 4, (x.shape[1],), generator=g).float()
    x[2, torch.randint(0, x.shape[1], (40,), generator=g)] = float("nan")
    x[2, -1], x[2, -5] = float("nan"), float("inf")
    x[3, : x.shape[1] // 2] = float("-inf")
    ok = True
    for k in (256, 20):
        values, indices = op.topk_rows(x, k)
        for r in range(x.shape[0]):
            want_values, want_ids = _naive_topk(x[r].tolist(), k)
            want = torch.tensor(want_values)
            ok &= indices[r].tolist() == want_ids and torch.equal(values[r].nan_to_num(), want.nan_to_num())
    # argmax_rows (same file): torch.argmax and isfinite on tests/test_kernels.py's cases, cut
    # to lengths with and without the vector pass, and on the rows above
    cases = argmax_cases()
    argmax_ok = True
    for rows in (cases, cases[:, :40].contiguous(), cases[:, :31].contiguous(), cases[:, :1].contiguous(), x):
        arg, finite = op.argmax_rows(rows)
        argmax_ok &= arg.tolist() == rows.argmax(-1).tolist() and finite.tolist() == torch.isfinite(rows).all(-1).tolist()
    print(f"topk.cpp built for {path}: the naive order's values and indices at k = 256 and 20: {'ok' if ok else 'FAIL'}; "
          f"argmax_rows as torch.argmax and isfinite: {'ok' if argmax_ok else 'FAIL'}")
    return ok and argmax_ok


def main() -> None:
    failed = False
    with tempfile.TemporaryDirectory() as build:
        for path in W8A8_PATHS:
            (Path(build) / f"topk_{path}").mkdir()
            failed |= not check_topk(Path(build) / f"topk_{path}", path)
        for path in W8A8_PATHS:
            (Path(build) / f"attention_{path}").mkdir()
            failed |= not check_causal_attention(Path(build) / f"attention_{path}", path)
        for path in W8A8_PATHS:
            (Path(build) / f"w8a8_{path}").mkdir()
            failed |= not check_w8a8(Path(build) / f"w8a8_{path}", path)
        for path, flag in PATHS.items():
            ns = f"nfx_check_{path}"
            (Path(build) / path).mkdir()
            load(name=ns, sources=[str(SOURCE)], extra_cflags=[*kernels.CFLAGS, flag, f"-Dneuronfx={ns}"],
                 extra_ldflags=["-fopenmp"], is_python_module=False, build_directory=str(Path(build) / path), verbose=False)
            isa = getattr(torch.ops, ns).quant_isa()
            worst, variant = check(ns)
            ok = isa == path and max(worst.values()) <= 1 and not variant
            failed |= not ok
            print(f"{path}: compiled path {isa}; worst error / tolerance: fp32 x {worst[torch.float32]:.3f}, "
                  f"bf16 x {worst[torch.bfloat16]:.3f} (its output rounding alone reaches ~0.98); rows differing from "
                  f"the row alone: {variant or 'none'} -> {'ok' if ok else 'FAIL'}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
