"""Small shared tensor helpers for the model family files (functions, not base classes).

Numerics follow transformers' Llama implementation (``modeling_llama.py``): RMSNorm in fp32 then
cast back, RoPE cos/sin computed in fp32 from ``inv_freq @ position_ids``, rotate-half RoPE.
Products and attention go through the ops bundle the backend bound (``ops.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from neuronfx.config.model import ModelConfig
from neuronfx.graphs.ops import Ops

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


def unit_offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm over the last dim: ``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` all in
    fp32, cast back once at the end (transformers ``Gemma3RMSNorm``; Llama's casts before
    multiplying by the weight, see transformers PR 29402)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


def final_norm(cfg: ModelConfig) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    """The RMSNorm of ``cfg``'s family: :func:`unit_offset_rms_norm` when
    ``cfg.norm_unit_offset`` (gemma3), else :func:`rms_norm`."""
    return unit_offset_rms_norm if cfg.norm_unit_offset else rms_norm


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse RoPE frequencies, float32 [head_dim // 2] (Su et al. 2021, RoFormer): of
    ``cfg.rope_theta`` with ``cfg.rope_scaling``, or with ``local`` of ``cfg.sliding_rope_theta``
    unscaled (gemma3's sliding layers). No config is built here: this runs in traced code.

    "linear" scaling divides by ``factor``; "llama3" follows Meta's ``apply_scaling``
    (meta-llama/llama-models ``reference_impl/model.py``), same as transformers'
    ``_compute_llama3_parameters``.
    """
    dim = cfg.head_dim
    theta = cfg.sliding_rope_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = None if local else cfg.rope_scaling
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


def split_heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """(B, T, num_heads * head_dim) -> (B, num_heads, T, head_dim)."""
    b, t, _ = x.shape
    return x.view(b, t, num_heads, head_dim).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, head_dim) -> (B, T, heads * head_dim)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def glu_mlp(ops: Ops, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP: down(silu(gate(x)) * up(x)) (Shazeer 2020), x (B, T, hidden); gate/up
    column-parallel and down row-parallel under tensor parallelism (``ops.parallel_in/out``)."""
    return ops.parallel_out(ops.linear(ops.glu(ops.parallel_in(x), lw["gate"], lw["up"]), lw["down"], None))


def attention_output(ops: Ops, lw: LayerWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
    """RoPE on q (B, n_heads, T, D) and k (B, n_kv_heads, T, D), attention through ``attend``
    (which owns the KV cache), then the output projection -> (B, T, hidden), row-parallel under
    tensor parallelism (``ops.parallel_out``)."""
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return ops.parallel_out(ops.linear(merge_heads(attend(q, k, v)), lw["wo"], None))  # attend: (B, n_heads, T, D)
