"""Runtime: (plan, compiled graphs keyed by (phase, bucket), shared weights). Immutable."""

from __future__ import annotations

import time
from collections.abc import Mapping

import attrs
import torch
from tqdm.auto import tqdm

from neuronfx.config.plan import Plan
from neuronfx.errors import ConfigError
from neuronfx.graphs.backends import Graph, build_graph
from neuronfx.graphs.layers import Weights
from neuronfx.graphs.weights import convert_hf_state_dict
from neuronfx.runtime.state import State, empty_state


@attrs.frozen(kw_only=True, eq=False)
class Runtime:
    """A compiled plan.

    - ``plan``: the Plan it was compiled for.
    - ``weights``: neuronfx weight name -> tensor in the plan's dtype, one copy shared by all graphs.
    - ``graphs``: (phase, batch_size, bucket) -> callable ``graph(weights, kv, *step_inputs)``.
    - ``compile_s``: (phase, batch_size, bucket) -> seconds spent building that graph.
    """

    plan: Plan
    weights: Weights
    graphs: Mapping[tuple[str, int, int], Graph]
    compile_s: Mapping[tuple[str, int, int], float]


def compile(plan: Plan, state_dict: Mapping[str, torch.Tensor] | None = None, progress: bool = True) -> Runtime:
    """Compile every (phase, bucket) graph of ``plan`` with its backend.

    ``state_dict``: HF-named tensors (e.g. ``model.state_dict()`` of a transformers model); when
    None the weights are loaded from ``plan.checkpoint``. Raises ConfigError when neither is given,
    CheckpointError for missing/extra/mis-shaped tensors, BackendUnavailableError for a backend
    whose optional dependencies are missing.
    """
    if state_dict is None:
        if plan.checkpoint is None:
            raise ConfigError("compile(plan) needs weights: pass state_dict= or build the plan with a checkpoint path.")
        from neuronfx.checkpoints import load_checkpoint  # I/O at the edge

        state_dict = load_checkpoint(plan.checkpoint).state_dict
    weights = convert_hf_state_dict(dict(state_dict), plan.model, plan.inference.dtype)
    template_kv = list(empty_state(plan).kv)  # trace-time cache; live states allocate their own
    graphs, times = {}, {}
    bar = tqdm(plan.graphs, desc=f"compile ({plan.inference.backend})", disable=not progress, unit="graph")
    for spec in bar:
        bar.set_postfix_str(f"{spec.phase} {spec.batch_size}x{spec.bucket}")
        t0 = time.perf_counter()
        graphs[spec.key] = build_graph(plan, spec, weights, template_kv)
        times[spec.key] = time.perf_counter() - t0
    return Runtime(plan=plan, weights=weights, graphs=graphs, compile_s=times)


def init_state(runtime: Runtime, seed: int = 0) -> State:
    """A fresh state for ``runtime``: zero KV cache (``runtime.plan.kv.nbytes`` bytes), all slots
    free, RNG key ``seed`` (same seed and inputs give the same sampled tokens)."""
    return empty_state(runtime.plan, seed)
