"""Tensor-parallel sharding plan: how each weight of a decoder splits over ``tp_degree`` ranks.

One pure function, :func:`rank_shard` of (ModelConfig, tp_degree, rank), says which query and KV
heads, which rows of the MLP and which vocabulary ids a rank holds; :func:`weight_split` turns
that into the blocks of every weight it reads. The rule is Megatron-LM's (Shoeybi et al. 2019),
as gpt-fast's ``tp.py`` and transformers' ``base_model_tp_plan`` apply it:

=============  =====================  ====================================================
weight          split                  neuronx-distributed layer
=============  =====================  ====================================================
wq, bq          column (q heads)       ``ColumnParallelLinear(gather_output=False)``
wk, wv, bk, bv  column (KV heads)      same; GQA heads padded / replicated as below
wo              row (q heads)          ``RowParallelLinear(input_is_parallel=True)``
gate, up (+b)   column (intermediate)  ``ColumnParallelLinear(gather_output=False, pad=True)``
down            row (intermediate)     ``RowParallelLinear(input_is_parallel=True)``
experts_gate,   column (each expert's  per expert as gate / up (NxDI MoE without expert
experts_up      intermediate, dim 1)   parallelism: ``ExpertMLPs`` column-parallel)
experts_down    row (dim 2)            per expert as down (``ExpertMLPs`` row-parallel)
router          replicated             ``RouterTopK`` (every rank routes every token)
embed           rows (vocabulary)      ``ParallelEmbedding(shard_across_embedding=False)``
lm_head         column (vocabulary)    ``ColumnParallelLinear(gather_output=True, pad=True)``
bdown           replicated             ``RowParallelLinear``'s bias, added after the sum
norms           replicated             plain (``sequence_parallel_enabled`` on SP prefill)
=============  =====================  ====================================================

The rules of the weights every family's layers share are :data:`WEIGHT_RULES` and
:data:`REPLICATED`; a family's own weights (stacked experts and router, per-head q/k norms,
extra norms) have theirs in its registry entry (``config.families.Family.shard_rules`` and
``replicated``).

Row-parallel outputs are summed over ranks (all-reduce; reduce-scatter along the sequence in
sequence-parallel prefill); vocabulary-parallel logits are gathered and the padded ids dropped,
so a padded id is never sampled.

Heads (GQA, ``G = num_attention_heads / num_key_value_heads`` query heads per KV head):

- KV heads divisible by tp: each rank holds ``num_kv_heads / tp`` KV heads and their groups.
- fewer KV heads than ranks, tp a multiple of them: each KV head is replicated on
  ``tp / num_kv_heads`` ranks (NxDI's ``REPLICATE_TO_TP_DEGREE``, vLLM's KV-head replication),
  each holding an equal part of its group; a group is padded with zero query heads to a
  multiple of the replication.
- otherwise: KV heads padded to a multiple of tp with zero heads, each with a group of zero
  query heads. A model of 9 query and 3 KV heads at tp=2 runs 4 KV heads and 12 query heads
  (2 and 6 per rank): attention weights and KV cache 4/3 of the model's, which is cheaper than
  NxDI's convert-to-MHA (9 KV heads, padded to 10: 3.3x the KV cache). A zero query head
  attends uniformly to zero values and its output meets zero columns of ``wo``, so padding
  changes nothing but the cost.

Mixture-of-experts layers (stacked expert weights: gate / up (E, I, H), down (E, H, I)) split
every expert the way a dense MLP splits: each rank holds the same slice of every expert's
intermediate rows, computes the same routing from the replicated router, and the row-parallel
down products are summed like a dense MLP's (no expert parallelism, no all-to-all).

The MLP's (and each expert's) intermediate rows and the vocabulary are padded to a multiple of tp with zeros
(zero gate/up rows give silu(0) * 0 = 0 into zero ``down`` columns; zero embedding rows are
never looked up, padded logits are dropped).
"""

from __future__ import annotations

import attrs

from neuronfx.config.families import FAMILIES
from neuronfx.config.model import ModelConfig
from neuronfx.errors import ConfigError, UnsupportedModelError

HEAD_KINDS = ("q_heads", "kv_heads")
WEIGHT_RULES: dict[str, tuple[str, int]] = {
    "wq": ("q_heads", 0), "bq": ("q_heads", 0),
    "wk": ("kv_heads", 0), "bk": ("kv_heads", 0),
    "wv": ("kv_heads", 0), "bv": ("kv_heads", 0),
    "wo": ("q_heads", 1),
    "gate": ("intermediate", 0), "up": ("intermediate", 0),
    "bgate": ("intermediate", 0), "bup": ("intermediate", 0),
    "down": ("intermediate", 1),
    "embed": ("vocab", 0), "lm_head": ("vocab", 0),
}
"""Split weights every family shares: neuronfx weight name (per-layer names without
``layers.{i}.``) -> (what is split, dimension)."""
REPLICATED = frozenset({"norm", "attn_norm", "mlp_norm", "bdown", "bo", "rope_index", "mask_index", "use_rope"})
"""Weights every family shares that every rank holds whole."""


def weight_rules(model_type: str) -> dict[str, tuple[str, int]]:
    """Every split weight of ``model_type``: :data:`WEIGHT_RULES` and its family's own."""
    return WEIGHT_RULES | dict(FAMILIES[model_type].shard_rules)


def replicated(model_type: str) -> frozenset[str]:
    """Every weight of ``model_type`` held whole: :data:`REPLICATED` and its family's own."""
    return REPLICATED | FAMILIES[model_type].replicated


@attrs.frozen
class Block:
    """A run of ``size`` indices along the split dimension: the source's ``[start, start +
    size)``, or zeros when ``start`` is None (padding)."""

    start: int | None
    size: int


@attrs.frozen
class Split:
    """How one rank reads one weight: whole (``dim`` None) or the concatenation of ``blocks``
    along ``dim``."""

    dim: int | None
    blocks: tuple[Block, ...] = ()


@attrs.frozen(kw_only=True)
class RankShard:
    """What rank ``rank`` of ``tp_degree`` holds (from :func:`rank_shard`) of a model of
    ``model_type`` (whose family's rules :func:`weight_split` reads).

    - ``q_heads`` / ``kv_heads``: the global index of each local query / KV head, None for a
      zero (padding) head; ``num_heads`` / ``num_kv_heads`` are their counts (equal on every
      rank; local query head i belongs to local KV head ``i // (num_heads / num_kv_heads)``).
    - ``kv_replication``: ranks holding each KV head (1 unless KV heads are replicated).
    - ``intermediate``: (start, size) of the MLP rows on this rank, ``intermediate_size`` the
      padded per-rank count (rows past the model's are zeros).
    - ``expert_intermediate``: the same for each expert's rows (``moe_intermediate_size``; 0 for
      a dense model).
    - ``vocab_start`` / ``vocab_size``: the vocabulary ids ``[vocab_start, vocab_start +
      vocab_size)`` of this rank's embedding and LM-head rows (ids past the model's are zeros);
      ``padded_vocab_size = tp_degree * vocab_size``.
    """

    model_type: str
    tp_degree: int
    rank: int
    head_dim: int
    q_heads: tuple[int | None, ...]
    kv_heads: tuple[int | None, ...]
    kv_replication: int
    intermediate_start: int
    intermediate_size: int
    model_intermediate_size: int
    expert_intermediate_start: int
    expert_intermediate_size: int
    model_expert_intermediate_size: int
    vocab_start: int
    vocab_size: int
    model_vocab_size: int

    @property
    def num_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)

    @property
    def padded_vocab_size(self) -> int:
        return self.vocab_size * self.tp_degree


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def check_tp(model: ModelConfig, tp_degree: int, rank: int) -> None:
    """ConfigError naming the values when ``model`` cannot be split over ``tp_degree`` ranks or
    ``rank`` is not one of them; UnsupportedModelError for tp_degree > 1 of a family the
    sharding plan does not cover (its registry entry's ``tensor_parallel``)."""
    if not isinstance(tp_degree, int) or isinstance(tp_degree, bool) or tp_degree < 1:
        raise ConfigError(f"tp_degree={tp_degree!r} must be a positive int (ranks).")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < tp_degree:
        raise ConfigError(f"rank={rank!r} must be in [0, tp_degree={tp_degree}).")
    if tp_degree > 1 and not FAMILIES[model.model_type].tensor_parallel:
        raise UnsupportedModelError(
            f"tp_degree={tp_degree}: tensor parallel is not supported for model_type={model.model_type!r} (the "
            "sharding plan does not cover its weights); use tp_degree=1."
        )
    if tp_degree > model.num_attention_heads:
        raise ConfigError(
            f"tp_degree={tp_degree} > num_attention_heads={model.num_attention_heads}: some rank would hold no query "
            f"head; use tp_degree <= {model.num_attention_heads}."
        )


def rank_shard(model: ModelConfig, tp_degree: int, rank: int) -> RankShard:
    """The shard of ``rank`` (0-based) of ``tp_degree`` for ``model`` (see the module doc for
    the rules). Raises ConfigError (:func:`check_tp`) for an invalid combination."""
    check_tp(model, tp_degree, rank)
    heads, kv = model.num_attention_heads, model.num_key_value_heads
    group = heads // kv
    replicate = kv < tp_degree and tp_degree % kv == 0
    if not replicate:  # whole KV heads per rank, padded to a multiple of tp
        kv_per_rank = _ceil_to(kv, tp_degree) // tp_degree
        first_kv = rank * kv_per_rank
        kv_heads = tuple(j if j < kv else None for j in range(first_kv, first_kv + kv_per_rank))
        q_heads = tuple(
            (g * group + i) if g is not None else None for g in kv_heads for i in range(group)
        )
        replication = 1
    else:  # fewer KV heads than ranks, tp a multiple of them: replicate each over tp / kv ranks
        replication = tp_degree // kv
        per_rank = _ceil_to(group, replication) // replication
        g, part = divmod(rank, replication)
        kv_heads = (g,)
        q_heads = tuple(g * group + p if p < group else None for p in range(part * per_rank, (part + 1) * per_rank))
    inter = _ceil_to(model.intermediate_size, tp_degree) // tp_degree
    expert = _ceil_to(model.moe_intermediate_size, tp_degree) // tp_degree
    vocab = _ceil_to(model.vocab_size, tp_degree) // tp_degree
    return RankShard(
        model_type=model.model_type, tp_degree=tp_degree, rank=rank, head_dim=model.head_dim, q_heads=q_heads, kv_heads=kv_heads,
        kv_replication=replication, intermediate_start=rank * inter, intermediate_size=inter,
        model_intermediate_size=model.intermediate_size, expert_intermediate_start=rank * expert,
        expert_intermediate_size=expert, model_expert_intermediate_size=model.moe_intermediate_size, vocab_start=rank * vocab, vocab_size=vocab,
        model_vocab_size=model.vocab_size,
    )


def _merge(blocks: list[Block]) -> tuple[Block, ...]:
    """Adjacent source runs (and adjacent zero runs) joined: fewer, larger reads."""
    out: list[Block] = []
    for b in blocks:
        if out and out[-1].start is None and b.start is None:
            out[-1] = Block(None, out[-1].size + b.size)
        elif out and b.start is not None and out[-1].start is not None and out[-1].start + out[-1].size == b.start:
            out[-1] = Block(out[-1].start, out[-1].size + b.size)
        else:
            out.append(b)
    return tuple(out)


def _range_blocks(start: int, size: int, limit: int) -> tuple[Block, ...]:
    real = max(0, min(size, limit - start))
    return _merge([b for b in (Block(start, real), Block(None, size - real)) if b.size])


def weight_split(shard: RankShard, name: str) -> Split:
    """The :class:`Split` of weight ``name`` (neuronfx names, per-layer ones without the
    ``layers.{i}.`` prefix) on ``shard``'s rank. Raises ConfigError for a weight no rule covers
    (a family adding weights adds its rules to its registry entry: ``Family.shard_rules`` or
    ``Family.replicated``)."""
    if name in replicated(shard.model_type):
        return Split(None)
    rules = weight_rules(shard.model_type)
    if name not in rules:
        raise ConfigError(f"weight {name!r} of model_type={shard.model_type!r} has no tensor-parallel rule; add it to its "
                          "registry entry's shard_rules or replicated (config/families.py).")
    kind, dim = rules[name]
    d = shard.head_dim
    if kind in HEAD_KINDS:
        heads = shard.q_heads if kind == "q_heads" else shard.kv_heads
        return Split(dim, _merge([Block(None if h is None else h * d, d) for h in heads]))
    if kind == "intermediate":
        return Split(dim, _range_blocks(shard.intermediate_start, shard.intermediate_size, shard.model_intermediate_size))
    if kind == "expert_intermediate":
        return Split(dim, _range_blocks(shard.expert_intermediate_start, shard.expert_intermediate_size,
                                        shard.model_expert_intermediate_size))
    return Split(dim, _range_blocks(shard.vocab_start, shard.vocab_size, shard.model_vocab_size))


def split_shape(split: Split, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the shard of a tensor of ``shape`` under ``split``."""
    if split.dim is None:
        return tuple(shape)
    out = list(shape)
    out[split.dim] = sum(b.size for b in split.blocks)
    return tuple(out)
