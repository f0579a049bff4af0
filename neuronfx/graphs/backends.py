"""Backends: turn a (phase, bucket) GraphSpec into a callable ``graph(weights, kv, *step_inputs)``.

- eager: the GraphModule itself, called directly; the reference for every test.
- export: ``torch.export.export`` per (phase, bucket); the KV cache is updated in place (the
  exported program keeps the ``index_put_`` on the input) and weights are inputs, so all
  programs share one copy.
- inductor: ``torch.compile`` (inductor) of each part of a phase (prologue, a group of
  decoder layers reused for every group, epilogue) per (phase, bucket); the fastest on CPU
  (the default). The parts are compiled with torch's ``aot_compile`` (graphs/precompiled.py)
  so that runtimes and compile-cache entries can be saved and loaded without re-tracing.
- neuron: needs torch-neuronx / neuronx-distributed (optional extra ``neuron``), imported lazily.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from neuronfx.config.plan import GraphSpec, Plan
from neuronfx.config.sampling import SamplingParams, pack_sampling
from neuronfx.errors import BackendUnavailableError, ConfigError
from neuronfx.graphs.layers import Weights
from neuronfx.graphs.phases import GraphModule, phase_num_layers, phase_parts

Graph = Callable[..., dict[str, torch.Tensor]]
TORCH_DTYPES = {"int32": torch.int32, "float32": torch.float32, "bool": torch.bool}


def example_inputs(plan: Plan, spec: GraphSpec) -> tuple[torch.Tensor, ...]:
    """Trace inputs from the spec: zeros, except prompt_lens (1) and greedy sampling rows."""
    greedy = pack_sampling([SamplingParams()] * spec.batch_size, plan.topk_width)
    out = []
    for t in spec.inputs:
        if t.name == "sampling_params":
            out.append(torch.tensor(greedy, dtype=torch.float32))
        else:
            out.append(torch.full(t.shape, int(t.name == "prompt_lens"), dtype=TORCH_DTYPES[t.dtype]))
    return tuple(out)


def build_eager(plan: Plan, spec: GraphSpec, weights: Weights, kv: list[torch.Tensor]) -> Graph:
    return GraphModule(phase_parts(plan, spec), spec.phase, phase_num_layers(plan, spec.phase))


@attrs.frozen(eq=False)
class ExportedGraph:
    """An exported (phase, batch, bucket) graph: the ExportedProgram (what ``neuronfx.save``
    writes) and its runnable module."""

    program: torch.export.ExportedProgram
    module: Callable[..., dict[str, torch.Tensor]]

    def __call__(self, *args: object) -> dict[str, torch.Tensor]:
        return self.module(*args)


def build_export(plan: Plan, spec: GraphSpec, weights: Weights, kv: list[torch.Tensor]) -> Graph:
    # ``kv`` is compile's template cache, not a live state: tracing may write into it.
    args = (weights, kv, *example_inputs(plan, spec))
    module = GraphModule(phase_parts(plan, spec), spec.phase, phase_num_layers(plan, spec.phase))
    program = torch.export.export(module, args, strict=False)
    return ExportedGraph(program=program, module=program.module())


MAX_LAYER_GROUP = 10
"""Layers per compiled call in the inductor backend: bigger groups cut per-call overhead (about
0.2 ms each), smaller ones cut compile time (it grows with the traced graph)."""


def layer_group_size(num_layers: int, limit: int = MAX_LAYER_GROUP) -> int:
    """Largest divisor of ``num_layers`` not above ``limit`` (SmolLM2's 30 layers -> 10)."""
    return max(d for d in range(1, min(num_layers, limit) + 1) if num_layers % d == 0)


def build_inductor(plan: Plan, spec: GraphSpec, weights: Weights, kv: list[torch.Tensor]) -> Graph:
    """Inductor graph whose parts are compiled with torch's ``aot_compile`` (graphs/precompiled.py),
    so the runtime can be saved and reloaded without re-tracing."""
    from neuronfx.graphs.precompiled import build  # precompiled imports this module

    return build(plan, spec, weights, kv)


def check_backend(backend: str) -> None:
    """Raise BackendUnavailableError if ``backend``'s optional dependencies are missing
    (cheap; call it before loading weights)."""
    if backend != "neuron":
        return
    try:
        import torch_neuronx  # noqa: F401
    except Exception as exc:  # the PyPI placeholder raises on import, not just ImportError
        raise BackendUnavailableError(
            "backend='neuron' needs torch-neuronx and neuronx-distributed from AWS's Neuron package "
            "index (pip install 'neuronfx[neuron]' on a Trainium/Inferentia host); use backend='eager', "
            "'export' or 'inductor' elsewhere."
        ) from exc


def build_neuron(plan: Plan, spec: GraphSpec, weights: Weights, kv: list[torch.Tensor]) -> Graph:
    check_backend("neuron")
    raise BackendUnavailableError("backend='neuron' tracing is not implemented yet; use 'eager' or 'export'.")


BUILDERS = {"eager": build_eager, "export": build_export, "inductor": build_inductor, "neuron": build_neuron}


def build_graph(plan: Plan, spec: GraphSpec, weights: Weights, kv: list[torch.Tensor]) -> Graph:
    """Build one graph with the plan's backend; raises ConfigError for an unknown backend."""
    backend = plan.inference.backend
    if backend not in BUILDERS:
        raise ConfigError(f"backend={backend!r} is not one of {sorted(BUILDERS)}.")
    return BUILDERS[backend](plan, spec, weights, kv)
