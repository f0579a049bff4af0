"""Small shared tensor helpers for the Llama-family model files (functions, not base classes).

Numerics follow transformers' Llama implementation (``modeling_llama.py``): RMSNorm in fp32 then
cast back, RoPE cos/sin computed in fp32 from ``inv_freq @ position_ids``, rotate-half RoPE.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from neuronfx.config.model import ModelConfig
from neuronfx.graphs.kernels import SMALL_GEMM_MAX_ROWS, small_gemm, small_gemm_available, small_gemm_multi, small_glu

LayerWeights = dict[str, torch.Tensor]
# {"embed", "norm", "lm_head": tensors, "layers": [LayerWeights per layer]}; nested so every layer
# has the same keys and one compiled layer function serves them all.
Weights = dict[str, Any]
# attend(q, k, v) -> attention output; q: (B, n_heads, T, D), k/v: (B, n_kv_heads, T, D).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 (Zhang & Sennrich 2019; HF ``LlamaRMSNorm``)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies, float32 [head_dim // 2] (Su et al. 2021, RoFormer).

    "linear" scaling divides by ``factor``; "llama3" follows Meta's ``apply_scaling``
    (meta-llama/llama-models ``reference_impl/model.py``), same as transformers'
    ``_compute_llama3_parameters``.
    """
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    if rs.rope_type == "linear":
        return inv / rs.factor
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (B, 1, T, head_dim) in ``dtype``, for int ``position_ids`` (B, T)."""
    freqs = position_ids.float()[:, :, None] * inv_freq[None, None, :]  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x (B, heads, T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ weight.T (+ bias) -> (..., out); weight (out, in) as in HF checkpoints.

    Kernel choice, fixed at trace time from static shapes, only when torch.compile traces (eager
    and export keep F.linear, the reference): up to SMALL_GEMM_MAX_ROWS rows (decode at small
    batch) run neuronfx's small_gemm kernel, which streams each weight row once in fp32 accumulation
    where torch's GEMM paths stream small-M products slowly (kernels.py); without the kernel, a
    single-row product with 16-bit weights is an explicit fp32-accumulating reduction that inductor
    turns into one streaming loop. Larger 16-bit products (prefill) multiply in fp32 on CPUs
    without native bf16 GEMM (no AVX512-BF16/AMX). Everything else is F.linear.
    """
    rows = x.numel() // x.shape[-1]
    if _small_gemm_path(x):
        return small_gemm(x, weight, bias)
    if inductor_tracing():
        if rows == 1 and weight.dtype != torch.float32:
            return gemv(x, weight, bias)
        if weight.dtype != torch.float32 and not _native_16bit_gemm():
            # Without AVX512-BF16/AMX, oneDNN emulates 16-bit GEMM about 4x slower than fp32 on
            # the same CPU (prefill, measured on AVX2): widen and multiply in fp32 instead.
            out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
            return out.to(x.dtype)
    return F.linear(x, weight, bias)


def inductor_tracing() -> bool:
    """True while torch.compile traces (not torch.export): the graph will run on this CPU through
    inductor, so CPU-specific kernel choices apply; eager and exported graphs keep the reference ops."""
    return torch.compiler.is_compiling() and not torch.compiler.is_exporting()


def _small_gemm_path(x: torch.Tensor) -> bool:
    """True while torch.compile traces (not exports) a product of at most SMALL_GEMM_MAX_ROWS
    rows of x and the kernel library is available: the decode/speculate projections."""
    rows = x.numel() // x.shape[-1]
    return inductor_tracing() and rows <= SMALL_GEMM_MAX_ROWS and _use_small_gemm()


def projections(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """``[linear(x, w, b) ...]`` for weights sharing x (Q/K/V); one kernel call on the small_gemm path."""
    if _small_gemm_path(x):
        return small_gemm_multi(x, weights, biases)
    return [linear(x, w, b) for w, b in zip(weights, biases)]


@torch.compiler.assume_constant_result
def _native_16bit_gemm() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@torch.compiler.assume_constant_result
def _use_small_gemm() -> bool:
    # Evaluated once while tracing (a constant in the graph), so building the kernel library
    # happens outside the traced code.
    return small_gemm_available()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ weight.T as sum over ``in`` of fp32 products, cast back to x.dtype."""
    # as_strided makes inductor realize x: otherwise it inlines x's producer (an RMSNorm or
    # SiLU) into the reduction and recomputes it for every output row.
    x32 = x.float().contiguous()
    x32 = x32.as_strided(x32.shape, x32.stride())
    out = (x32[..., None, :] * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def split_heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """(B, T, num_heads * head_dim) -> (B, num_heads, T, head_dim)."""
    b, t, _ = x.shape
    return x.view(b, t, num_heads, head_dim).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, head_dim) -> (B, T, heads * head_dim)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def glu_mlp(lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP: down(silu(gate(x)) * up(x)) (Shazeer 2020), x (B, T, hidden)."""
    if _small_gemm_path(x):
        return linear(small_glu(x, lw["gate"], lw["up"]), lw["down"])
    return linear(F.silu(linear(x, lw["gate"])) * linear(x, lw["up"]), lw["down"])


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention with a boolean mask (True = attend), scale 1/sqrt(head_dim).

    q (B, n_heads, Tq, D), k/v (B, n_kv_heads, Tk, D), mask (B, 1, Tq, Tk) -> (B, n_heads, Tq, D).
    Compiled 16-bit attention runs in fp32 on CPUs without native bf16 GEMM, where torch's CPU
    flash attention in bf16 measured about 3x slower than in fp32 (prefill of 128 tokens, AVX2).
    """
    if inductor_tracing() and q.dtype != torch.float32 and not _native_16bit_gemm():
        return sdpa(q.float(), k.float(), v.float(), mask).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_ids: torch.Tensor,
                     bucket: int, mask: torch.Tensor) -> torch.Tensor:
    """Attention of T new tokens over their slots' first ``bucket`` cache positions.

    q (B, n_heads, T, D); k_cache/v_cache (slots, n_kv_heads, max_len, D); seq_ids (B,) int;
    mask (B, 1, T, bucket) bool (True = attend, at least one per query) -> (B, n_heads, T, D) in
    q's dtype. Same math as :func:`sdpa` on the gathered window (scale 1/sqrt(D), head h reads KV
    head h // (n_heads / n_kv_heads) as in HF ``repeat_kv``), written as fp32 reductions so that
    inductor fuses the slot gather, masking and softmax into a few loops instead of copying the
    window and calling SDPA (which on CPU costs ~0.1-1 ms per call at decode sizes, more in bf16).
    Masked positions may hold anything, NaN included: they are selected away, never multiplied.
    """
    b, h, t, d = q.shape
    n_kv = k_cache.shape[1]
    g = h // n_kv
    keys = k_cache[:, :, :bucket][seq_ids].float()  # (B, n_kv, S, D)
    values = v_cache[:, :, :bucket][seq_ids].float()
    qg = q.float().reshape(b, n_kv, g * t, d) * (1.0 / math.sqrt(d))  # query heads of one KV head
    scores = (qg[:, :, :, None, :] * keys[:, :, None, :, :]).sum(-1)  # (B, n_kv, G*T, S)
    m = mask[:, :, None].expand(b, 1, g, t, bucket).reshape(b, 1, g * t, bucket)
    p = torch.softmax(scores.masked_fill(~m, float("-inf")), dim=-1)
    out = torch.where(m[..., None], p[..., None] * values[:, :, None, :, :], 0.0).sum(-2)  # (B, n_kv, G*T, D)
    return out.reshape(b, h, t, d).to(q.dtype)


def llama_layer(
    cfg: ModelConfig, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    attend: Attend, qk_norm: bool = False,
) -> torch.Tensor:
    """One pre-norm decoder layer shared by llama/mistral/qwen2/qwen3; h (B, T, hidden).

    q/k/v biases are used when ``cfg.attention_bias`` (qwen2; llama with attention_bias);
    ``qk_norm`` applies per-head RMSNorm to q and k before RoPE (qwen3).
    """
    eps = cfg.rms_norm_eps
    x = rms_norm(h, lw["attn_norm"], eps)
    bias = cfg.attention_bias
    biases = [lw["bq"], lw["bk"], lw["bv"]] if bias else [None, None, None]
    q, k, v = projections(x, [lw["wq"], lw["wk"], lw["wv"]], biases)
    q = split_heads(q, cfg.num_attention_heads, cfg.head_dim)
    k = split_heads(k, cfg.num_key_value_heads, cfg.head_dim)
    v = split_heads(v, cfg.num_key_value_heads, cfg.head_dim)
    if qk_norm:
        q = rms_norm(q, lw["q_norm"], eps)
        k = rms_norm(k, lw["k_norm"], eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    h = h + linear(merge_heads(attend(q, k, v)), lw["wo"])  # attend: (B, n_heads, T, D)
    return h + glu_mlp(lw, rms_norm(h, lw["mlp_norm"], eps))
