"""Numerics-sensitive tests again with the BLAS and oneDNN pinned to AVX2, in a subprocess.

Tolerances must follow from the arithmetic, not from the machine a test was written on: another
CPU (or another instruction set on the same one) makes MKL and oneDNN pick other kernels, with
other fp32 summation orders. Pinning MKL (``MKL_ENABLE_INSTRUCTIONS``), oneDNN
(``ONEDNN_MAX_CPU_ISA``) and ATen's vectorised kernels (``ATEN_CPU_CAPABILITY``) to AVX2 gives
a machine with AVX-512 (or AVX-VNNI) a second set of kernels, so a tolerance read off one CPU
fails here rather than on the next CI machine (elsewhere the main run already ran that set: the
test is skipped). The whole suite was also run so pinned (docs/testing.md); these are some of
the tests whose tolerances are tightest: prefill logits against transformers, chunked against
unchunked prefill, quantized weights against their dequantized reference, 16-bit GEMV against
fp32.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from neuronfx.graphs.kernels.library import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
PINNED = {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
SELECTED = [
    "tests/test_e2e_smollm2.py::test_chunked_prefill_equals_unchunked",
    "tests/test_models.py::test_prefill_logits_match_transformers",
    "tests/test_quantized.py::test_eager_quantized_matches_transformers_on_dequantized_weights",
    "tests/test_lowp.py::test_gemv_equals_fp32_linear_rounded_once",
]
# eager cases only (the compiled ones are the same math, and compiling them takes the time), and
# of test_models' families two of different math: llama's and mixtral's (MoE); every chunk
# size, quantized format and 16-bit dtype
CASES = "not (models and not (llama-eager or mixtral-eager))"


# Where ATen's best kernels are AVX2 and the CPU has no AVX-VNNI (which oneDNN would use beside AVX2), MKL, oneDNN
# and ATen already run AVX2 kernels in the main run: pinning them to it repeats that run.
AVX2_ALREADY = torch.backends.cpu.get_cpu_capability() != "AVX512" and "avx_vnni" not in cpu_flags().split()


@pytest.mark.skipif(AVX2_ALREADY, reason=f"ATen runs {torch.backends.cpu.get_cpu_capability()} kernels here and the CPU "
                    "has no AVX-512 or AVX-VNNI: MKL, oneDNN and ATen already ran AVX2 kernels, pinning them repeats the main run")
def test_tight_tolerances_hold_with_avx2_kernels(tmp_path):
    # Its own compile cache (conftest makes one when none is named) and inductor cache: code
    # compiled pinned must never be loaded by an unpinned process (an inductor cache shared by
    # pinned and unpinned runs crashed later compiles with "double free or corruption").
    env = {k: v for k, v in os.environ.items() if k != "NEURONFX_TEST_CACHE_DIR"} | PINNED
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    env["NEURONFX_KERNELS"] = "0"  # our C++ kernels take no pin (built -march=native): BLAS, oneDNN and ATen are what moves
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SELECTED, "-k", CASES], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
