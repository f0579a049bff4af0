"""Plan: everything static about a runtime, derived by one pure function from the configs."""

from __future__ import annotations

import attrs

from neuronfx.config.buckets import MIN_BUCKET, generate_buckets
from neuronfx.config.inference import InferenceConfig
from neuronfx.config.kv import KVLayout
from neuronfx.config.model import ModelConfig
from neuronfx.errors import UnsupportedModelError

PHASES = ("prefill", "decode")


@attrs.frozen
class TensorSpec:
    """One graph input: name, shape (ints) and dtype name (torch dtype attribute, e.g. "int32")."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@attrs.frozen(kw_only=True)
class GraphSpec:
    """One static-shape graph: its phase, bucket (tokens) and exact step inputs, in call order.

    Prefill: ``bucket`` prompt tokens per row. Decode: 1 token per row attending ``bucket`` KV
    positions. Every graph also takes the shared weights and the KV cache (not listed here).
    """

    phase: str
    bucket: int
    batch_size: int
    inputs: tuple[TensorSpec, ...]

    @property
    def key(self) -> tuple[str, int]:
        return (self.phase, self.bucket)


@attrs.frozen(kw_only=True)
class Plan:
    """A frozen value derived from (ModelConfig, InferenceConfig) by :func:`make_plan`.

    ``checkpoint`` optionally names where the weights come from (a local HF directory or a
    ``.gguf`` file) so that ``neuronfx.compile(plan)`` can load them itself.
    """

    model: ModelConfig
    inference: InferenceConfig
    prefill_buckets: tuple[int, ...]
    decode_buckets: tuple[int, ...]
    kv: KVLayout
    topk_width: int
    graphs: tuple[GraphSpec, ...]
    checkpoint: str | None = None

    def graph(self, phase: str, bucket: int) -> GraphSpec:
        for g in self.graphs:
            if g.key == (phase, bucket):
                return g
        raise KeyError(f"plan has no {phase} graph for bucket {bucket}")


def bucket_plan(inference: InferenceConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prefill buckets, decode buckets), tokens. Explicit lists win; else a ladder when
    ``enable_bucketing``; else one bucket per phase (max_context_length, sequence_length)."""
    ctx, seq = inference.max_context_length, inference.sequence_length
    if inference.enable_bucketing:
        prefill = generate_buckets(MIN_BUCKET, ctx)
        decode = generate_buckets(MIN_BUCKET, seq)
    else:
        prefill, decode = (ctx,), (seq,)
    return inference.prefill_buckets or prefill, inference.decode_buckets or decode


def step_inputs(phase: str, bucket: int, batch_size: int) -> tuple[TensorSpec, ...]:
    """Input specs of one graph, in call order (after weights and KV cache)."""
    n = bucket if phase == "prefill" else 1
    specs = [
        TensorSpec("input_ids", (batch_size, n), "int32"),
        TensorSpec("position_ids", (batch_size, n), "int32"),
        TensorSpec("seq_ids", (batch_size,), "int32"),
    ]
    if phase == "prefill":
        specs.append(TensorSpec("prompt_lens", (batch_size,), "int32"))
    specs += [
        TensorSpec("sampling_params", (batch_size, 3), "float32"),
        TensorSpec("rand", (batch_size,), "float32"),
    ]
    return tuple(specs)


def make_plan(model: ModelConfig, inference: InferenceConfig, checkpoint: str | None = None) -> Plan:
    """Derive the plan. Raises UnsupportedModelError when the model needs something the plan
    cannot give (a sliding window shorter than ``sequence_length``)."""
    if model.sliding_window is not None and model.sliding_window < inference.sequence_length:
        raise UnsupportedModelError(
            f"sliding_window={model.sliding_window} < sequence_length={inference.sequence_length}: "
            "sliding-window attention is not supported; set sequence_length <= sliding_window."
        )
    prefill, decode = bucket_plan(inference)
    b = inference.batch_size
    graphs = tuple(
        GraphSpec(phase=phase, bucket=k, batch_size=b, inputs=step_inputs(phase, k, b))
        for phase, ladder in (("prefill", prefill), ("decode", decode))
        for k in ladder
    )
    kv = KVLayout(
        num_layers=model.num_hidden_layers,
        num_slots=b + 1,
        num_kv_heads=model.num_key_value_heads,
        sequence_length=inference.sequence_length,
        head_dim=model.head_dim,
        dtype=inference.dtype,
    )
    return Plan(
        model=model,
        inference=inference,
        prefill_buckets=prefill,
        decode_buckets=decode,
        kv=kv,
        topk_width=min(inference.max_topk, model.vocab_size),
        graphs=graphs,
        checkpoint=checkpoint,
    )
