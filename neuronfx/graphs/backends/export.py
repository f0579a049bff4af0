"""The export backend: ``torch.export.export`` per (phase, batch, bucket) with the reference ops.

The KV cache is updated in place (the exported program keeps the ``index_put_`` on the input)
and weights are inputs, so all programs share one copy. Saved as ``graphs/*.pt2``, each holding
its program only (its example inputs are kept as meta tensors: no weights, no KV cache).
Exported programs keep no neuronfx types: a graph is exported through
:class:`FlatGraphModule`'s flat calling convention.
"""

from __future__ import annotations

import contextlib
import time
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import attrs
import torch
from torch.utils._pytree import tree_map_only

from neuronfx.config.inputs import from_leaves, leaves
from neuronfx.config.plan import GraphSpec, Plan
from neuronfx.graphs.backends.records import Backend, Built, Graph, GraphKey, build_each, nothing_to_check
from neuronfx.graphs.kernels.bundles import REFERENCE_OPS
from neuronfx.graphs.models.layers import Weights
from neuronfx.graphs.phases.compose import GraphModule, build_module
from neuronfx.graphs.phases.inputs import KVCache, KVPairs, LayerKV, example_inputs


class FlatGraphModule(torch.nn.Module):
    """``graph`` with a flat calling convention for torch.export: ``forward(weights, kv_pairs,
    *tensors)``, ``kv_pairs`` a list of (K, V) per layer and ``tensors`` the record's tensors in
    call order (``config.inputs.leaves``); exported programs keep no neuronfx types."""

    def __init__(self, graph: GraphModule, record: type):
        super().__init__()
        self.graph = graph
        self.record = record

    def forward(self, w: Weights, kv_pairs: KVPairs, *tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.graph(w, tuple(LayerKV(k, v) for k, v in kv_pairs), from_leaves(self.record, tensors))


@attrs.frozen(eq=False)
class ExportedGraph:
    """An exported (phase, batch, bucket) graph: the ExportedProgram (what is saved) and its
    runnable module, which takes the flat convention of :class:`FlatGraphModule`; called as
    every graph is, ``graph(weights, kv, inputs)``."""

    program: torch.export.ExportedProgram
    module: Callable[..., dict[str, torch.Tensor]]

    def __call__(self, weights: Weights, kv: KVCache, inputs: object) -> dict[str, torch.Tensor]:
        return self.module(weights, [(layer.k, layer.v) for layer in kv], *leaves(inputs))


_DEBUG_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "from_node")
"""Node metadata saying where each op came from in neuronfx's source: 45% of a saved SmolLM2
program (checkout paths included), read back and kept by every load, never used to run it."""


def _exported(program: torch.export.ExportedProgram) -> ExportedGraph:
    """``program`` and its runnable module, made light to keep, save and load:

    - example inputs replaced by meta tensors of the same structure, shapes and dtypes. They are
      the weights and the template KV cache: ``torch.export.save`` wrote them into every graph
      file (SmolLM2, batch 2: 609 MB of each 612 MB .pt2) and every load read a copy back;
    - debug metadata (:data:`_DEBUG_META`) dropped;
    - the module built without export's input guards and checks: they check every input's shape
      on every call (a generated assert per input dimension, hundreds per graph, and building
      them costs 0.6 s per SmolLM2 graph), while the runtime builds each graph's inputs from its
      GraphSpec (the weights from the plan's model config, which the compile-cache key holds).
    """
    if program.example_inputs is not None:
        program.example_inputs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), program.example_inputs)
    for node in program.graph.nodes:
        for key in _DEBUG_META:
            node.meta.pop(key, None)
    module = program.module(check_guards=False)
    module.validate_inputs = False
    return ExportedGraph(program=program, module=module)


def _export_graph(plan: Plan, spec: GraphSpec, weights: Weights, kv: KVCache) -> Graph:
    # ``kv`` is the template cache, not a live state: tracing may write into it.
    module = FlatGraphModule(build_module(plan, spec, REFERENCE_OPS), spec.record)
    args = (weights, [(layer.k, layer.v) for layer in kv], *leaves(example_inputs(plan, spec)))
    return _exported(torch.export.export(module, args, strict=False))


def build(plan: Plan, weights: Weights, progress: bool, kernels: Path | None = None) -> Built:
    """Every graph of ``plan`` exported (``kernels``: unused, export compiles no kernel)."""
    graphs, seconds = build_each(plan, weights, _export_graph, progress)
    return Built(graphs=graphs, seconds=seconds)


def _export_file(spec: GraphSpec) -> str:
    return f"graphs/{spec.phase}-b{spec.batch_size}-t{spec.bucket}.pt2"


def save(plan: Plan, graphs: Mapping[GraphKey, Graph], compiled_dir: str | None, out: Path) -> list[str]:
    """Write each graph's program to ``out/graphs/*.pt2``; their relative names."""
    (out / "graphs").mkdir(parents=True, exist_ok=True)
    for spec in plan.graphs:
        torch.export.save(graphs[spec.key].program, str(out / _export_file(spec)))  # type: ignore[attr-defined]
    return [_export_file(spec) for spec in plan.graphs]


def load(plan: Plan, weights: Weights, src: Path) -> Built:
    """Every graph of ``plan`` from the programs :func:`save` wrote under ``src``."""
    graphs, seconds = {}, {}
    with _cached_schema_hints():
        for spec in plan.graphs:
            t0 = time.perf_counter()
            graphs[spec.key] = _exported(torch.export.load(str(src / _export_file(spec))))  # files saved with data shed it here
            seconds[spec.key] = time.perf_counter() - t0
    return Built(graphs=graphs, seconds=seconds)


def _typing_with_cached_hints() -> types.ModuleType:
    """A copy of the ``typing`` module whose ``get_type_hints`` is cached. Torch's export
    deserializer resolves the hints of the same few dozen schema classes for every node it reads
    (about 100,000 times per SmolLM2 graph, half of ``torch.export.load``'s time; pytorch issue
    196452); the classes are fixed, so the cached hints are the ones it would compute."""
    module = types.ModuleType("typing")
    module.__dict__.update(vars(typing))
    hints: dict[tuple, dict] = {}

    def get_type_hints(obj: object, globalns: dict | None = None, localns: dict | None = None,
                       include_extras: bool = False) -> dict:
        key = (obj, id(globalns), id(localns), include_extras)
        if key not in hints:
            hints[key] = typing.get_type_hints(obj, globalns, localns, include_extras)
        return hints[key]

    module.get_type_hints = get_type_hints  # type: ignore[attr-defined]
    return module


@contextlib.contextmanager
def _cached_schema_hints() -> Iterator[None]:
    """Loads in this block resolve torch's export schema type hints once
    (:func:`_typing_with_cached_hints`); a torch whose deserializer no longer reads them through
    its module's ``typing`` is left as it is."""
    from torch._export.serde import serialize

    if getattr(serialize, "typing", None) is not typing:
        yield
        return
    serialize.typing = _typing_with_cached_hints()
    try:
        yield
    finally:
        serialize.typing = typing


EXPORT = Backend(name="export", check=nothing_to_check, build=build, save=save, load=load, cached=True)
