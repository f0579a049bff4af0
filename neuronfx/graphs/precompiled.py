"""Inductor graphs that can be saved and loaded without re-tracing (torch's precompile API).

Each part of a (phase, batch, bucket) graph (prologue, one layer group reused for every group,
epilogue) is compiled with ``torch.compile(fullgraph=True, dynamic=False).aot_compile`` on its
first call: the same inductor compile as the ``inductor`` backend, but the result is an
``AOTCompiledFunction`` that ``save_compiled_function`` writes to a file and
``torch.compiler.load_compiled_function`` reads back with no dynamo tracing and no inductor
lowering. The kernels it calls are C++ libraries in torch's inductor cache directory, so a
saved runtime ships that directory too (neuronfx/artifacts.py). Weights and KV cache stay
inputs (KV mutated in place), shared by all graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from neuronfx.config.plan import GraphSpec, Plan
from neuronfx.graphs.backends import example_inputs, layer_group_size
from neuronfx.graphs.layers import Weights
from neuronfx.graphs.phases import GraphModule, PhaseParts, phase_num_layers, phase_parts

PART_NAMES = ("prologue", "layers", "epilogue")


class PrecompiledPart:
    """One graph part: compiled ahead of time on its first call (with that call's arguments as
    the example), or given an already compiled (loaded) function."""

    def __init__(self, fn: Callable | None, compiled: Callable | None = None):
        self.fn = fn
        self.compiled = compiled

    def __call__(self, *args: torch.Tensor) -> object:
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, fullgraph=True, dynamic=False).aot_compile((args, {}))
        return self.compiled(*args)


def build(plan: Plan, spec: GraphSpec, weights: Weights, kv: list[torch.Tensor]) -> GraphModule:
    """Compile one (phase, batch, bucket) graph now (one run on the template ``kv``)."""
    layers = phase_num_layers(plan, spec.phase)
    graph = GraphModule(phase_parts(plan, spec, group_size=layer_group_size(layers), wrap=PrecompiledPart), spec.phase, layers)
    with torch.no_grad():
        graph(weights, kv, *example_inputs(plan, spec))
    return graph


def part_files(spec: GraphSpec) -> list[str]:
    """Relative file names of a graph's three parts."""
    return [f"precompiled/{spec.phase}-b{spec.batch_size}-t{spec.bucket}-{name}.bin" for name in PART_NAMES]


def save(graph: GraphModule, spec: GraphSpec, out: Path) -> list[str]:
    """Write the graph's compiled parts under ``out``; returns their relative names."""
    names = part_files(spec)
    (out / "precompiled").mkdir(parents=True, exist_ok=True)
    for name, part in zip(names, (graph.parts.prologue, graph.parts.layers, graph.parts.epilogue)):
        part.compiled.save_compiled_function(str(out / name))
    return names


def load(plan: Plan, spec: GraphSpec, src: Path) -> GraphModule:
    """The graph from its saved parts (torch's inductor cache directory must hold its kernels,
    or they are compiled again from the saved source)."""
    register_custom_ops()
    fns = []
    for name in part_files(spec):
        with open(src / name, "rb") as f:
            fns.append(PrecompiledPart(None, torch.compiler.load_compiled_function(f)))
    layers = phase_num_layers(plan, spec.phase)
    parts = PhaseParts(prologue=fns[0], layers=fns[1], epilogue=fns[2], group_size=layer_group_size(layers))
    return GraphModule(parts, spec.phase, layers)


def register_custom_ops() -> None:
    """Register neuronfx's custom ops (kernels.py): compiled or exported code may call them;
    tracing registers them, loading must too."""
    from neuronfx.graphs.kernels import small_gemm_available

    small_gemm_available()
