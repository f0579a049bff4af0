"""Runtime: (plan, compiled graphs keyed by (phase, bucket), shared weights). Immutable."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping

import attrs
import torch
from tqdm.auto import tqdm

from neuronfx.config.plan import Plan
from neuronfx.errors import ConfigError
from neuronfx.memory import trim_heap
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
    - ``compile_s``: (phase, batch_size, bucket) -> seconds spent building (or loading) that graph.
    - ``compiled_dir``: the directory of the backend's compiled files that ``neuronfx.save``
      ships (inductor: its kernel cache, a private copy); None for eager and export.
    - ``cache_key``: the compile-cache key the graphs came from or went into (None: no cache).
    """

    plan: Plan
    weights: Weights
    graphs: Mapping[tuple[str, int, int], Graph]
    compile_s: Mapping[tuple[str, int, int], float]
    compiled_dir: str | None = None
    cache_key: str | None = None


def compile(
    plan: Plan,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    progress: bool = True,
    cache: bool | str | os.PathLike | None = None,
) -> Runtime:
    """Compile every (phase, bucket) graph of ``plan`` with its backend.

    ``state_dict``: HF-named tensors (e.g. ``model.state_dict()`` of a transformers model); when
    None the weights are loaded from ``plan.checkpoint``. ``cache``: the compile cache
    (:mod:`neuronfx.cache`): None (default) uses it for the compiled backends (``export``,
    ``inductor``) and not for ``eager``; True uses it, False does not; a path uses the cache in
    that directory instead of ``$NEURONFX_CACHE_DIR`` (default ``~/.cache/neuronfx``). A cached
    plan loads its graphs instead of compiling them; the cache holds graph files only, never
    weights: the runtime always runs on ``state_dict``. Raises ConfigError when no weights are
    given or ``cache`` is not one of those, CheckpointError for missing/extra/mis-shaped
    tensors, BackendUnavailableError for a backend whose optional dependencies are missing.
    """
    from neuronfx.cache import compile_graphs, resolve_cache  # the cache imports this module

    root = resolve_cache(cache, plan.inference.backend)
    if state_dict is None:
        if plan.checkpoint is None:
            raise ConfigError("compile(plan) needs weights: pass state_dict= or build the plan with a checkpoint path.")
        from neuronfx.checkpoints import load_checkpoint  # I/O at the edge

        state_dict = load_checkpoint(plan.checkpoint).state_dict
    weights = convert_hf_state_dict(dict(state_dict), plan.model, plan.inference.dtype)
    runtime = compile_graphs(plan, weights, root, progress)
    trim_heap()  # tracing and codegen garbage would otherwise stay resident
    return runtime


def build_graphs(plan: Plan, weights: Weights, progress: bool = True, builder: Callable = build_graph) -> tuple[dict, dict]:
    """Build every graph of ``plan`` with ``builder`` (default: its backend's), no cache:
    (graphs, seconds) keyed by (phase, batch_size, bucket)."""
    template_kv = list(empty_state(plan).kv)  # trace-time cache; live states allocate their own
    graphs, times = {}, {}
    bar = tqdm(plan.graphs, desc=f"compile ({plan.inference.backend})", disable=not progress, unit="graph")
    for spec in bar:
        bar.set_postfix_str(f"{spec.phase} {spec.batch_size}x{spec.bucket}")
        t0 = time.perf_counter()
        graphs[spec.key] = builder(plan, spec, weights, template_kv)
        times[spec.key] = time.perf_counter() - t0
    return graphs, times


def init_state(runtime: Runtime, seed: int = 0) -> State:
    """A fresh state for ``runtime``: zero KV cache (``runtime.plan.kv.nbytes`` bytes), all slots
    free, RNG key ``seed`` (same seed and inputs give the same sampled tokens)."""
    return empty_state(runtime.plan, seed)
