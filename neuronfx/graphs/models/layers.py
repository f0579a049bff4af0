"""Small shared tensor helpers for the model family files (functions, not base classes).

Numerics follow transformers' Llama implementation (``modeling_llama.py``): RMSNorm in fp32 then
cast back, RoPE cos/sin computed in fp32 from ``inv_freq @ position_ids``, rotate-half RoPE.
Products and attention go through the ops bundle the backend bound (its type: ``models/ops.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from neuronfx.config.model import ModelConfig, RopeScaling
from neuronfx.graphs.models.ops import Ops

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


def default_inv_freq(theta: float, dim: int, device: torch.device | None = None) -> torch.Tensor:
    """1 / theta^(2i / dim), float32 [dim // 2] (Su et al. 2021, RoFormer), made on ``device``
    (the graph's: a CPU constant copied in would be a host copy inside a CUDA graph)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def _llama3_inv_freq(inv: torch.Tensor, rs: RopeScaling) -> torch.Tensor:
    """Meta's ``apply_scaling`` (meta-llama/llama-models ``reference_impl/model.py``), as
    transformers' ``_compute_llama3_parameters``."""
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


def _yarn_inv_freq(theta: float, dim: int, rs: RopeScaling, device: torch.device | None = None) -> torch.Tensor:
    """YaRN (Peng et al. 2023) as transformers' ``_compute_yarn_parameters``: original
    frequencies for dims that turn more than ``beta_fast`` times in
    ``original_max_position_embeddings``, interpolated (/ factor) below ``beta_slow``, a linear
    ramp between (ends floored / ceiled when ``truncate``)."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: prevent a singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolation = 1 - ramp  # weight of the original frequency
    return (1.0 / (rs.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _longrope_inv_freq(theta: float, dim: int, factors: tuple[float, ...], device: torch.device | None = None) -> torch.Tensor:
    """LongRoPE (Ding et al. 2024): per-frequency rescale factors, transformers'
    ``_compute_longrope_parameters``."""
    # One full() per value, not torch.tensor(factors): torch.export cannot unlift a tensor
    # constant created inside a graph (RuntimeError "references nonexistent attribute lifted_tensor_0").
    ext = torch.stack([torch.full((), f, dtype=torch.float32, device=device) for f in factors])
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor transformers multiplies cos and sin by (``attention_scaling``): yarn's mscale
    ratio and longrope's sqrt(1 + ln(factor) / ln(original length)) unless the config gives
    ``attention_factor``; 1.0 for every other type."""
    rs = cfg.rope_scaling
    if rs is None or rs.rope_type not in ("yarn", "longrope"):
        return 1.0
    if rs.attention_factor is not None:
        return rs.attention_factor
    if rs.rope_type == "longrope":
        return 1.0 if rs.factor <= 1.0 else math.sqrt(1 + math.log(rs.factor) / math.log(rs.original_max_position_embeddings))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rs.mscale and rs.mscale_all_dim:
        return mscale(rs.factor, rs.mscale) / mscale(rs.factor, rs.mscale_all_dim)
    return mscale(rs.factor)


def rope_inv_freq(cfg: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """Inverse RoPE frequencies, float32 [rotary_dim // 2], of a sequence no longer than the
    model's original length: "linear" divides by ``factor``, "llama3" and "yarn" rescale per
    frequency (see their helpers); "longrope" gives its short table and "dynamic" the unscaled
    one (their tables depend on the sequence length: :func:`rope_tables`); made on ``device``."""
    dim, theta, rs = cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling
    if rs is not None and rs.rope_type == "yarn":
        return _yarn_inv_freq(theta, dim, rs, device)
    if rs is not None and rs.rope_type == "longrope":
        return _longrope_inv_freq(theta, dim, rs.short_factor, device)
    inv = default_inv_freq(theta, dim, device)
    if rs is None or rs.rope_type == "dynamic":
        return inv
    if rs.rope_type == "linear":
        return inv / rs.factor
    return _llama3_inv_freq(inv, rs)


def row_inv_freq(cfg: ModelConfig, seq_lens: torch.Tensor) -> torch.Tensor:
    """Inverse frequencies per row, float32 (B, rotary_dim // 2) (or (1, ...) when they do not
    depend on the length), for rows whose sequences hold ``seq_lens`` (B,) int tokens so far
    (their largest position + 1, the ``seq_len`` of transformers' ``dynamic_rope_update``).

    Each row is its own request, so the length-dependent types decide per row, from that row's
    length, where transformers decides once per forward call from the batch's largest position
    (the same for a batch of one):

    - "longrope": the long table where ``seq_lens > original_max_position_embeddings`` (L), else
      the short one (``longrope_frequency_update``), selected with ``torch.where``. At the switch:
      a prefill of more than L tokens is long throughout; a decode step writing position L
      (sequence L + 1) rotates its q and k with the long table, but K cached before it keeps
      its short rotation. transformers' Phi-3 ``generate`` instead recomputes the whole cache
      there, so the scheduler recomputes the slot at that token (``runtime.steps.refill_step``)
      and batch-1 greedy tokens match; other families' transformers ``generate`` keeps the short
      keys, like the plain decode step.
    - "dynamic": NTK base ``theta * (factor * L / M - (factor - 1)) ** (d / (d - 2))`` with
      ``L = max(seq_len, M)``, ``M = max_position_embeddings`` (``_compute_dynamic_ntk_parameters``
      at the current length; lengths <= M give the unscaled table, as its reset does).

    Computed in the graph from tensors (no ``.item()``, no branch on values)."""
    rs = cfg.rope_scaling
    if rs is not None and rs.rope_type == "longrope":
        dim = cfg.rotary_dim
        short = _longrope_inv_freq(cfg.rope_theta, dim, rs.short_factor, seq_lens.device)
        long = _longrope_inv_freq(cfg.rope_theta, dim, rs.long_factor, seq_lens.device)
        return torch.where((seq_lens > rs.original_max_position_embeddings)[:, None], long, short)  # (B, D/2)
    if rs is not None and rs.rope_type == "dynamic":
        dim, m = cfg.rotary_dim, cfg.max_position_embeddings
        length = torch.clamp(seq_lens.long(), min=m)  # (B,) int64 as transformers' torch.maximum
        base = cfg.rope_theta * ((rs.factor * length / m) - (rs.factor - 1)) ** (dim / (dim - 2))  # (B,) float32
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=seq_lens.device).float() / dim
        return 1.0 / (base[:, None] ** exponents[None, :])
    return rope_inv_freq(cfg, seq_lens.device)[None]


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                 attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (B, 1, T, 2 * F) in ``dtype``, for int ``position_ids`` (B, T) and
    ``inv_freq`` (F,) shared or (B, F) per row; times ``attention_factor`` (transformers'
    ``attention_scaling``) before the cast."""
    freqs = position_ids.float()[:, :, None] * inv_freq.reshape(-1, 1, inv_freq.shape[-1])  # (B, T, F)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, 2F)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def rope_tables(cfg: ModelConfig, position_ids: torch.Tensor, seq_lens: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE cos and sin (B, 1, T, rotary_dim) in ``dtype`` of ``cfg``'s scaling for
    ``position_ids`` (B, T) of rows holding ``seq_lens`` (B,) tokens so far (see
    :func:`row_inv_freq`); computed once per graph, in its prologue."""
    return rope_cos_sin(position_ids, row_inv_freq(cfg, seq_lens), dtype, rope_attention_factor(cfg))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ``cos.shape[-1]`` (rotary_dim) dims of x (B, heads, T, D);
    the other dims pass through (partial rotary, transformers' phi3 ``apply_rotary_pos_emb``)."""
    rot = cos.shape[-1]
    x_rot = x[..., :rot]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos + rotated * sin
    return out if rot == x.shape[-1] else torch.cat((out, x[..., rot:]), dim=-1)


def scale_query(cfg: ModelConfig, q: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, H, T, head_dim) with ``scale`` as its attention scale instead of 1/sqrt(head_dim):
    the ops attend at 1/sqrt(head_dim), so q is multiplied by ``scale * sqrt(head_dim)``. RoPE
    is linear, so scaling before or after it is the same."""
    return q * (scale * math.sqrt(cfg.head_dim))


def split_heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """(B, T, num_heads * head_dim) -> (B, num_heads, T, head_dim)."""
    b, t, _ = x.shape
    return x.view(b, t, num_heads, head_dim).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, head_dim) -> (B, T, heads * head_dim)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def glu_mlp(ops: Ops, lw: LayerWeights, x: torch.Tensor, bias: bool = False) -> torch.Tensor:
    """SwiGLU MLP: down(silu(gate(x)) * up(x)) (Shazeer 2020), x (B, T, hidden); gate/up
    column-parallel and down row-parallel under tensor parallelism (``ops.parallel_in/out``).
    ``bias`` (``ModelConfig.mlp_bias``, HF ``LlamaMLP``): gate/up/down biases "bgate", "bup"
    (split with their rows) and "bdown" (whole on every rank, so added after the row-parallel sum)."""
    x = ops.parallel_in(x)
    if not bias:
        return ops.parallel_out(ops.linear(ops.glu(x, lw["gate"], lw["up"]), lw["down"], None))
    gate, up = ops.projections(x, (lw["gate"], lw["up"]), (lw["bgate"], lw["bup"]))
    return ops.parallel_out(ops.linear(torch.nn.functional.silu(gate) * up, lw["down"], None)) + lw["bdown"]


def attention_output(ops: Ops, lw: LayerWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, attend: Attend, bias: bool = False) -> torch.Tensor:
    """RoPE on q (B, n_heads, T, D) and k (B, n_kv_heads, T, D), attention through ``attend``
    (which owns the KV cache), then the output projection -> (B, T, hidden), row-parallel under
    tensor parallelism (``ops.parallel_out``). ``bias`` (``ModelConfig.attention_output_bias``):
    the o_proj bias "bo", whole on every rank, added after the row-parallel sum."""
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = ops.parallel_out(ops.linear(merge_heads(attend(q, k, v)), lw["wo"], None))  # attend: (B, n_heads, T, D)
    return out + lw["bo"] if bias else out
