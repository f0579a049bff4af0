"""Backends: how a plan's GraphSpecs become callables, and what of them is saved.

Every graph, whatever built it, is called ``graph(weights, kv, inputs)`` with ``kv`` the KV
cache (one LayerKV per layer) and ``inputs`` its phase's step-input record, and returns a dict
of output tensors. Each backend is a record (``records.Backend``: build, save, load, what a
cache entry holds) in its own module; :data:`BACKENDS` is the one table keyed by backend name,
and nothing outside ``graphs/`` branches on a backend's name.

- eager (``eager.py``): the GraphModule itself with the reference ops; the reference for every
  test.
- export (``export.py``): ``torch.export.export`` per (phase, batch, bucket) with the
  reference ops, saved as ``graphs/*.pt2``.
- inductor (``inductor.py``): each part of a phase compiled with the CPU kernel ops,
  precompiled so it saves and loads without re-tracing; the default. On CUDA: torch ops and
  Triton kernels, each graph captured as a CUDA graph (``cuda_graphs.py``).
- neuron (``neuron.py``): needs torch-neuronx / neuronx-distributed, imported lazily.
"""

from __future__ import annotations

from neuronfx.errors import ConfigError
from neuronfx.graphs.backends.eager import EAGER
from neuronfx.graphs.backends.export import EXPORT
from neuronfx.graphs.backends.inductor import INDUCTOR
from neuronfx.graphs.backends.neuron import NEURON
from neuronfx.graphs.backends.records import Backend, Built, Graph, GraphKey

__all__ = ["BACKENDS", "Backend", "Built", "Graph", "GraphKey", "check_backend", "get_backend", "prepare_backend"]

BACKENDS: dict[str, Backend] = {b.name: b for b in (EAGER, EXPORT, INDUCTOR, NEURON)}
"""The one table of backends, keyed by ``InferenceConfig.backend``."""


def get_backend(name: str) -> Backend:
    """The record of backend ``name``; ConfigError naming the choices for any other name."""
    if name not in BACKENDS:
        raise ConfigError(f"backend={name!r} is not one of {sorted(BACKENDS)}.")
    return BACKENDS[name]


def check_backend(name: str) -> None:
    """Raise BackendUnavailableError if backend ``name``'s optional dependencies are missing
    (cheap; call it before loading weights)."""
    get_backend(name).check()


def prepare_backend(name: str) -> None:
    """Start backend ``name``'s preparation in the background (``Backend.prepare``); call it
    after :func:`check_backend`, before loading weights."""
    get_backend(name).prepare()
