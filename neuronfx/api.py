"""The public API that orchestrates the layers below it: ``compile`` (checkpoint -> weights ->
graphs, through the compile cache), ``save`` / ``load`` of compiled runtimes, ``push_to_hub``.

Layers import one way: config <- graphs <- runtime <- (checkpoints, artifacts, cache) <- this
module <- the front ends (cli, bench). tests/test_layers.py checks it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from neuronfx.artifacts import load, push_to_hub, save
from neuronfx.cache import compile_graphs, resolve_cache
from neuronfx.checkpoints import load_checkpoint
from neuronfx.config.plan import Plan
from neuronfx.errors import ConfigError
from neuronfx.graphs.backends import get_backend
from neuronfx.graphs.weights import convert_hf_state_dict
from neuronfx.memory import trim_heap
from neuronfx.runtime.runtime import Runtime

__all__ = ["compile", "load", "push_to_hub", "save"]


def compile(
    plan: Plan,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    progress: bool = True,
    cache: bool | str | os.PathLike | None = None,
) -> Runtime:
    """Compile every (phase, batch, bucket) graph of ``plan`` with its backend.

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
    get_backend(plan.inference.backend).check()  # before the (slow) checkpoint read
    root = resolve_cache(cache, plan.inference.backend)
    if state_dict is None:
        if plan.checkpoint is None:
            raise ConfigError("compile(plan) needs weights: pass state_dict= or build the plan with a checkpoint path.")
        state_dict = load_checkpoint(plan.checkpoint).state_dict
    weights = convert_hf_state_dict(dict(state_dict), plan.model, plan.inference.dtype)
    runtime = compile_graphs(plan, weights, root, progress)
    trim_heap()  # tracing and codegen garbage would otherwise stay resident
    return runtime
