"""Ops bundles (``graphs.models.ops.Ops``): the kernels a graph's math calls, chosen when the
graph is built.

Model math (the family files, ``models/layers.py``, ``phases/``) never asks whether it is being
compiled or on which CPU it runs: it calls ``ops.linear``, ``ops.attention`` and so on, and the
backend hands it a bundle. :data:`REFERENCE_OPS` is plain torch (eager and export, the
reference every test compares with, and what the inductor backend binds on CUDA, see
:func:`compiled_ops`); :func:`cpu_kernel_ops` is what the inductor backend binds on a CPU:
neuronfx's ``small_gemm`` kernels for products of few rows (decode), fp32 products where the
CPU has no native 16-bit GEMM, and decode attention as one ``cached_attention`` kernel call
(fp32 reductions that inductor fuses where the kernels do not build). Each kernel op is tested
against its reference op (tests/test_kernels.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import attrs
import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from neuronfx.graphs.kernels import library as cpu_kernels
from neuronfx.graphs.kernels.activation_choice import FLOAT_PATHS, Int8Paths
from neuronfx.graphs.kernels.gemm_choice import widen_16bit_prefill
from neuronfx.graphs.kernels.library import (
    PACKED_KERNEL_MAX_ROWS,
    SMALL_GEMM_MAX_ROWS,
    small_gemm,
    small_gemm_available,
    small_gemm_multi,
    small_glu,
)
from neuronfx.graphs.models import int8_x, quant
from neuronfx.graphs.models.kv_rows import load_rows, window_rows
from neuronfx.graphs.models.ops import Ops, Weight, torch_argmax, torch_topk, write_kv

Tensor = torch.Tensor


# --- reference ops (plain torch) ----------------------------------------------------------------


def reference_linear(x: Tensor, weight: Weight, bias: Tensor | None = None) -> Tensor:
    """F.linear; a quantized weight (``graphs/models/quant.py``) is dequantized to fp32 first and the
    product taken in fp32 (``quant.reference_linear``)."""
    if isinstance(weight, quant.QUANTIZED_TYPES):
        return quant.reference_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def reference_projections(x: Tensor, weights: Sequence[Weight], biases: Sequence[Tensor | None]) -> list[Tensor]:
    return [reference_linear(x, w, b) for w, b in zip(weights, biases)]


def reference_glu(x: Tensor, gate: Weight, up: Weight) -> Tensor:
    """SwiGLU's gated product (Shazeer 2020): silu(x @ gate.T) * (x @ up.T)."""
    return F.silu(reference_linear(x, gate)) * reference_linear(x, up)


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Grouped-query attention with a boolean mask (True = attend), torch's SDPA."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def causal_sdpa(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor | None = None) -> Tensor:
    """:func:`sdpa` with SDPA's own causal mask (``is_causal``): torch's CPU flash attention then
    skips the blocks above the diagonal (measured: 30% less time at 1,024 tokens, 9 heads of 64).
    ``lengths`` (the rows' real tokens) is not used: every pad token is computed too."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def gathered_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, bucket: int, mask: Tensor) -> Tensor:
    """Reference cached attention: copy each row's first ``bucket`` cache positions through its
    block table (``kv_rows.window_rows``: k/v_cache (num_blocks, H_kv, block_size, W) with
    block_size = ``k_cache.shape[2]``, block_table (B, N) int; the slots layout passes
    ``seq_ids[:, None]``), zero the positions no new token attends (past the row's last new
    token, or outside every sliding window), then :func:`sdpa`. The zeroing matters: a masked
    NaN still poisons SDPA (NaN score + -inf mask is NaN; 0 weight * NaN value is NaN)."""
    hidden = ~mask.any(dim=2)[..., None]  # (B, 1, S, 1): attended by no new token (past the last, or out of every window)
    keys = load_rows(window_rows(k_cache, block_table, bucket), q.dtype).masked_fill(hidden, 0.0)  # (B, n_kv, S, D)
    values = load_rows(window_rows(v_cache, block_table, bucket), q.dtype).masked_fill(hidden, 0.0)
    return sdpa(q, keys, values, mask)


REFERENCE_OPS = Ops(
    name="reference", linear=reference_linear, head_linear=reference_linear, projections=reference_projections, glu=reference_glu,
    attention=sdpa, causal_attention=causal_sdpa, cached_attention=gathered_attention,
)
"""Plain torch ops: the eager and export backends, and the reference of every kernel op."""


# --- CPU kernel ops (inductor) ------------------------------------------------------------------


def _rows(x: Tensor) -> int:
    return x.numel() // x.shape[-1]


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., in) @ weight.T as a sum over ``in`` of fp32 products, cast back to x.dtype: one
    streaming loop under inductor for a single row of 16-bit weights when the kernels are off."""
    # as_strided makes inductor realize x: otherwise it inlines x's producer (an RMSNorm or
    # SiLU) into the reduction and recomputes it for every output row.
    x32 = x.float().contiguous()
    x32 = x32.as_strided(x32.shape, x32.stride())
    out = (x32[..., None, :] * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def _dense_kernel(x: Tensor, weights: Sequence[Weight], kernels: bool, fp32_rows: int) -> bool:
    """Whether ``small_gemm`` serves these float weights: up to SMALL_GEMM_MAX_ROWS rows, fp32
    weights up to ``fp32_rows`` (``library.fp32_kernel_rows``: where its 4 x 3 tiles measured
    faster than torch's GEMM) where the row count is static: a prefill graph that the buckets
    share (its rows a symbol) gets no new guard, so explicit buckets on both sides of the limit
    still compile one version."""
    if not kernels or _any_quantized(weights):
        return False
    rows = _rows(x)
    fp32 = all(w.dtype == torch.float32 for w in weights)
    return rows <= SMALL_GEMM_MAX_ROWS or (fp32 and statically_known_true(rows <= fp32_rows))


def cpu_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, kernels: bool, widen: bool,
               int8: Int8Paths = FLOAT_PATHS, fp32_rows: int = SMALL_GEMM_MAX_ROWS) -> Tensor:
    """Kernel choice from static shapes: up to SMALL_GEMM_MAX_ROWS rows (fp32 weights:
    ``fp32_rows``, ``library.fp32_kernel_rows()`` in :func:`cpu_kernel_ops`) run ``small_gemm``
    (each weight row streamed once, fp32 accumulation; torch's GEMM paths stream small-M
    products slowly); without the kernels a single row of 16-bit weights is :func:`gemv`;
    ``widen`` (16-bit weights on a CPU without native bf16 GEMM, where oneDNN emulates it about
    4x slower than fp32) multiplies in fp32; everything else is F.linear. Quantized weights:
    :func:`quantized_linear` (``int8``: the paths that take int8 activations)."""
    rows = _rows(x)
    if isinstance(weight, quant.QUANTIZED_TYPES):
        return quantized_linear(x, weight, bias, kernels=kernels, widen=widen, int8=int8)
    if _dense_kernel(x, (weight,), kernels, fp32_rows):
        return small_gemm(x, weight, bias)
    if weight.dtype != torch.float32 and rows == 1:
        return gemv(x, weight, bias)
    if widen:
        out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(x.dtype)
    return F.linear(x, weight, bias)


def quantized_linear(x: Tensor, weight: quant.QuantizedWeight, bias: Tensor | None = None, *, kernels: bool,
                     widen: bool, int8: Int8Paths = FLOAT_PATHS) -> Tensor:
    """A quantized weight's product: packed 4-bit weights (``quant.Int4Packed``) multiply int8 x
    at any rows (``library.w4a8_packed``); packed int8 weights (``quant.Int8Packed``) multiply int8 x in
    integers at any rows (``library.w8a8_packed`` up to :data:`PACKED_KERNEL_MAX_ROWS`, then
    ``int8_x.w8a8_linear`` on their row-major copy); int8 weights on a path ``int8`` enables multiply in integers
    (decode rows: ``library.w8a8_gemm``; more: ``int8_x.w8a8_linear``, equal bit for bit); up to
    SMALL_GEMM_MAX_ROWS rows run ``quant_gemm`` (the quantized
    bytes read once, fp32 accumulation; 4-bit weights on an enabled path round x to int8 per 32
    values, ``library.quant_gemm``); more rows (prefill) run ``library.quant_prefill`` (tiles of
    the weight dequantized in cache, then fp32 GEMM) for fp32 plans and 16-bit plans that
    ``widen``; else (no kernels, or a native 16-bit GEMM) the weight is dequantized whole and
    multiplied in x's dtype."""
    rows = _rows(x)
    if isinstance(weight, quant.Int4Packed):  # packed where every product of 4-bit weights takes int8 x
        return cpu_kernels.w4a8_packed(x, weight, bias) if kernels else int8_x.w4a8_linear(x, weight, bias)
    if isinstance(weight, quant.Int8Packed):  # packed where every product of int8 weights takes int8 x
        return cpu_kernels.w8a8_packed(x, weight, bias) if _packed_kernel(x, kernels) else int8_x.w8a8_linear(x, weight, bias)
    if int8.integer_gemm(weight, rows):
        if kernels and rows <= SMALL_GEMM_MAX_ROWS:  # the same integers and bits; _int_mm reads small M slowly
            return cpu_kernels.w8a8_gemm(x, weight, bias)
        return int8_x.w8a8_linear(x, weight, bias)
    if kernels and rows <= SMALL_GEMM_MAX_ROWS:
        return cpu_kernels.quant_gemm(x, weight, bias, int8.uses(weight, rows))
    if kernels and (x.dtype == torch.float32 or widen):
        return cpu_kernels.quant_prefill(x.float(), weight, bias).to(x.dtype)
    dense = quant.dequantize(weight, x.shape[-1])
    if x.dtype == torch.float32 or widen:
        return F.linear(x.float(), dense, None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, dense.to(x.dtype), bias)


def _packed_kernel(x: Tensor, kernels: bool) -> bool:
    return kernels and _rows(x) <= PACKED_KERNEL_MAX_ROWS


def _any_quantized(weights: Sequence[Weight]) -> bool:
    return any(isinstance(w, quant.QUANTIZED_TYPES) for w in weights)


def _one_kernel_call(x: Tensor, weights: Sequence[Weight], kernels: bool, int8: Int8Paths) -> bool:
    """Whether one fused quantized kernel call serves these weights: decode rows, one layout,
    and no int8 weight on an integer-GEMM path (that one is torch's ``_int_mm``)."""
    rows = _rows(x)
    return (kernels and rows <= SMALL_GEMM_MAX_ROWS and cpu_kernels.same_quant_layout(list(weights))
            and not int8.integer_gemm(weights[0], rows))


def cpu_projections(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None], *, kernels: bool,
                    widen: bool, int8: Int8Paths = FLOAT_PATHS, fp32_rows: int = SMALL_GEMM_MAX_ROWS) -> list[Tensor]:
    """Q/K/V: one ``small_gemm_multi`` call (one parallel region) on the kernel path, one
    ``w8a8_packed_multi`` / ``w4a8_packed_multi`` for packed int8 / 4-bit weights (any rows), or one ``quant_gemm_multi`` for
    quantized weights of one format and group size; otherwise one product each."""
    if _dense_kernel(x, weights, kernels, fp32_rows):
        return small_gemm_multi(x, list(weights), list(biases))
    # the weights' type first: the row test would guard a prefill's dynamic bucket in every plan
    if all(isinstance(w, quant.Int8Packed) for w in weights) and _packed_kernel(x, kernels):
        return cpu_kernels.w8a8_packed_multi(x, list(weights), list(biases))
    if all(isinstance(w, quant.Int4Packed) for w in weights) and kernels:
        return cpu_kernels.w4a8_packed_multi(x, list(weights), list(biases))
    if _one_kernel_call(x, weights, kernels, int8):
        return cpu_kernels.quant_gemm_multi(x, list(weights), list(biases), int8.uses(weights[0], _rows(x)))
    return [cpu_linear(x, w, b, kernels=kernels, widen=widen, int8=int8, fp32_rows=fp32_rows) for w, b in zip(weights, biases)]


def cpu_glu(x: Tensor, gate: Tensor, up: Tensor, *, kernels: bool, widen: bool, int8: Int8Paths = FLOAT_PATHS,
            fp32_rows: int = SMALL_GEMM_MAX_ROWS) -> Tensor:
    """SwiGLU's gated product; on the kernel path ``small_glu`` (float weights), ``w8a8_packed_glu``
    / ``w4a8_packed_glu`` (packed int8 / 4-bit, any rows) or ``quant_glu`` (quantized, one format and group size) forms it from
    the fp32 values and rounds once."""
    if _dense_kernel(x, (gate, up), kernels, fp32_rows):
        return small_glu(x, gate, up)
    if isinstance(gate, quant.Int8Packed) and isinstance(up, quant.Int8Packed) and _packed_kernel(x, kernels):
        return cpu_kernels.w8a8_packed_glu(x, gate, up)
    if isinstance(gate, quant.Int4Packed) and isinstance(up, quant.Int4Packed) and kernels:
        return cpu_kernels.w4a8_packed_glu(x, gate, up)
    if _one_kernel_call(x, (gate, up), kernels, int8):
        return cpu_kernels.quant_glu(x, gate, up, int8.uses(gate, _rows(x)))
    linear = functools.partial(cpu_linear, kernels=kernels, widen=widen, int8=int8, fp32_rows=fp32_rows)
    return F.silu(linear(x, gate)) * linear(x, up)


def sdpa_fp32(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """:func:`sdpa` computed in fp32 and cast back: torch's CPU flash attention in bf16 measured
    about 3x slower than in fp32 without native bf16 (prefill of 128 tokens, AVX2)."""
    return sdpa(q.float(), k.float(), v.float(), mask).to(q.dtype)


def causal_sdpa_fp32(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor | None = None) -> Tensor:
    """:func:`causal_sdpa` in fp32, cast back (as :func:`sdpa_fp32`)."""
    return causal_sdpa(q.float(), k.float(), v.float()).to(q.dtype)


def fused_cached_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, bucket: int, mask: Tensor) -> Tensor:
    """Cached attention written as fp32 reductions, which inductor fuses with the block-table
    gather (``kv_rows.window_rows``) and the mask into a few loops instead of copying the window
    and calling SDPA (about 0.1-1 ms per call on CPU at decode sizes, more in bf16). Arguments and
    math as :func:`gathered_attention` (block_size = ``k_cache.shape[2]``, block_table (B, N),
    the slots layout ``seq_ids[:, None]``): head h reads KV head h // (H / H_kv) as HF
    ``repeat_kv``; masked positions are selected away, never multiplied, so NaN there cannot leak."""
    b, h, t, d = q.shape
    n_kv = k_cache.shape[1]
    g = h // n_kv
    keys = load_rows(window_rows(k_cache, block_table, bucket), torch.float32)  # (B, n_kv, S, D)
    values = load_rows(window_rows(v_cache, block_table, bucket), torch.float32)
    qg = q.float().reshape(b, n_kv, g * t, d) * (1.0 / math.sqrt(d))  # query heads of one KV head
    scores = (qg[:, :, :, None, :] * keys[:, :, None, :, :]).sum(-1)  # (B, n_kv, G*T, S)
    m = mask[:, :, None].expand(b, 1, g, t, bucket).reshape(b, 1, g * t, bucket)
    p = torch.softmax(scores.masked_fill(~m, float("-inf")), dim=-1)
    out = torch.where(m[..., None], p[..., None] * values[:, :, None, :, :], 0.0).sum(-2)  # (B, n_kv, G*T, D)
    return out.reshape(b, h, t, d).to(q.dtype)


def kernel_causal_attention(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor | None = None) -> Tensor:
    """Prefill's causal attention as one ``neuronfx::causal_attention`` call in fp32, cast back to
    q's dtype (arguments as :func:`causal_sdpa`): only the causal triangle of each row's first
    ``lengths`` tokens is computed (its pads come out as zeros), tiles of 8 queries against the
    keys up to their last row. Against torch's flash attention (SDPA with
    ``is_causal``), one layer of SmolLM2 (9 heads over 3 KV heads of 64), 2 threads of an AVX-512
    EPYC: 0.16 against 0.30 ms at 128 tokens, 1.20 against 2.41 at 8 rows of 128, 7.1 against
    12.4 at 1,024; its AVX2 build 1.06-1.45x SDPA on the same machine (docs/performance.md, CPU
    kernels)."""
    return cpu_kernels.causal_attention(q.float(), k.float(), v.float(), lengths).to(q.dtype)


def kernel_cached_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, bucket: int, mask: Tensor) -> Tensor:
    """Cached attention as one ``neuronfx::cached_attention`` call (``csrc/small_gemm.cpp``):
    each task reads one query head's keys and values once, where inductor's fusion of
    :func:`fused_cached_attention` took about 70 us per SmolLM2 layer at decode (9 heads, 256
    positions) against 12-16 us for the kernel (a microbenchmark of that shape). It walks each
    row's blocks through block_table (B, N) int32 / int64 (block_size = ``k_cache.shape[2]``; the
    slots layout passes ``seq_ids[:, None]``). Same math and masking as :func:`gathered_attention`;
    ``bucket`` is the mask's last dim. RuntimeError as ``library.cached_attention`` (a bad table)."""
    return cpu_kernels.cached_attention(q, k_cache, v_cache, block_table, mask)


def kernel_argmax(x: Tensor) -> tuple[Tensor, Tensor]:
    """``ops.argmax`` (``models/ops.torch_argmax``) as one ``neuronfx::argmax_rows`` call over
    x's rows (..., V) float32 -> ((...) int32, (...) bool); the same values."""
    arg, finite = cpu_kernels.argmax_rows(x.reshape(-1, x.shape[-1]))
    return arg.view(x.shape[:-1]), finite.view(x.shape[:-1])


def kernel_store_kv(k_cache: Tensor, v_cache: Tensor, blocks: Tensor, offsets: Tensor, k: Tensor, v: Tensor) -> None:
    """``ops.store_kv`` (``models/ops.write_kv``) with int8 caches' rows quantized and written by
    one ``neuronfx::store_int8_kv`` call (``csrc/kv_write.cpp``, the same bits as eager
    ``kv_rows.quantize_rows``): inductor's code for that write built each 68-byte row in int64
    index vectors, 0.8 ms of a batch-8 SmolLM2 step against the bf16 cache's write. Other caches
    as :func:`~neuronfx.graphs.models.ops.write_kv`. Shapes and dtypes as ``write_kv``; raises
    RuntimeError (int8, ``library.store_int8_kv``) or IndexError (others) for a block or offset
    outside the caches."""
    if k_cache.dtype == torch.int8:
        cpu_kernels.store_int8_kv(k_cache, v_cache, k, v, blocks, offsets)
        return
    write_kv(k_cache, v_cache, blocks, offsets, k, v)


def cpu_kernel_ops(dtype: str, int8: Int8Paths = FLOAT_PATHS) -> Ops:
    """The ops the inductor backend binds for a plan of ``dtype`` on this CPU, decided now:
    the ``small_gemm`` kernels when they build (``NEURONFX_KERNELS=0`` turns them off), fp32
    products and attention for 16-bit plans where a 16-bit GEMM measured slower than a widened
    one (:func:`neuronfx.graphs.kernels.gemm_choice.widen_16bit_prefill`), the cached attention kernel
    (:func:`fused_cached_attention` without the kernels), prefill's causal attention kernel where
    it has AVX-512 or AVX2 tiles and the plan computes attention in fp32 (else SDPA), and the quantized products that take
    int8 activations (``int8``, from the plan's ``activation_format``:
    ``kernels.activation_choice.int8_paths``; the 4-bit ones need the kernels, without them
    float x serves)."""
    kernels = small_gemm_available()
    widen = dtype != "float32" and widen_16bit_prefill(dtype)
    if not kernels:
        int8 = int8.without("4bit")
    fp32_rows = cpu_kernels.fp32_kernel_rows() if kernels else SMALL_GEMM_MAX_ROWS
    flags = {"kernels": kernels, "widen": widen, "int8": int8, "fp32_rows": fp32_rows}
    # the kernel where it computes in fp32 and has vector tiles; its scalar loops are slower than SDPA
    causal_kernel = kernels and (dtype == "float32" or widen) and cpu_kernels.causal_attention_isa() != "scalar"
    return Ops(
        name=(f"cpu-kernels(small_gemm={kernels}, fp32_rows={fp32_rows}, widen_16bit={widen}, int8_activations={int8.describe()}, "
              f"causal_attention={'kernel' if causal_kernel else 'sdpa'})"),
        linear=functools.partial(cpu_linear, **flags),
        head_linear=functools.partial(cpu_linear, **(flags | {"int8": int8.without("int8")})),
        projections=functools.partial(cpu_projections, **flags),
        glu=functools.partial(cpu_glu, **flags),
        attention=sdpa_fp32 if widen else sdpa,
        causal_attention=kernel_causal_attention if causal_kernel else causal_sdpa_fp32 if widen else causal_sdpa,
        cached_attention=kernel_cached_attention if kernels else fused_cached_attention,
        topk=cpu_kernels.topk_rows if kernels else torch_topk,
        argmax=kernel_argmax if kernels else torch_argmax,
        store_kv=kernel_store_kv if kernels else write_kv,
    )


def compiled_ops(dtype: str, device: str, int8: Int8Paths = FLOAT_PATHS) -> Ops:
    """The ops the inductor backend binds for a plan of ``dtype`` on ``device`` (an
    ``InferenceConfig.device``) with int8 activations on the paths ``int8``: :func:`cpu_kernel_ops` on the CPU; on CUDA the reference ops
    (F.linear is cuBLAS, SDPA picks a fused attention kernel), around which inductor generates
    Triton kernels for the norms, RoPE, masks and sampler. The ``small_gemm`` kernels are CPU
    code and are never bound on CUDA."""
    if device == "cpu":
        return cpu_kernel_ops(dtype, int8)
    return attrs.evolve(REFERENCE_OPS, name="cuda(torch+triton)")
