"""Build the narrower SIMD paths of csrc/quant_gemm.cpp on this CPU and check them like the tests do;
and csrc/w8a8_gemm.cpp without AVX512-VNNI (its scalar integer code) against the references.

Usage: .venv/bin/python scripts/check_quant_paths.py   (about 3 min: three extra builds)

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

from test_quant import FORMATS, _tolerance  # noqa: E402
from test_w4a8 import four_bit  # noqa: E402

from neuronfx.graphs.kernels import library as kernels  # noqa: E402
from neuronfx.graphs.models import int8_x  # noqa: E402
from neuronfx.graphs.models import quant as Q  # noqa: E402

SOURCE = next(s for s in kernels.SOURCES if s.name == "quant_gemm.cpp")
W8A8_SOURCE = next(s for s in kernels.SOURCES if s.name == "w8a8_gemm.cpp")
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


def check_w8a8_scalar(build: Path) -> bool:
    """w8a8_gemm.cpp built with -mno-avx512vnni (its scalar integer code): the packed int8 and
    packed 4-bit products against ``int8_x``'s references bit for bit (int4, Q4_0, Q4_1; rows
    1 to 70, with a bias)."""
    ns = "nfx_check_w8a8_scalar"
    load(name=ns, sources=[str(W8A8_SOURCE)], extra_cflags=[*kernels.CFLAGS, "-mno-avx512vnni", f"-Dneuronfx={ns}"],
         extra_ldflags=["-fopenmp"], is_python_module=False, build_directory=str(build), verbose=False)
    op = getattr(torch.ops, ns)
    g = torch.Generator().manual_seed(3)
    equal = not op.w8a8_vnni()
    for fmt in ("int4", "q4_0", "q4_1"):
        p = Q.pack_int4(four_bit(fmt, torch.randn(80, 160, generator=g)))
        bias = torch.randn(80, generator=g)
        for rows in (1, 3, 8, 70):
            x = torch.randn(rows, 160, generator=g)
            equal &= torch.equal(op.w4a8_packed(x, p.data, bias), int8_x.w4a8_linear(x, p, bias))
    q = Q.quantize_int8(torch.randn(48, 96, generator=g))
    packed = Q.pack_int8(q)
    for rows in (1, 5, 12):
        x = torch.randn(rows, 96, generator=g)
        equal &= torch.equal(op.w8a8_packed(x, packed.data, packed.scale, None), int8_x.w8a8_linear(x, q))
    print(f"w8a8_gemm.cpp without VNNI: packed int8 and 4-bit products equal to the references: {'ok' if equal else 'FAIL'}")
    return equal


def main() -> None:
    failed = False
    with tempfile.TemporaryDirectory() as build:
        (Path(build) / "w8a8").mkdir()
        failed |= not check_w8a8_scalar(Path(build) / "w8a8")
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
