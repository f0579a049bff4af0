"""Backends: turn a (phase, bucket) GraphSpec into a callable ``graph(weights, kv, *step_inputs)``.

- eager: the GraphModule itself, called directly; the reference for every test.
- export: ``torch.export.export`` per (phase, bucket); the KV cache is updated in place (the
  exported program keeps the ``index_put_`` on the input) and weights are inputs, so all
  programs share one copy.
- neuron: needs torch-neuronx / neuronx-distributed (optional extra ``neuron``), imported lazily.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from neuronfx.config.plan import GraphSpec, Plan
from neuronfx.errors import BackendUnavailableError, ConfigError
from neuronfx.graphs.layers import Weights
from neuronfx.graphs.phases import GraphModule

Graph = Callable[..., dict[str, torch.Tensor]]
TORCH_DTYPES = {"int32": torch.int32, "float32": torch.float32}


def example_inputs(spec: GraphSpec) -> tuple[torch.Tensor, ...]:
    """Zero-filled trace inputs from the spec (prompt_lens and sampling rows set to valid values)."""
    out = []
    for t in spec.inputs:
        fill = 1 if t.name in ("prompt_lens", "sampling_params") else 0
        out.append(torch.full(t.shape, fill, dtype=TORCH_DTYPES[t.dtype]))
    return tuple(out)


def build_eager(plan: Plan, spec: GraphSpec, weights: Weights, kv: list[torch.Tensor]) -> Graph:
    return GraphModule(plan, spec)


def build_export(plan: Plan, spec: GraphSpec, weights: Weights, kv: list[torch.Tensor]) -> Graph:
    # ``kv`` is compile's template cache, not a live state: tracing may write into it.
    args = (weights, kv, *example_inputs(spec))
    program = torch.export.export(GraphModule(plan, spec), args, strict=False)
    return program.module()


def build_neuron(plan: Plan, spec: GraphSpec, weights: Weights, kv: list[torch.Tensor]) -> Graph:
    try:
        import torch_neuronx  # noqa: F401
    except Exception as exc:  # the PyPI placeholder raises on import, not just ImportError
        raise BackendUnavailableError(
            "backend='neuron' needs torch-neuronx and neuronx-distributed from AWS's Neuron package "
            "index (pip install 'neuronfx[neuron]' on a Trainium/Inferentia host); use backend='eager' "
            "or 'export' elsewhere."
        ) from exc
    raise BackendUnavailableError("backend='neuron' tracing is not implemented yet; use 'eager' or 'export'.")


BUILDERS = {"eager": build_eager, "export": build_export, "neuron": build_neuron}


def build_graph(plan: Plan, spec: GraphSpec, weights: Weights, kv: list[torch.Tensor]) -> Graph:
    """Build one graph with the plan's backend; raises ConfigError for an unknown backend."""
    backend = plan.inference.backend
    if backend not in BUILDERS:
        raise ConfigError(f"backend={backend!r} is not one of {sorted(BUILDERS)}.")
    return BUILDERS[backend](plan, spec, weights, kv)
