"""Llama 4 text model (HF ``model_type`` "llama4_text", ``Llama4ForCausalLM``): Llama's
attention with interleaved-pair RoPE, chunked local attention on RoPE layers and full attention
on NoPE layers (every ``no_rope_layer_interval``-th), L2-normalised q and k on RoPE layers
(``use_qk_norm``), attention temperature tuning of q on NoPE layers, and a mixture-of-experts
feed-forward in every layer: a sigmoid-scored top-k router whose experts take the token already
multiplied by its score, plus a shared expert. Its own options are its extras record
(``config.extras.Llama4Extras``).

The NoPE layers' "RoPE table" (this file's ``nope_cos`` hook, which the prologue calls) holds
the temperature scale of each position (cos) and 0 (sin); each layer picks its table and mask by
index and, when layers differ, reads its ``use_rope`` flag (``io.weights.layer_indices``), so
one compiled layer group serves RoPE and NoPE layers. With ``interleave_moe_layer_step`` > 1 (the 128E model) the layers outside
``moe_layers`` have a dense SwiGLU MLP instead (``dense_*`` weights of ``dense_intermediate_size``):
a layer's weights say which feed-forward it has, and the inductor backend compiles one group of
a whole number of periods of the pattern (``config.attention.layer_period``), so every group
has the same structure. Reference: transformers ``models/llama4/modeling_llama4.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neuronfx.config.model import ModelConfig
from neuronfx.graphs.models import llama, moe
from neuronfx.graphs.models.family import FamilyMath, unit_cos
from neuronfx.graphs.models.layers import Attend, LayerWeights, glu_mlp, merge_heads, rms_norm
from neuronfx.graphs.models.ops import Ops

MOE_KEY_MAP = {
    "model.layers.{i}.feed_forward.router.weight": "layers.{i}.router",
    "model.layers.{i}.feed_forward.experts.gate_up_proj": "layers.{i}.experts_gate_up_t",
    "model.layers.{i}.feed_forward.experts.down_proj": "layers.{i}.experts_down_t",
    "model.layers.{i}.feed_forward.shared_expert.gate_proj.weight": "layers.{i}.gate",
    "model.layers.{i}.feed_forward.shared_expert.up_proj.weight": "layers.{i}.up",
    "model.layers.{i}.feed_forward.shared_expert.down_proj.weight": "layers.{i}.down",
}
DENSE_KEY_MAP = {  # layers outside moe_layers: Llama4TextMLP of intermediate_size_mlp
    "model.layers.{i}.feed_forward.gate_proj.weight": "layers.{i}.dense_gate",
    "model.layers.{i}.feed_forward.up_proj.weight": "layers.{i}.dense_up",
    "model.layers.{i}.feed_forward.down_proj.weight": "layers.{i}.dense_down",
}
# Llama 4 checkpoints (hub and transformers 5 alike) keep experts fused in the layout the key map
# reads as it is: no per-expert or split views (io.weights.expert_views).
EXPERT_SOURCES = moe.ExpertSources(fused_gate_up="", per_expert={})
GATHER_MAX_ROWS = 8
"""Tokens per step up to which each token gathers its top-k experts' weights (decode: reads
k of E experts); above it every expert runs on every token with zero scores for the others."""


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """Llama's attention and norm names, the MoE feed-forward's in place of the MLP's; with
    ``moe_layers``, each layer's own (MoE or dense) names, spelled out per layer."""
    attention = llama.attention_key_map(cfg)
    if not cfg.moe_layers:
        return attention | MOE_KEY_MAP
    for i in range(cfg.num_hidden_layers):
        ffn = MOE_KEY_MAP if i in cfg.moe_layers else DENSE_KEY_MAP
        attention |= {hf.format(i=i): ours.format(i=i) for hf, ours in ffn.items()}
    return attention


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Llama's attention shapes; router (E, hidden), experts in transformers' input-major layout
    (E, hidden, 2 * I) and (E, I, hidden) (``_t``: transposed against graphs/moe.py's stacked
    experts, so no tensor-parallel rule applies to them), shared expert (I, hidden) x 2 and
    (hidden, I); with dense layers also their MLP (D, hidden) x 2 and (hidden, D)."""
    e, h, i, d = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.dense_intermediate_size
    shapes = llama.layer_shapes(cfg) | {"router": (e, h), "experts_gate_up_t": (e, h, 2 * i), "experts_down_t": (e, i, h)}
    return shapes | ({"dense_gate": (d, h), "dense_up": (d, h), "dense_down": (h, d)} if d else {})


def nope_cos(cfg: ModelConfig, position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cos table of NoPE layers (their sin is 0), (B, 1, T, rotary_dim) in ``dtype``: with
    ``attn_temperature_tuning`` each position's attention temperature
    ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`` (transformers
    ``Llama4TextAttention``, after Nakanishi 2025, arXiv:2501.19399), computed in fp32, which
    :func:`attention` multiplies q by; else ones."""
    x = cfg.extras
    if not x.attn_temperature_tuning:
        return unit_cos(cfg, position_ids, dtype)
    pos = position_ids.float()[:, None, :, None]  # (B, 1, T, 1)
    scale = torch.log1p(torch.floor((pos + 1.0) / x.floor_scale)) * x.attn_scale + 1.0
    return scale.expand(-1, -1, -1, cfg.rotary_dim).to(dtype)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x[2i], x[2i+1]) rotated by frequency i, in fp32 (transformers'
    complex ``apply_rotary_emb``); x (B, H, T, D), cos/sin (B, 1, T, D) in rotate-half layout
    (their first D/2 columns hold the D/2 frequencies)."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half].float(), sin[..., :half].float()
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32, no weight (``Llama4TextL2Norm``)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def attention(cfg: ModelConfig, ops: Ops, lw: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              attend: Attend) -> torch.Tensor:
    """x (B, T, hidden) -> attention output (B, T, hidden). RoPE layers rotate q and k (then L2
    norm when ``qk_l2_norm``); NoPE layers multiply q by the temperature in ``cos`` (their table)."""
    q, k, v = llama.qkv_heads(cfg, ops, lw, x)
    rope_q, rope_k = rope_interleaved(q, cos, sin), rope_interleaved(k, cos, sin)
    if cfg.extras.qk_l2_norm:
        rope_q, rope_k = l2_norm(rope_q, cfg.rms_norm_eps), l2_norm(rope_k, cfg.rms_norm_eps)
    nope_q = (q.float() * cos[..., :1].float()).to(q.dtype) if cfg.extras.attn_temperature_tuning else q
    if not cfg.rope_layers or all(cfg.rope_layers):  # every layer rotates
        q, k = rope_q, rope_k
    elif not any(cfg.rope_layers):  # none does
        q = nope_q
    else:  # layers differ: this layer's flag (io.weights.layer_indices)
        q, k = torch.where(lw["use_rope"], rope_q, nope_q), torch.where(lw["use_rope"], rope_k, k)
    out = ops.parallel_out(ops.linear(merge_heads(attend(q, k, v)), lw["wo"], None))
    return out + lw["bo"] if cfg.attention_output_bias else out


def moe(cfg: ModelConfig, ops: Ops, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """Llama 4's MoE feed-forward, x (B, T, hidden) -> (B, T, hidden): the shared expert plus,
    for each of the top-k experts by router logit, expert(x * sigmoid(logit)) (``Llama4TextMoe``;
    the other experts' scores are sigmoid(-inf) = 0). Up to GATHER_MAX_ROWS tokens gather their k
    experts' weights; more run all E experts densely (an expert of a zero input outputs zero)."""
    logits = ops.linear(x, lw["router"], None)  # (B, T, E)
    top_logits, top_experts = torch.topk(logits, cfg.num_experts_per_tok, dim=-1)
    if x.shape[0] * x.shape[1] <= GATHER_MAX_ROWS:  # static: tokens this graph runs
        scores = torch.sigmoid(top_logits.float()).to(x.dtype)  # (B, T, k)
        gate_up = lw["experts_gate_up_t"][top_experts]  # (B, T, k, hidden, 2I): only k experts read
        down = lw["experts_down_t"][top_experts]  # (B, T, k, I, hidden)
        routed_in = x[..., None, :] * scores[..., None]  # (B, T, k, hidden)
        gate, up = torch.einsum("btkh,btkhi->btki", routed_in, gate_up).chunk(2, dim=-1)
        routed = torch.einsum("btki,btkih->btkh", up * F.silu(gate), down).sum(-2)
    else:
        full = torch.full_like(logits, float("-inf")).scatter(-1, top_experts, top_logits)
        scores = torch.sigmoid(full.float()).to(x.dtype)  # (B, T, E)
        routed_in = x[..., None, :] * scores[..., None]  # (B, T, E, hidden)
        gate, up = torch.einsum("bteh,ehi->btei", routed_in, lw["experts_gate_up_t"]).chunk(2, dim=-1)
        routed = torch.einsum("btei,eih->bteh", up * F.silu(gate), lw["experts_down_t"]).sum(-2)
    return glu_mlp(ops, lw, x) + routed


def dense_mlp(ops: Ops, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """A dense layer's SwiGLU MLP (``Llama4TextMLP``), x (B, T, hidden) -> (B, T, hidden)."""
    return ops.linear(ops.glu(x, lw["dense_gate"], lw["dense_up"]), lw["dense_down"], None)


def decoder_layer(cfg: ModelConfig, ops: Ops, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attend: Attend) -> torch.Tensor:
    """One pre-norm decoder layer: h (B, T, hidden) -> (B, T, hidden). Its feed-forward is the
    MoE when its weights hold a router (a layer of ``moe_layers``, or every layer), else dense:
    the weights' structure is static, so a traced group fixes it per layer position."""
    h = h + attention(cfg, ops, lw, rms_norm(h, lw["attn_norm"], cfg.rms_norm_eps), cos, sin, attend)
    x = rms_norm(h, lw["mlp_norm"], cfg.rms_norm_eps)
    return h + (moe(cfg, ops, lw, x) if "router" in lw else dense_mlp(ops, lw, x))


MATH = FamilyMath(key_map=key_map, layer_shapes=layer_shapes, decoder_layer=decoder_layer, nope_cos=nope_cos,
                  expert_sources=EXPERT_SOURCES)
