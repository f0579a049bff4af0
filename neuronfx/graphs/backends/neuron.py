"""The neuron backend: needs torch-neuronx / neuronx-distributed (optional extra ``neuron``,
from AWS's Neuron package index), imported lazily; the PyPI packages of those names are
placeholders that raise on import."""

from __future__ import annotations

from pathlib import Path

from neuronfx.config.plan import Plan
from neuronfx.errors import BackendUnavailableError
from neuronfx.graphs.backends.records import Backend, Built, no_files
from neuronfx.graphs.models.layers import Weights


def check() -> None:
    """BackendUnavailableError unless torch-neuronx imports (AWS's package, not PyPI's placeholder)."""
    try:
        import torch_neuronx  # noqa: F401
    except Exception as exc:  # the PyPI placeholder raises on import, not just ImportError
        raise BackendUnavailableError(
            "backend='neuron' needs torch-neuronx and neuronx-distributed from AWS's Neuron package "
            "index (pip install 'neuronfx[neuron]' on a Trainium/Inferentia host); use backend='eager', "
            "'export' or 'inductor' elsewhere."
        ) from exc


def build(plan: Plan, weights: Weights, progress: bool, kernels: Path | None = None) -> Built:
    """BackendUnavailableError: tracing for Neuron is not written yet."""
    check()
    raise BackendUnavailableError("backend='neuron' tracing is not implemented yet; use 'eager', 'export' or 'inductor'.")


NEURON = Backend(name="neuron", check=check, build=build, save=no_files, load=lambda plan, weights, src: build(plan, weights, False),
                 cached=False)
