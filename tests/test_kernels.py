"""The small_gemm kernel against a float64 reference, and its use inside inductor graphs."""

from __future__ import annotations

import pytest
import torch

from neuronfx.graphs.kernels import SMALL_GEMM_MAX_ROWS, small_gemm, small_gemm_available
from neuronfx.graphs.layers import linear

# Tolerances: fp32 accumulation over K <= 200 terms of O(1) products; the output is rounded to
# x's dtype (bf16: 8 mantissa bits, relative 2**-8; fp16: 2**-11).
TOL = {torch.float32: 1e-4, torch.bfloat16: 2**-8, torch.float16: 2**-11}


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not small_gemm_available():
        pytest.fail("the small_gemm kernel did not build on this machine (see the warning above)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 11])
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


def _ops_run(fn: object, *args: torch.Tensor) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args)
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("rows", [1, SMALL_GEMM_MAX_ROWS, SMALL_GEMM_MAX_ROWS + 1])
def test_compiled_linear_uses_kernel_up_to_max_rows(rows: int) -> None:
    x, w = torch.randn(rows, 64), torch.randn(32, 64)
    fn = torch.compile(linear, fullgraph=True, dynamic=False)
    out = fn(x, w)
    torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-5)
    ops = _ops_run(fn, x, w)
    assert ("neuronfx::small_gemm" in ops) == (rows <= SMALL_GEMM_MAX_ROWS), sorted(ops)


def test_eager_linear_is_f_linear() -> None:
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    assert "neuronfx::small_gemm" not in _ops_run(linear, x, w)
