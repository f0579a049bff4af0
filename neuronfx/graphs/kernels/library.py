"""Hand-written CPU kernels used inside compiled graphs (inductor backend).

``neuronfx::small_gemm(x, w, bias)``: ``x (..., K) @ w.T (+ bias)`` for at most
:data:`SMALL_GEMM_MAX_ROWS` rows of x (fp32 weights: :data:`FP32_KERNEL_MAX_ROWS`), weights fp32, bf16 or fp16 of shape (N, K), fp32
accumulation, output in x's dtype. ``small_gemm_multi`` runs several weights against the same x in
one call (Q/K/V), ``small_glu`` forms SwiGLU's ``silu(x @ gate.T) * (x @ up.T)`` in one call. Decode at small batch is bound by reading the weights once per
step, and torch's GEMM paths stream them slowly at M <= 8 (see docs/performance.md; fp32 weights
also beat torch's GEMM up to 64 rows in the kernel's 4 x 3 tiles);
this kernel reads each weight row once against all rows of x (``csrc/small_gemm.cpp``).
``neuronfx::quant_gemm`` does the same for quantized weights (int8, int4, GGUF Q4_0 / Q4_1 /
Q8_0; ``graphs/models/quant.py``) with the SIMD path :func:`quant_isa` names (``csrc/quant_gemm.cpp``),
with ``quant_gemm_multi`` and ``quant_glu`` as the fused Q/K/V and SwiGLU calls.
``neuronfx::w8a8_*`` and ``neuronfx::w4a8_*`` multiply int8 activations by int8 and 4-bit weights
in integers (``csrc/w8a8_gemm.cpp``; the packed layouts ``quant.Int8Packed`` / ``quant.Int4Packed``).
``neuronfx::cached_attention`` is decode attention over the KV cache (``csrc/small_gemm.cpp``),
``neuronfx::causal_attention`` prefill's attention under the causal mask (``csrc/causal_attention.cpp``),
``neuronfx::topk_rows`` the sampler's top-k over the vocabulary and ``neuronfx::argmax_rows``
the greedy and verify graphs' argmax with each row's finiteness (``csrc/topk.cpp``),
``neuronfx::store_int8_kv`` the write of new K and V rows into int8 KV caches (``csrc/kv_write.cpp``).

The C++ sources are built once per machine (and torch install) with torch's extension builder (about 25 s on 2 cores; cached
under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``) with ``-march=native``,
so the library name carries a hash of the CPU's feature flags: a cache shared between different
CPUs never loads a binary built for another. Set ``NEURONFX_KERNELS=0`` to turn the kernel off;
a build failure (no C++ compiler) warns once and falls back to ``F.linear``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import warnings
from collections.abc import Iterator
from pathlib import Path

import filelock
import torch

from neuronfx.graphs.kernels.fakes import register_fakes
from neuronfx.graphs.models.quant import FORMAT_NAMES, QUANTIZED_TYPES, Int4Packed, Int4Weight, Int8Packed, Int8Weight, QuantizedWeight

SMALL_GEMM_MAX_ROWS = 8
"""Largest number of rows of x (batch x tokens) the kernel serves for 16-bit weights (fp32
weights: :func:`fp32_kernel_rows`); above it torch's GEMM serves them."""

FP32_KERNEL_MAX_ROWS = 64
"""Largest number of rows for which fp32 weights' products run ``small_gemm`` (its 4 x 3 tiles
from 5 rows): SmolLM2's products on a 2-core AVX2 EPYC, 2 threads, took 75.5 ms at 32 rows
against 131.5 for torch's GEMM and 149 against 190 at 64 (three alternating rounds,
2026-12-06); prefill chunks of 128 rows and more stay on torch's GEMM (152 GFLOPS at 256 rows,
the kernel 116 at 64). Batch buckets and speculation rows up to here also sum each row in one
order, the single row's."""


def fp32_kernel_rows() -> int:
    """Rows up to which fp32 products run ``small_gemm`` on this machine: FP32_KERNEL_MAX_ROWS
    where the library has its SIMD tiles (:func:`quant_isa` is not ``"scalar"``: built with AVX2
    and FMA; the 4 x 3 tiles were measured there), else SMALL_GEMM_MAX_ROWS (scalar loops are no
    match for torch's GEMM). Builds the library on first use; RuntimeError where it cannot."""
    return FP32_KERNEL_MAX_ROWS if quant_isa() != "scalar" else SMALL_GEMM_MAX_ROWS


PACKED_KERNEL_MAX_ROWS = 64
"""Rows up to which packed int8 weights multiply in ``library.w8a8_packed``; above, torch's
integer GEMM on their row-major copy (``int8_x.w8a8_linear``, x's rounding and the scaling fused
into the graph's passes): at 128 and 1,024 rows ``_int_mm`` ran 400-440 GMAC/s against the
packed kernel's 330-380 (SmolLM2's MLP shapes, 2 threads of the EPYC, 2026-12-05), at 8 rows
the packed kernel 2.2-2.8x the row-major one."""

SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("small_gemm.cpp", "causal_attention.cpp", "quant_gemm.cpp",
                                                                        "quant_prefill.cpp", "w8a8_gemm.cpp", "topk.cpp",
                                                                        "kv_write.cpp"))
"""One library (one build per machine) holds every neuronfx kernel op."""
HEADERS = tuple(Path(__file__).parent / "csrc" / name for name in ("exp16.h", "c_shims.h"))
"""What several sources include (hashed into the library's name with them)."""
BUILD_UNITS = tuple(Path(__file__).parent / "csrc" / name for name in ("unit_dense.cpp", "unit_quant.cpp"))
"""What the compiler is given: two translation units that include :data:`SOURCES` (each parses
torch's headers once; five units took 1.56x the CPU time, see ``csrc/unit_dense.cpp``)."""
CFLAGS = ("-O3", "-march=native", "-fopenmp")
"""The kernels' compiler flags (part of the library's name). -O2 built the library in 28 s
instead of 38 (quant_gemm.cpp 22 s of one core instead of 32, GCC 12), but its tiles ran slower:
SmolLM2's kept Q4_1 blocks decoded at 0.91x at batch 1 and 0.67x at batch 8 (``bench latency
--against``, 4 rounds, 2026-12-05)."""


def cpu_flags() -> str:
    """The CPU's feature flags (the "flags" line of /proc/cpuinfo, else the processor name):
    what a choice made by measurement on this CPU is keyed by."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def library_name() -> str:
    """Extension name: source hash + CPU feature hash + torch version and install directory (one
    build per torch install: torch's build.ninja names that install's include paths, so two
    virtualenvs sharing one build directory rebuilt the library, 30-40 CPU s, each time the
    other had run)."""
    torch_dir = str(Path(torch.__file__).resolve().parent)
    h = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS + BUILD_UNITS) + " ".join(CFLAGS).encode() + cpu_flags().encode()
                       + torch.__version__.encode() + torch_dir.encode())
    return f"neuronfx_kernels_{h.hexdigest()[:12]}"


@contextlib.contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Hold an OS file lock (``filelock``, released by the OS when the holder dies) on the build
    directory of extension ``name`` while torch builds or loads it. torch's own lock is a plain
    file (``FileBaton``) that a process killed mid-build leaves behind, and every later build
    then waits on it forever; under our lock no other neuronfx process is building, so such a
    file is stale and is removed."""
    from torch.utils.cpp_extension import _get_build_directory

    directory = Path(_get_build_directory(name, verbose=False))
    with filelock.FileLock(str(directory / "neuronfx.lock")):
        (directory / "lock").unlink(missing_ok=True)
        yield


def kernels_turned_off() -> bool:
    """Whether ``NEURONFX_KERNELS=0`` turns the kernel library off in this process."""
    return os.environ.get("NEURONFX_KERNELS", "1") == "0"


@functools.cache
def small_gemm_available() -> bool:
    """Build (first call on a machine) and load the kernel library; False, with one warning,
    when it cannot be built or ``NEURONFX_KERNELS=0``."""
    if kernels_turned_off():
        return False
    from torch.utils.cpp_extension import load

    try:
        with build_lock(library_name()):
            load(name=library_name(), sources=[str(p) for p in BUILD_UNITS], extra_cflags=list(CFLAGS),
                 extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, unsupported platform: fall back, do not fail compile
        warnings.warn(f"neuronfx small_gemm kernel unavailable ({exc}); decode uses F.linear (slower).", stacklevel=2)
        return False
    make_symbols_global(library_name())
    register_fakes()
    return True


@functools.cache
def make_symbols_global(name: str) -> bool:
    """Reopen the built library ``name`` (loaded by torch with ``RTLD_LOCAL``) with
    ``RTLD_GLOBAL``, so that the compiled parts' C++ wrappers, linked before it is known where
    the library lives, find its C shims (``kernels.c_shims``) when the process loads them. False,
    with one warning, where that fails (no ``RTLD_NOLOAD`` on the platform, the library not at
    its build path): the compiled parts then call the ops through the dispatcher."""
    from torch.utils.cpp_extension import _get_build_directory

    path = Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
    try:
        ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    except (OSError, AttributeError) as exc:
        warnings.warn(f"neuronfx kernels: cannot reopen {path} with RTLD_GLOBAL ({exc}); compiled graphs call the kernels "
                      "through the dispatcher (slower by a few us a call).", stacklevel=2)
        return False
    return True


MAX_FUSED = 3
"""The most weights one ``small_gemm_multi`` / ``quant_gemm_multi`` call takes (Q, K and V): the
ops take them as separate arguments, not lists, so that inductor's C++ wrapper calls them through
its C shim (a list argument makes it compile the dispatcher's headers into every layer group's
wrapper: about 4 s more g++ each, measured 2026-12-04)."""


def _check_fused(n_weights: int, n_biases: int) -> None:
    if not 1 <= n_weights <= MAX_FUSED or n_biases != n_weights:
        raise ValueError(f"a fused product takes 1 to {MAX_FUSED} weights and one bias (or None) each; got {n_weights} "
                         f"weights and {n_biases} biases: split the weights into calls of at most {MAX_FUSED}")


def small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) in any float dtype @ weight (N, K).T + bias (N,) -> (..., N) in x.dtype;
    fp32 accumulation. Needs :func:`small_gemm_available` to have returned True."""
    return torch.ops.neuronfx.small_gemm(x, weight, bias)


def small_gemm_multi(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """``[small_gemm(x, w, b) for w, b in zip(weights, biases)]`` in one call and one parallel
    region (fused Q/K/V projections); weights share K and dtype. The op returns one (..., sum N)
    tensor, the weights' columns side by side; these are views of it (a tensor result, unlike a
    list, is called through the dispatcher from inductor's C++ wrapper). ValueError for more than
    :data:`MAX_FUSED` weights or a bias count that differs from the weight count."""
    _check_fused(len(weights), len(biases))
    pad = [None] * (MAX_FUSED - len(weights))
    out = torch.ops.neuronfx.small_gemm_multi(x, *weights, *pad, *biases, *pad)
    return list(out.split([w.shape[0] for w in weights], dim=-1))


def small_glu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` -> (..., N) in x.dtype, formed from the fp32
    accumulators and rounded once; gate and up (N, K) share a dtype."""
    return torch.ops.neuronfx.small_glu(x, gate, up)


def cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """Attention of T new tokens per row over their first S cache positions, read through a
    block table: q (B, H, T, D) float32 / bfloat16 / float16; k_cache and v_cache (num_blocks,
    H_kv, block_size, W) of one stored dtype (``graphs/models/kv_rows.py``: float32 / bfloat16 /
    float16 / float8_e4m3fn with W = D, or int8 rows of D values and their fp32 scale, W = D + 4),
    last dim contiguous; block_table (B, N) int32 or int64: row b's position j lies in block
    ``block_table[b, j // block_size]`` at offset ``j % block_size`` (block_size =
    ``k_cache.shape[2]``; the slots layout is N = 1, block_size = sequence length, block_table =
    ``seq_ids[:, None]``); mask (B, 1, T, S) bool (True = attend) -> (B, H, T, D) in q.dtype.
    Only the first ceil(S / block_size) columns of the table are read (later ones may hold
    anything). Grouped-query (head h reads KV head h // (H / H_kv), HF ``repeat_kv``), scale
    1/sqrt(D), fp32 math, except q . k over int8 rows: each query row is rounded to int16 with
    one scale (its largest |q| / 32767) and its products with the keys' int8 values sum exactly
    in int32 (one whose largest |q| is below 1e-30 multiplies as zeros). A NaN or +inf score at
    an attended position (a NaN or inf in the query or an attended key) makes that token's output
    NaN, as SDPA's softmax does. What positions the mask hides hold (stale rows, NaN) never
    reaches the output (their scores are replaced by -inf, their values never added), and a
    token that attends no position gets zeros. Reference: ``bundles.gathered_attention`` (q unrounded).
    Raises RuntimeError for a block_table that is not 2-D (B, N) int32 / int64, a block_size
    that is not a multiple of 4 when N > 1, S above N * block_size, a read entry outside [0,
    num_blocks), or int8 rows of a head dim above 512. Needs :func:`small_gemm_available`."""
    return torch.ops.neuronfx.cached_attention(q, k_cache, v_cache, block_table, mask)


def store_int8_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                  offsets: torch.Tensor) -> None:
    """Write K and V rows into int8 KV caches in place (``csrc/kv_write.cpp``): k and v (B, T,
    H_kv, D) float32 / bfloat16 / float16, any strides, quantized as ``kv_rows.quantize_rows``
    does in eager torch (the same bits: D int8 values, then the fp32 scale absmax / 127 as 4
    bytes), row (b, t, h) into ``cache[blocks[b, t], h, offsets[b, t]]``; k_cache and v_cache
    (num_blocks, H_kv, block_size, D + 4) int8 with a contiguous last dim, blocks and offsets
    (B, T) int64. Raises RuntimeError for other shapes or dtypes, or a block or offset outside
    the caches. Needs :func:`small_gemm_available`."""
    torch.ops.neuronfx.store_int8_kv(k_cache, v_cache, k, v, blocks, offsets)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill attention under the causal mask (``csrc/causal_attention.cpp``): q (B, H, T, D), k
    and v (B, H_kv, T, D), float32, any strides with a contiguous last dim; ``lengths`` (B,) int32
    or int64, or None for T: row b's tokens from ``lengths[b]`` on (a shorter prompt's pads) are
    not computed and come out as zeros -> (B, H, T, D) float32, a view of a (B, T, H, D) tensor
    (the layout the output projection reads). Token i attends
    tokens 0..i, query head h reads KV head h // (H / H_kv) (HF's ``repeat_kv``), scale 1 /
    sqrt(D): ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` up to
    the summation order. Only the causal triangle is computed: tiles of 8 query rows against the
    keys up to their last row, the scores in a buffer that stays in cache; later tokens' finite
    keys and values in a tile's last 32-key step are masked or weighted 0, so they never change
    token i's bits (an inf or NaN there would, as in torch's flash attention). RuntimeError for inputs that are not 4-D
    float32 of those shapes, H not a multiple of H_kv, or lengths not (B,) int32 / int64 (values
    outside [0, T] are clamped to it)."""
    return torch.ops.neuronfx.causal_attention(q, k, v, lengths)


def causal_attention_isa() -> str:
    """The SIMD path ``csrc/causal_attention.cpp`` was built with: "avx512" (tiles of 8 rows x 32
    keys), "avx2" (4 x 16), or "scalar" loops (correct and slow: the CPU ops bundle keeps torch's
    SDPA on such CPUs)."""
    _loaded()
    return str(torch.ops.neuronfx.causal_attention_isa())


QUANT_FORMAT_IDS = {"int8": 0, "int4": 1, "q4_0": 2, "q4_1": 3, "q8_0": 4}
"""The ``format`` argument of ``neuronfx::quant_gemm`` per format name (``quant.FORMAT_NAMES``);
the C++ ``Format`` enum."""


def _quant_args(q: QuantizedWeight) -> tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(format id, data, scale or None, offset or None) of a quantized weight record."""
    scale = q.scale if isinstance(q, (Int8Weight, Int4Weight)) else None
    offset = q.offset if isinstance(q, Int4Weight) else None
    return QUANT_FORMAT_IDS[FORMAT_NAMES[type(q)]], q.data, scale, offset


def quant_gemm(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None = None, int8_x: bool = False) -> torch.Tensor:
    """x (..., K) float32 or bfloat16 @ dequantize(q).T (+ bias (N,)) -> (..., N) in x.dtype; the
    weights are widened in registers, products accumulate in fp32 (x is never quantized). Any
    number of rows (the kernel is meant for decode, <= :data:`SMALL_GEMM_MAX_ROWS`: weights are
    read once per call). int4 group sizes must be multiples of 32. Reference:
    ``quant.reference_linear``. Needs :func:`small_gemm_available` to have returned True.

    ``int8_x`` (4-bit formats: Q4_0, Q4_1, int4 with groups of 32 or a multiple of 64; ignored
    for the others): llama.cpp's integer products instead. x is rounded to int8 with one scale
    (absmax / 127) per 32 values, each 32-weight block's nibble x int8 products are summed
    exactly in int32 (AVX512-VNNI where the CPU has it, :func:`quant_int8_x_isa`), then scaled
    and accumulated in fp32; the offsets' share uses x's exact sums. The error added is x's
    rounding: at most ``absmax / 254`` per value of each 32."""
    fmt, data, scale, offset = _quant_args(q)
    return torch.ops.neuronfx.quant_gemm(x, data, scale, offset, fmt, bias, int8_x)


def quant_prefill(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) float32 @ dequantize(q).T (+ bias (N,)) -> (..., N) float32 for many rows
    (prefill): tiles of about 1 MiB of weight rows are dequantized into a buffer that stays in
    cache and multiplied by torch's fp32 GEMM (``csrc/quant_prefill.cpp``), so no float copy of
    the whole weight is made. The values are ``quant.dequantize``'s; the result equals
    ``F.linear(x, dequantize(q, K))`` up to the GEMM's summation order. RuntimeError for x not
    float32, blocks / groups that do not match K, data, scales or offsets of the wrong dtype or
    shape, or a bias that is not (N,). Needs :func:`small_gemm_available`."""
    fmt, data, scale, offset = _quant_args(q)
    return torch.ops.neuronfx.quant_prefill(x, data, scale, offset, fmt, bias)


def w8a8_gemm(x: torch.Tensor, q: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``int8_x.w8a8_linear`` for decode rows (<= :data:`SMALL_GEMM_MAX_ROWS`): x (..., K) float32
    or bfloat16 rounded per row exactly as ``int8_x.int8_rows``, the int8 x int8 products summed
    exactly in int32 (AVX512-VNNI ``vpdpbusd`` or AVX2 ``vpmaddwd``, :func:`w8a8_isa`; each
    weight row read once against every row), scaled by x's and the weight's scales in fp32
    (+ bias (N,)) -> (..., N) in x.dtype (``csrc/w8a8_gemm.cpp``). torch's ``_int_mm`` reads
    such small-M products slowly and rounds and scales in separate ops. RuntimeError for data
    that is not a contiguous int8 (N, K), or x, scale or bias of the wrong shape."""
    return torch.ops.neuronfx.w8a8_gemm(x, q.data, q.scale, bias)


def w8a8_packed(x: torch.Tensor, q: Int8Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``int8_x.w8a8_linear`` on a packed int8 weight (``quant.Int8Packed``), any number of rows:
    x (..., K) float32 or bfloat16 rounded per row as ``int8_x.int8_rows`` (rows in parallel past
    16), the int8 x int8 products of 16 output channels per ``vpdpbusd`` summed exactly in int32
    (AVX2: ``vpmaddwd`` on the weight's bytes split into int16; :func:`w8a8_isa`), scaled by
    x's and the weight's scales in fp32 (+ bias (N,)) -> (..., N) in x.dtype, the bits of :func:`w8a8_gemm` (``csrc/w8a8_gemm.cpp``).
    Measured on SmolLM2's gate (1,536 x 576), 8 rows, one thread, weights in cache: about 4x
    :func:`w8a8_gemm`, whose row-major weight needs a horizontal sum per output. RuntimeError
    for data that is not a contiguous uint8 (N / 16, K / 4, 64), or x, scale or bias of the
    wrong shape."""
    return torch.ops.neuronfx.w8a8_packed(x, q.data, q.scale, bias)


def w8a8_packed_multi(x: torch.Tensor, weights: list[Int8Packed], biases: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """``[w8a8_packed(x, q, b) for q, b in zip(weights, biases)]`` in one call (fused Q/K/V
    projections): x rounded once, one parallel region over every weight's blocks, the same bits.
    Views of the op's one (..., sum N) output; ValueError for more than :data:`MAX_FUSED` weights
    or a bias list of another length; RuntimeError as :func:`w8a8_packed`."""
    _check_fused(len(weights), len(biases))
    args = [t for q, b in zip(weights, biases) for t in (q.data, q.scale, b)]
    out = torch.ops.neuronfx.w8a8_packed_multi(x, *args, *[None] * (3 * (MAX_FUSED - len(weights))))
    return list(out.split([q.scale.shape[0] for q in weights], dim=-1))


def w8a8_packed_glu(x: torch.Tensor, gate: Int8Packed, up: Int8Packed) -> torch.Tensor:
    """``silu(w8a8_packed(x, gate)) * w8a8_packed(x, up)`` -> (..., N) in x.dtype in one call: x
    rounded once, each product's fp32 values those of :func:`w8a8_packed`, the gated product
    formed in fp32 (``std::exp``, within an ulp or two of torch's silu) and rounded once.
    RuntimeError as :func:`w8a8_packed`, or for gate and up of different N."""
    return torch.ops.neuronfx.w8a8_packed_glu(x, gate.data, gate.scale, up.data, up.scale)


def w4a8_packed(x: torch.Tensor, q: Int4Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``int8_x.w4a8_linear`` on a packed 4-bit weight (``quant.Int4Packed``: int4 in groups of
    32, Q4_0 or Q4_1), any number of rows, the same bits: x (..., K) float32 or bfloat16
    rounded per group of 32 values as ``int8_x.int8_groups`` (a group holding NaN gives NaN),
    per group the nibble x int8 products of 16 output channels summed exactly in int32 by
    ``vpdpbusd`` (AVX2: ``vpmaddubsw``, summed in int16 per group, exact; :func:`w8a8_isa`), then
    scaled in fp32 (+ bias (N,)) -> (..., N) in x.dtype (``csrc/w8a8_gemm.cpp``), as OpenVINO's int4 weights with dynamic
    int8 activations in groups of 32. RuntimeError for data that is not a contiguous uint8
    (N / 16, K / 32, 320 or 384), or x or bias of the wrong shape."""
    return torch.ops.neuronfx.w4a8_packed(x, q.data, bias)


def w4a8_packed_multi(x: torch.Tensor, weights: list[Int4Packed], biases: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """``[w4a8_packed(x, q, b) for q, b in zip(weights, biases)]`` in one call (fused Q/K/V): x
    rounded once, one parallel region, the same bits; views of one (..., sum N) output.
    ValueError for more than :data:`MAX_FUSED` weights or a bias list of another length;
    RuntimeError as :func:`w4a8_packed`."""
    _check_fused(len(weights), len(biases))
    args = [t for q, b in zip(weights, biases) for t in (q.data, b)]
    out = torch.ops.neuronfx.w4a8_packed_multi(x, *args, *[None] * (2 * (MAX_FUSED - len(weights))))
    return list(out.split([16 * q.data.shape[0] for q in weights], dim=-1))


def w4a8_packed_glu(x: torch.Tensor, gate: Int4Packed, up: Int4Packed) -> torch.Tensor:
    """``silu(w4a8_packed(x, gate)) * w4a8_packed(x, up)`` -> (..., N) in x.dtype in one call, the
    gated product formed as :func:`w8a8_packed_glu` does. RuntimeError as :func:`w4a8_packed`,
    or for gate and up of different N."""
    return torch.ops.neuronfx.w4a8_packed_glu(x, gate.data, up.data)


def w8a8_isa() -> str:
    """The SIMD path ``csrc/w8a8_gemm.cpp`` was built with: "vnni" (AVX512-VNNI ``vpdpbusd``),
    "avx2" (``vpmaddwd`` for int8 weights, ``vpmaddubsw`` for 4-bit ones) or "scalar"; every
    path sums the same integers exactly, so they give the same bits."""
    _loaded()
    return str(torch.ops.neuronfx.w8a8_isa())


def same_quant_layout(weights: list) -> bool:
    """True when every weight is a quantized record of one format and one group size: what one
    :func:`quant_gemm_multi` or :func:`quant_glu` call serves."""
    if not all(isinstance(w, QUANTIZED_TYPES) for w in weights) or len({type(w) for w in weights}) != 1:
        return False
    return not isinstance(weights[0], Int4Weight) or len({2 * w.data.shape[1] // w.scale.shape[1] for w in weights}) == 1


def quant_gemm_multi(x: torch.Tensor, weights: list[QuantizedWeight], biases: list[torch.Tensor | None],
                     int8_x: bool = False) -> list[torch.Tensor]:
    """``[quant_gemm(x, q, b, int8_x) for q, b in zip(weights, biases)]`` in one call and one
    parallel region (fused Q/K/V projections): x widened (and rounded) once, one fork/join. The
    weights share format, K and group size (:func:`same_quant_layout`); RuntimeError otherwise;
    ValueError as :func:`small_gemm_multi`.
    Views of the op's one (..., sum N) output, as :func:`small_gemm_multi`."""
    _check_fused(len(weights), len(biases))
    args = [_quant_args(q) for q in weights]
    per_weight = [t for (_, data, scale, offset), bias in zip(args, biases) for t in (data, scale, offset, bias)]
    pad = [None] * (4 * (MAX_FUSED - len(weights)))
    out = torch.ops.neuronfx.quant_gemm_multi(x, args[0][0], int8_x, *per_weight, *pad)
    return list(out.split([a[1].shape[0] for a in args], dim=-1))  # views of the op's one output


def quant_glu(x: torch.Tensor, gate: QuantizedWeight, up: QuantizedWeight, int8_x: bool = False) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` -> (..., N) in x.dtype for quantized gate and up of one
    format and group size, in one call, formed from the fp32 accumulators and rounded once (as
    :func:`small_glu`); ``int8_x`` as :func:`quant_gemm`."""
    fmt, g, gs, go = _quant_args(gate)
    _, u, us, uo = _quant_args(up)
    return torch.ops.neuronfx.quant_glu(x, g, gs, go, u, us, uo, fmt, int8_x)


def _loaded() -> None:
    """Build or load the kernel library; RuntimeError when it is unavailable here."""
    if not small_gemm_available():
        raise RuntimeError("the neuronfx kernel library is unavailable (NEURONFX_KERNELS=0, or no C++ compiler: see the "
                           "warning above); the products fall back to torch.")


def quant_isa() -> str:
    """The SIMD path the quantized kernel was compiled with on this machine: ``"avx512"`` (16
    fp32 lanes), ``"avx2"`` (AVX2 + FMA + F16C, 8 lanes) or ``"scalar"``. Builds the kernel
    library on first use (:func:`small_gemm_available`); RuntimeError where it cannot."""
    _loaded()
    return torch.ops.neuronfx.quant_isa()


def quant_int8_x_isa() -> str:
    """The path of the int8-activation products (``int8_x``): ``"avx512-vnni"`` (``vpdpbusd``,
    64 products per instruction) or ``"scalar"`` (portable integer loops: correct, slow). Builds
    the kernel library on first use, as :func:`quant_isa`."""
    _loaded()
    return torch.ops.neuronfx.quant_int8_x_isa()


def argmax_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, V) float32, V >= 1 -> (argmax (N,) int32, finite (N,) bool): each row's
    ``torch.argmax`` (the first index of its largest value, or of its first NaN: NaN ranks above
    every number) and ``torch.isfinite(row).all()``, in one pass per row (16 lanes on AVX-512, 8
    on AVX2, each keeping its first index of its largest value; short rows scalar;
    ``csrc/topk.cpp``), rows in parallel. A verify pass's
    5 x 49,152 logits: inductor's fused argmax and isfinite 0.36 ms, this about 0.05 ms (2
    threads, 2026-12-07). RuntimeError for x not (N, V) float32 or V outside [1, 2^31). Needs
    :func:`small_gemm_available`."""
    return torch.ops.neuronfx.argmax_rows(x)


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=-1)`` of x (B, V) float32: (values (B, k) float32 sorted
    descending, indices (B, k) int64), NaN above every number; equal values in index order (torch
    leaves their order open). Each row is scanned once against its k-th best value so far
    (``csrc/topk.cpp``): SmolLM2's vocabulary (49,152), k = 256, 8 rows: see
    docs/performance.md. RuntimeError for k outside [1, V]. Needs :func:`small_gemm_available`."""
    return torch.ops.neuronfx.topk_rows(x, k)

