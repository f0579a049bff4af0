"""Mixture-of-experts MLP shared by the MoE families (mixtral, qwen3_moe): a router, top-k experts
per token, the experts' SwiGLU MLPs (Shazeer et al. 2017, "Outrageously Large Neural Networks";
Jiang et al. 2024, "Mixtral of Experts").

Reference: transformers ``models/mixtral/modeling_mixtral.py`` (``MixtralTopKRouter``,
``MixtralExperts``) and ``models/qwen3_moe/modeling_qwen3_moe.py`` (``Qwen3MoeTopKRouter``):
router logits x @ router.T, softmax in fp32, top-k, renormalised to sum 1 when
``norm_topk_prob``; each picked expert's down(silu(gate(x)) * up(x)) weighted and summed.

Weights of a layer: ``router`` (E, H), ``experts_gate`` / ``experts_up`` (E, I, H),
``experts_down`` (E, H, I). Gate and up are kept apart (not transformers' fused gate_up
(E, 2I, H)) so that the tensor-parallel intermediate split is one contiguous block per weight
and the hub layout (one gate and one up matrix per expert) stacks without a copy per half.

Static shapes, two strategies chosen from the number of rows N (tokens in the graph) alone:

- gathered (``N * top_k <= num_experts``, e.g. decode at batch 1): each row gathers its k
  experts' weights (``w[topk_idx]``) and multiplies them as reductions, so a step reads k
  experts per row, never all E (written as reductions over the gathered rows, which inductor
  can fuse with the gather instead of copying the weights first).
- dense (otherwise: prefill, larger decode batches): every expert runs on every row and a
  routing-weight matrix (N, E), zero for the experts a row did not pick, weights the results;
  with N * k > E rows the k-per-row gather would read more weight bytes than all experts once.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from neuronfx.config.model import ModelConfig
from neuronfx.graphs.models.layers import LayerWeights
from neuronfx.graphs.models.ops import Ops

Tensor = torch.Tensor


def route(x: Tensor, router: Tensor, top_k: int, renormalise: bool) -> tuple[Tensor, Tensor]:
    """x (N, H), router (E, H) -> (routing weights (N, k) float32, expert ids (N, k) int64):
    the top-k of softmax(x @ router.T) computed in fp32, divided by their sum when
    ``renormalise`` (transformers ``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter``)."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)  # (N, E)
    weights, ids = torch.topk(probs, top_k, dim=-1)  # (N, k)
    if renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def use_gather(rows: int, cfg: ModelConfig) -> bool:
    """The strategy from static sizes: gather the picked experts' weights per row when the rows'
    k picks are at most ``num_experts`` weight matrices, else run every expert densely."""
    return rows * cfg.num_experts_per_tok <= cfg.num_experts


def gathered_experts(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """x (N, H), weights/ids (N, k) -> (N, H): each row through its k experts only, written as
    fp32 multiply-and-sum reductions over gathered weights ``w[ids]`` (N, k, I, H), which
    inductor fuses into loops reading just those rows; the routing weight scales the SwiGLU
    activation before ``down`` (linear, so the same sum)."""
    x32 = x.float()[:, None, None, :]  # (N, 1, 1, H)
    g = (x32 * gate[ids].float()).sum(-1)  # (N, k, I)
    u = (x32 * up[ids].float()).sum(-1)
    a = (F.silu(g.to(x.dtype)) * u.to(x.dtype)).float() * weights[..., None]  # (N, k, I)
    return (a[:, :, None, :] * down[ids].float()).sum(-1).sum(1).to(x.dtype)  # (N, H)


def dense_experts(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """x (N, H), weights/ids (N, k) -> (N, H): every expert on every row (batched products),
    weighted by the (N, E) routing matrix that is zero where a row did not pick the expert."""
    mix = torch.zeros(x.shape[0], gate.shape[0], dtype=torch.float32, device=x.device).scatter(1, ids, weights)  # (N, E)
    g = torch.einsum("nh,eih->nei", x, gate)  # (N, E, I)
    u = torch.einsum("nh,eih->nei", x, up)
    a = (F.silu(g) * u).float() * mix[..., None]
    return torch.einsum("nei,ehi->nh", a.to(x.dtype), down)  # (N, H)


def moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer MoE weight shapes: router (E, H), experts_gate / experts_up (E, I, H),
    experts_down (E, H, I), I = ``moe_intermediate_size``."""
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    return {"router": (e, h), "experts_gate": (e, i, h), "experts_up": (e, i, h), "experts_down": (e, h, i)}


def moe_mlp(cfg: ModelConfig, ops: Ops, lw: LayerWeights, x: Tensor) -> Tensor:
    """The MoE MLP of x (B, T, hidden) -> (B, T, hidden). Under tensor parallelism every rank
    routes every token with the replicated router, runs its slice of each expert's
    intermediate rows and ``ops.parallel_out`` sums the row-parallel partial outputs, as
    ``layers.glu_mlp`` does for a dense MLP."""
    x = ops.parallel_in(x)
    b, t, hidden = x.shape
    rows = x.reshape(b * t, hidden)  # (N, H)
    weights, ids = route(rows, lw["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    experts = gathered_experts if use_gather(b * t, cfg) else dense_experts
    out = experts(rows, weights, ids, lw["experts_gate"], lw["experts_up"], lw["experts_down"])
    return ops.parallel_out(out.reshape(b, t, hidden))


# --- checkpoint names --------------------------------------------------------------------------

ROUTER_NAME = "model.layers.{i}.mlp.gate.weight"
STACKED_NAMES = {part: f"model.layers.{{i}}.mlp.experts.{part}_proj" for part in ("gate", "up", "down")}
MOE_KEY_MAP = {ROUTER_NAME: "layers.{i}.router"} | {name: f"layers.{{i}}.experts_{part}" for part, name in STACKED_NAMES.items()}
"""Stacked expert names -> neuronfx names. ``mlp.gate.weight`` (router) and
``mlp.experts.down_proj`` (E, H, I) are transformers 5's in-memory names; ``gate_proj`` and
``up_proj`` (E, I, H) name the two halves of its fused ``mlp.experts.gate_up_proj`` (E, 2I, H).
``io.weights.expert_views`` maps both checkpoint layouts (:class:`ExpertSources`) onto them."""


@attrs.frozen
class ExpertSources:
    """Where a family's checkpoints keep a layer's MoE weights ("{i}": layer, "{e}": expert).

    - ``fused_gate_up``: transformers 5's in-memory (E, 2I, H) gate-then-up tensor
      (``model.state_dict()``), split into :data:`MOE_KEY_MAP`'s ``gate_proj`` / ``up_proj``.
    - ``per_expert``: the hub layout, which ``save_pretrained`` (5.24) also writes: one (I, H)
      gate and up and one (H, I) down matrix per expert, keys "gate", "up", "down".
    - ``router_aliases``: other names of the router weight (mixtral's hub name).
    """

    fused_gate_up: str
    per_expert: dict[str, str]
    router_aliases: tuple[str, ...] = ()
