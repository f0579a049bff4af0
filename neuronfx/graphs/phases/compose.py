"""Per-phase graphs composed of their parts: (weights, KV cache, step-input record) -> outputs,
KV updated in place.

Each phase is three small functions (``prefill.py``, ``decode.py``, ``chunk.py``), specialised
at build time with the plan, the bucket, the ops bundle the backend chose and the family's math
(no phase branches, no ``.item()``, no shape sniffing, no asking whether they are compiled): a
prologue (embedding, RoPE tables, masks) that turns the step-input record into the phase's
record (``records.py``), a group of consecutive decoder layers (run once per group with those
layers' weights and K/V, reading that record by name) and an epilogue (final norm, LM head,
sampling). Phases: prefill (right-padded prompts), decode (1 token per row), speculate (k
tokens per row, logits out), draft (decode through the first ``draft_layers`` layers) and
chunk (prefill at an offset: ``prefill_chunk_size`` tokens per row against the slot's cache).
Backends compose them into a graph; the inductor backend compiles each part (records and
lists of tensors are pytrees: a compiled part takes and returns them as they are).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import attrs
import torch

from neuronfx.config.inputs import DecodeInputs, GreedyInputs
from neuronfx.config.plan import GraphSpec, Plan
from neuronfx.graphs.models import family_math
from neuronfx.graphs.models.layers import LayerWeights, Weights
from neuronfx.graphs.models.ops import Ops
from neuronfx.graphs.phases.chunk import chunk_layers, chunk_prologue
from neuronfx.graphs.phases.collectives import tensor_parallel_ops, world_group
from neuronfx.graphs.phases.decode import (
    decode_epilogue,
    decode_layers,
    decode_prologue,
    draft_epilogue,
    greedy_epilogue,
    speculate_epilogue,
)
from neuronfx.graphs.phases.embed import embed_epilogue, embed_layers, embed_prologue
from neuronfx.graphs.phases.inputs import KVCache, KVPairs
from neuronfx.graphs.phases.prefill import prefill_epilogue, prefill_layers, prefill_prologue
from neuronfx.graphs.phases.prompt_logprobs import PROMPT_LOGPROBS_EPILOGUES

Tensor = torch.Tensor


@attrs.frozen
class PhaseParts:
    """The three callables of one (phase, bucket) graph, with plan, bucket, ops and the family's
    math already bound: ``prologue(embed, inputs) -> record``, ``layers(lws, kv, record) -> h``
    for ``group_size`` consecutive layers per call, and ``epilogue(norm, lm_head, record,
    sampler)`` (speculate: no sampler) -> outputs."""

    prologue: Callable[..., tuple]
    layers: Callable[..., Tensor]
    epilogue: Callable[..., dict[str, Tensor]]
    group_size: int


PART_FUNCTIONS = {
    "prefill": (prefill_prologue, prefill_layers, prefill_epilogue),
    "decode": (decode_prologue, decode_layers, decode_epilogue),
    "greedy": (decode_prologue, decode_layers, greedy_epilogue),  # decode with the argmax only (``config.plan.SHARED_PARTS``)
    "speculate": (decode_prologue, decode_layers, speculate_epilogue),
    "draft": (decode_prologue, decode_layers, draft_epilogue),
    "chunk": (chunk_prologue, chunk_layers, prefill_epilogue),  # output at each row's last real token, as prefill
    "embed": (embed_prologue, embed_layers, embed_epilogue),  # pooled hidden states, no cache written
}


def phase_num_layers(plan: Plan, phase: str) -> int:
    """Decoder layers a phase runs: the draft runs the first ``draft_layers``, others all."""
    return plan.inference.draft_layers if phase == "draft" else plan.model.num_hidden_layers


def phase_parts(plan: Plan, spec: GraphSpec, ops: Ops, group_size: int | None = None,
                wrap: Callable[[Callable], Callable] = lambda f: f) -> PhaseParts:
    """Bind plan, bucket, ``ops`` and the family's math (looked up here, outside any traced
    code) into the phase's parts; ``wrap`` (e.g. a compiler) wraps each. ``group_size`` (a
    divisor of the phase's layer count, default all) sets layers per ``layers`` call. Raises
    ValueError for a ``group_size`` that does not divide it; under tensor parallelism the ops
    get this rank's collectives (ConfigError when no process group of ``tp_degree`` ranks is
    initialised)."""
    n = phase_num_layers(plan, spec.phase)
    group_size = n if group_size is None else group_size
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size={group_size} must divide the phase's {n} layers; pick a divisor of {n}.")
    if plan.tp_degree > 1:
        sequence_parallel = plan.inference.sequence_parallel and spec.phase == "prefill"
        ops = tensor_parallel_ops(ops, plan.tp_degree, plan.rank, world_group(plan.tp_degree), sequence_parallel)
    static = (plan, spec.bucket, ops, family_math(plan.model.model_type))
    fns = PART_FUNCTIONS[spec.phase]
    if plan.inference.enable_prompt_logprobs and spec.phase in PROMPT_LOGPROBS_EPILOGUES:
        fns = (*fns[:2], PROMPT_LOGPROBS_EPILOGUES[spec.phase])  # prefill and chunk: prompt logprobs too
    prologue, layers, epilogue = (wrap(functools.partial(fn, *static)) for fn in fns)
    return PhaseParts(prologue=prologue, layers=layers, epilogue=epilogue, group_size=group_size)


def _groups(parts: PhaseParts, w: Weights, kv: KVCache, num_layers: int) -> list[tuple[list[LayerWeights], KVPairs]]:
    g = parts.group_size
    return [(w["layers"][i:i + g], [(layer.k, layer.v) for layer in kv[i:i + g]]) for i in range(0, num_layers, g)]


def _through_layers(parts: PhaseParts, num_layers: int, w: Weights, kv: KVCache, inputs: tuple) -> tuple:
    """The prologue's record with the hidden states of the last layer group."""
    x = parts.prologue(w["embed"], inputs)
    for lws, group_kv in _groups(parts, w, kv, num_layers):
        x = x._replace(h=parts.layers(lws, group_kv, x))
    return x


def run_sampled(parts: PhaseParts, num_layers: int, w: Weights, kv: KVCache, inputs: tuple) -> dict[str, Tensor]:
    """A graph whose epilogue samples (prefill, decode, draft, chunk): it reads the phase's
    record and the step inputs' sampler record."""
    return parts.epilogue(w["norm"], w["lm_head"], _through_layers(parts, num_layers, w, kv, inputs), inputs.sampler)


def run_decode(parts: PhaseParts, num_layers: int, w: Weights, kv: KVCache, inputs: DecodeInputs) -> dict[str, Tensor]:
    """A decode graph: :func:`run_sampled` with the prologue given the record's four token
    fields as a ``GreedyInputs``, the record its greedy twin takes, so the two prologues trace
    alike and share one compiled version (``config.plan.SHARED_PARTS``)."""
    tokens = GreedyInputs(inputs.input_ids, inputs.position_ids, inputs.seq_ids, inputs.block_table)
    return parts.epilogue(w["norm"], w["lm_head"], _through_layers(parts, num_layers, w, kv, tokens), inputs.sampler)


def run_logits(parts: PhaseParts, num_layers: int, w: Weights, kv: KVCache, inputs: tuple) -> dict[str, Tensor]:
    """A graph whose epilogue reads no sampler: speculate (k tokens per row through every
    layer, logits (B, k, V) out with their argmax and finiteness (B, k)) and greedy (the argmax
    of each row's logits)."""
    return parts.epilogue(w["norm"], w["lm_head"], _through_layers(parts, num_layers, w, kv, inputs))


def run_pooled(parts: PhaseParts, num_layers: int, w: Weights, kv: KVCache, inputs: tuple) -> dict[str, Tensor]:
    """An embed graph: every layer, then the pooling epilogue, which reads the final norm's
    weight only (no LM head): {"embeddings": (B, hidden) float32}."""
    return parts.epilogue(w["norm"], _through_layers(parts, num_layers, w, kv, inputs))


RUNNERS = {"prefill": run_sampled, "decode": run_decode, "greedy": run_logits, "speculate": run_logits, "draft": run_sampled,
           "chunk": run_sampled, "embed": run_pooled}


class GraphModule(torch.nn.Module):
    """One (phase, bucket) graph as an nn.Module holding only static values (no parameters):
    ``forward(weights, kv, inputs)`` with ``kv`` the KV cache (one LayerKV per layer) and
    ``inputs`` the phase's step-input record. Weights and KV cache are inputs, so every graph
    shares one copy of each."""

    def __init__(self, parts: PhaseParts, phase: str, num_layers: int):
        super().__init__()
        self.parts = parts
        self.run = functools.partial(RUNNERS[phase], parts, num_layers)

    def forward(self, w: Weights, kv: KVCache, inputs: tuple) -> dict[str, Tensor]:
        return self.run(w, kv, inputs)


def build_module(plan: Plan, spec: GraphSpec, ops: Ops, group_size: int | None = None,
                 wrap: Callable[[Callable], Callable] = lambda f: f) -> GraphModule:
    """The GraphModule of ``spec`` with ``ops`` bound (see :func:`phase_parts`)."""
    return GraphModule(phase_parts(plan, spec, ops, group_size, wrap), spec.phase, phase_num_layers(plan, spec.phase))
