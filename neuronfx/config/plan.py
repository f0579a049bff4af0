"""Plan: everything static about a runtime, derived by one pure function from the configs."""

from __future__ import annotations

import attrs

from neuronfx.config.attention import AttentionLayout, attention_layout, layer_mask
from neuronfx.config.buckets import MIN_BUCKET, chunk_buckets, generate_buckets
from neuronfx.config.inference import InferenceConfig, prefill_limit
from neuronfx.config.inputs import PHASE_INPUTS, TensorSpec, input_specs
from neuronfx.config.kv import KVLayout, kv_storage_dtype
from neuronfx.config.kv_blocks import block_layout
from neuronfx.config.model import ModelConfig
from neuronfx.config.quantization import check_quantization
from neuronfx.config.sampling import NUM_PARAM_COLUMNS
from neuronfx.config.sharding import RankShard, rank_shard
from neuronfx.errors import ConfigError

PHASES = ("prefill", "decode", "greedy", "speculate", "draft", "chunk", "embed")

SHARED_PARTS = {"greedy": "decode"}
"""Phases whose graphs run another phase's prologue and layers (a "greedy" graph is a decode
graph with an argmax epilogue): a compiler may build those parts once for both (a decode graph's prologue takes the
token fields of its record as its greedy twin's ``GreedyInputs``: ``phases.compose.run_decode``)."""

__all__ = ["PHASES", "SHARED_PARTS", "GraphSpec", "Plan", "TensorSpec", "bitmask_words", "make_plan", "plan_for_rank", "step_inputs"]


@attrs.frozen(kw_only=True)
class GraphSpec:
    """One static-shape graph: its phase, batch size (rows), bucket (tokens) and exact step
    inputs, in call order (the tensors of its phase's record, ``config.inputs.PHASE_INPUTS``).

    Prefill: ``bucket`` prompt tokens per row. Decode, greedy and draft: 1 token per row attending
    ``bucket`` KV positions; speculate: k tokens per row; chunk: ``prefill_chunk_size`` tokens per
    row (prefill at an offset). Every graph also takes the shared
    weights and the KV cache (not listed here).
    """

    phase: str
    bucket: int
    batch_size: int
    inputs: tuple[TensorSpec, ...]

    @property
    def key(self) -> tuple[str, int, int]:
        """(phase, batch_size, bucket): how a runtime finds the graph."""
        return (self.phase, self.batch_size, self.bucket)

    @property
    def record(self) -> type:
        """The step-input record class of this graph's phase."""
        return PHASE_INPUTS[self.phase]


@attrs.frozen(kw_only=True)
class Plan:
    """A frozen value derived from (ModelConfig, InferenceConfig) by :func:`make_plan`.

    ``batch_buckets`` (rows) and ``prefill_buckets`` / ``decode_buckets`` / ``chunk_buckets``
    (tokens; the last: attended lengths of the chunk graphs, empty without ``prefill_chunk_size``)
    are the ladders; ``graphs`` holds one GraphSpec per (phase, batch bucket, length bucket).
    ``checkpoint`` optionally names where the weights come from (a local HF directory or a
    ``.gguf`` file) so that ``neuronfx.compile(plan)`` can load them itself. ``rank`` is the
    tensor-parallel rank this plan's graphs run on, ``shard`` what that rank holds
    (``config/sharding.py``) and ``local_model`` the model with its head counts (with
    ``tp_degree=1``: rank 0 holds everything and ``local_model`` is ``model``). ``layout``
    says which RoPE table and mask each layer uses (``config/attention.py``).
    """

    model: ModelConfig
    inference: InferenceConfig
    batch_buckets: tuple[int, ...]
    prefill_buckets: tuple[int, ...]
    decode_buckets: tuple[int, ...]
    kv: KVLayout
    topk_width: int
    graphs: tuple[GraphSpec, ...]
    shard: RankShard
    local_model: ModelConfig
    layout: AttentionLayout
    checkpoint: str | None = None
    rank: int = 0
    chunk_buckets: tuple[int, ...] = ()

    @property
    def tp_degree(self) -> int:
        """Tensor-parallel ranks (``inference.tp_degree``)."""
        return self.inference.tp_degree

    @property
    def logprobs_width(self) -> int:
        """Top logprobs the graphs return per token: ``max_logprobs`` capped at the vocabulary
        (a request may ask for at most this many)."""
        return min(self.inference.max_logprobs, self.model.vocab_size)

    def graph(self, phase: str, batch_size: int, bucket: int) -> GraphSpec:
        """The GraphSpec for (phase, batch_size rows, bucket tokens); KeyError if not compiled."""
        for g in self.graphs:
            if g.key == (phase, batch_size, bucket):
                return g
        raise KeyError(f"plan has no {phase} graph for batch size {batch_size} and bucket {bucket}")


def bucket_plan(inference: InferenceConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prefill buckets, decode buckets), tokens. Explicit lists win; else a ladder when
    ``enable_bucketing``; else one bucket per phase (max_context_length, sequence_length). With
    ``prefill_chunk_size`` the prefill ladder stops at it (``inference.prefill_limit``)."""
    ctx, seq = prefill_limit(inference), inference.sequence_length
    if inference.enable_bucketing:
        prefill = generate_buckets(MIN_BUCKET, ctx)
        decode = generate_buckets(MIN_BUCKET, seq)
    else:
        prefill, decode = (ctx,), (seq,)
    return inference.prefill_buckets or prefill, inference.decode_buckets or decode


def batch_bucket_plan(inference: InferenceConfig) -> tuple[int, ...]:
    """Compiled batch sizes (rows): explicit ``batch_buckets`` win; else 1, 2, 4, ... below
    ``batch_size`` then ``batch_size`` when ``enable_bucketing`` (vLLM captures CUDA graphs at
    [1, 2, 4, 8, ...] for the same reason: a step pads its rows to the next compiled size);
    else ``(batch_size,)``."""
    if inference.batch_buckets:
        return inference.batch_buckets
    if inference.enable_bucketing:
        return generate_buckets(1, inference.batch_size)
    return (inference.batch_size,)


PHASE_TOKENS = {"prefill": "bucket", "decode": 1, "greedy": 1, "draft": 1, "speculate": "speculation_length", "chunk": "prefill_chunk_size",
                "embed": "bucket"}
"""New tokens per row (the record's ``T``) of each phase."""


def step_inputs(phase: str, bucket: int, batch_size: int, vocab_size: int, speculation_length: int = 0,
                prefill_chunk_size: int = 0, max_blocks: int = 1) -> tuple[TensorSpec, ...]:
    """Input specs of one graph, in call order (after weights and KV cache): the tensors of the
    phase's record (``config.inputs``) at B = ``batch_size``, T = new tokens per row (prefill:
    ``bucket``; decode, draft: 1; speculate: ``speculation_length``; chunk:
    ``prefill_chunk_size``), V = ``vocab_size``, N = ``max_blocks`` (block-table columns)."""
    tokens = {"bucket": bucket, "speculation_length": speculation_length,
              "prefill_chunk_size": prefill_chunk_size}.get(PHASE_TOKENS[phase], 1)
    dims = {"B": batch_size, "T": tokens, "V": vocab_size, "P": NUM_PARAM_COLUMNS, "W": bitmask_words(vocab_size), "N": max_blocks}
    return input_specs(PHASE_INPUTS[phase], dims)


def bitmask_words(vocab_size: int) -> int:
    """W, the int32 words of a token bitmask row over ``vocab_size`` tokens: ceil(V / 32) (the
    layout llguidance and xgrammar share)."""
    return -(-vocab_size // 32)


def check_prefix_rope(model: ModelConfig, inference: InferenceConfig) -> None:
    """Raise ConfigError when prefix caching meets a RoPE whose tables depend on the prompt's
    length (dynamic NTK past ``max_position_embeddings``, longrope past
    ``original_max_position_embeddings``) and a prompt may be that long: the K of a cached
    prefix would then be rotated for another prompt's length than the one reusing it."""
    rs = model.rope_scaling
    if not inference.enable_prefix_caching or rs is None or rs.rope_type not in ("dynamic", "longrope"):
        return
    limit = model.max_position_embeddings if rs.rope_type == "dynamic" else rs.original_max_position_embeddings
    if inference.max_context_length > limit:
        raise ConfigError(
            f"enable_prefix_caching=True with rope_type={rs.rope_type!r} and max_context_length={inference.max_context_length} "
            f"> {limit}: this RoPE rotates a prompt by its length past {limit} tokens, so a cached prefix would not match "
            f"another prompt's; lower max_context_length to {limit} or compile without enable_prefix_caching."
        )


def make_plan(model: ModelConfig, inference: InferenceConfig, checkpoint: str | None = None, rank: int = 0) -> Plan:
    """Derive the plan of tensor-parallel rank ``rank``. Raises ConfigError when it cannot be
    split over ``tp_degree`` ranks (``config.sharding.check_tp``) or ``draft_layers`` is not
    below the model's layer count, or ``weight_group_size`` does not divide the hidden size
    (``config.quantization.check_quantization``)."""
    shard = rank_shard(model, inference.tp_degree, rank)
    check_quantization(model, inference)
    if inference.draft_layers >= model.num_hidden_layers:
        raise ConfigError(
            f"draft_layers={inference.draft_layers} must be < num_hidden_layers={model.num_hidden_layers} "
            "(the draft is the target's first layers)."
        )
    check_prefix_rope(model, inference)
    prefill, decode = bucket_plan(inference)
    chunks = () if inference.prefill_chunk_size is None else chunk_buckets(inference.prefill_chunk_size, decode)
    batches = batch_bucket_plan(inference)
    kv = kv_layout(model, inference, shard, (("prefill buckets", prefill), ("decode buckets", decode), ("chunk buckets", chunks)))
    return Plan(
        model=model, inference=inference, batch_buckets=batches, prefill_buckets=prefill, decode_buckets=decode, kv=kv,
        topk_width=min(inference.max_topk, model.vocab_size), graphs=graph_specs(model, inference, batches, prefill, decode, chunks,
                                                                                 kv.max_blocks_per_seq),
        shard=shard, local_model=local_model(model, shard), layout=attention_layout(model), checkpoint=checkpoint, rank=rank,
        chunk_buckets=chunks,
    )


def kv_layout(model: ModelConfig, inference: InferenceConfig, shard: RankShard, buckets: tuple) -> KVLayout:
    """The KV cache of a rank holding ``shard``'s KV heads: slots (an embedding plan keeps no
    cache: a one-slot, one-position placeholder) or blocks (``config.kv_blocks.block_layout``,
    ConfigError when ``buckets``' ladders or the budget do not fit its blocks)."""
    embed = inference.task == "embed"
    dims = dict(num_layers=model.num_hidden_layers, num_slots=1 if embed else inference.batch_size + 1,
                num_kv_heads=shard.num_kv_heads, sequence_length=1 if embed else inference.sequence_length,
                head_dim=model.head_dim, dtype=kv_storage_dtype(inference.kv_cache_dtype, inference.dtype, model.head_dim))
    if inference.kv_layout == "slots":
        return KVLayout(**dims)
    return block_layout(**dims, block_size=inference.kv_block_size, num_kv_blocks=inference.num_kv_blocks,
                        kv_cache_memory=inference.kv_cache_memory, buckets=buckets, **ring_options(model, inference))


def ring_options(model: ModelConfig, inference: InferenceConfig) -> dict:
    """What sizes the blocks layout's window ring (``config.kv_blocks.window_ring``): which
    layers are windowed, how far back they attend (the largest sliding window or attention
    chunk) and the most positions a step writes per row (a chunk, a verify pass of
    ``speculation_length`` (``PHASE_TOKENS``), or one). Prefix caching keeps every layer in the block table:
    its cached blocks must hold every layer's K/V of the prefix."""
    if inference.enable_prefix_caching:
        return {}
    kinds = [layer_mask(model, i) for i in range(model.num_hidden_layers)]
    sizes = {"sliding": model.sliding_window, "chunked": model.attention_chunk_size}
    reach = max((sizes[k] for k in kinds if k != "full"), default=0)
    step = max(1, inference.speculation_length or 0, inference.prefill_chunk_size or 0)
    return {"ring_layers": tuple(k != "full" for k in kinds), "reach": reach, "step_tokens": step}


def has_greedy_graphs(inference: InferenceConfig) -> bool:
    """Whether a plan of ``inference`` compiles greedy graphs over its decode buckets: a
    generating plan with ``on_device_sampling`` and ``greedy_graphs``."""
    return inference.task != "embed" and inference.on_device_sampling and inference.greedy_graphs


def graph_specs(model: ModelConfig, inference: InferenceConfig, batches: tuple[int, ...], prefill: tuple[int, ...],
                decode: tuple[int, ...], chunks: tuple[int, ...], max_blocks: int = 1) -> tuple[GraphSpec, ...]:
    """One GraphSpec per (phase, batch bucket, length bucket), in that order: prefill and decode,
    greedy over the decode buckets with ``on_device_sampling`` and ``greedy_graphs``, speculate
    with ``speculation_length``, draft with ``draft_layers``, chunk with chunk buckets;
    an embedding plan (``task="embed"``): embed graphs over the prefill buckets only."""
    phases = [("embed", prefill)] if inference.task == "embed" else [("prefill", prefill), ("decode", decode)]
    if has_greedy_graphs(inference):
        phases.append(("greedy", decode))
    if inference.speculation_length:
        phases.append(("speculate", decode))
    if inference.draft_layers:
        phases.append(("draft", decode))
    if chunks:
        phases.append(("chunk", chunks))
    return tuple(
        GraphSpec(phase=phase, bucket=k, batch_size=b,
                  inputs=step_inputs(phase, k, b, model.vocab_size, inference.speculation_length, inference.prefill_chunk_size or 0,
                                     max_blocks))
        for phase, ladder in phases
        for b in batches
        for k in ladder
    )


def local_model(model: ModelConfig, shard: RankShard) -> ModelConfig:
    """The model as one rank's graphs see it: that rank's (padded) query and KV head counts and
    MLP (and expert) rows; ``model`` itself at tp_degree 1."""
    if shard.tp_degree == 1:
        return model
    return attrs.evolve(model, num_attention_heads=shard.num_heads, num_key_value_heads=shard.num_kv_heads,
                        intermediate_size=shard.intermediate_size, moe_intermediate_size=shard.expert_intermediate_size)


def plan_for_rank(plan: Plan, rank: int) -> Plan:
    """``plan`` re-derived for tensor-parallel rank ``rank`` (ConfigError outside [0, tp))."""
    return plan if rank == plan.rank else make_plan(plan.model, plan.inference, plan.checkpoint, rank)
