"""The eager backend: each graph is the GraphModule itself with the reference ops (plain
torch); the reference for every test. Nothing is saved: a load builds the graphs again."""

from __future__ import annotations

from pathlib import Path

from neuronfx.config.plan import GraphSpec, Plan
from neuronfx.graphs.backends.records import Backend, Built, Graph, build_each, no_files, nothing_to_check
from neuronfx.graphs.kernels.bundles import REFERENCE_OPS
from neuronfx.graphs.models.layers import Weights
from neuronfx.graphs.phases.compose import build_module
from neuronfx.graphs.phases.inputs import KVCache


def _eager_graph(plan: Plan, spec: GraphSpec, weights: Weights, kv: KVCache) -> Graph:
    return build_module(plan, spec, REFERENCE_OPS)


def build(plan: Plan, weights: Weights, progress: bool, kernels: Path | None = None) -> Built:
    """Every graph of ``plan`` with the reference ops (``kernels``: unused, nothing is compiled)."""
    graphs, seconds = build_each(plan, weights, _eager_graph, progress)
    return Built(graphs=graphs, seconds=seconds)


EAGER = Backend(name="eager", check=nothing_to_check, build=build, save=no_files,
                load=lambda plan, weights, src: build(plan, weights, False), cached=False,
                traces=False)
