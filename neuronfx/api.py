"""The public API that orchestrates the layers below it: ``compile`` (checkpoint -> weights ->
graphs, through the compile cache), ``save`` / ``load`` of compiled runtimes, ``push_to_hub``.

Layers import one way: config <- graphs <- runtime <- (checkpoints, artifacts, cache) <- this
module <- the front ends (cli, bench, accuracy). tests/test_layers.py checks it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from neuronfx.config.inference import InferenceConfig
from neuronfx.config.plan import Plan, plan_for_rank
from neuronfx.config.quantization import quantized_formats
from neuronfx.config.serialization import unstructure
from neuronfx.errors import ConfigError
from neuronfx.graphs.backends import get_backend
from neuronfx.graphs.models.layers import Weights
from neuronfx.graphs.models.quant import BLOCK_TYPES
from neuronfx.graphs.phases.device import check_device, plan_device, to_device
from neuronfx.io.artifacts import load, push_to_hub, save
from neuronfx.io.cache import compile_graphs, resolve_cache
from neuronfx.io.checkpoints import load_checkpoint
from neuronfx.io.weights import convert_hf_state_dict, weights_fingerprint
from neuronfx.memory import trim_heap
from neuronfx.runtime.distributed import check_agreement, digest, init_tensor_parallel, launch
from neuronfx.runtime.runtime import Runtime

__all__ = ["compile", "launch", "load", "push_to_hub", "save"]


def check_weight_source(inference: InferenceConfig, checkpoint: str | os.PathLike) -> None:
    """ConfigError when ``inference``'s weight format cannot come from ``checkpoint``: "gguf" keeps a
    GGUF file's blocks, so it needs a ``.gguf`` file (int8 / int4 quantize any float checkpoint)."""
    if inference.weight_format == "gguf" and not str(checkpoint).endswith(".gguf"):
        raise ConfigError(
            f"weight_format='gguf' keeps a GGUF file's quantized blocks, but the checkpoint {str(checkpoint)!r} is not a .gguf "
            "file; pass a .gguf file, or weight_format='int8' / 'int4' to quantize these weights at load."
        )


def check_blocks(plan: Plan, state_dict: Mapping[str, object]) -> None:
    """ConfigError when a "gguf" plan's weights hold no Q4_0 / Q4_1 / Q8_0 block to keep (e.g. an
    F16 or k-quant GGUF, or a float state dict)."""
    if plan.inference.weight_format == "gguf" and not any(isinstance(t, BLOCK_TYPES) for t in state_dict.values()):
        raise ConfigError(
            "weight_format='gguf' found no Q4_0, Q4_1 or Q8_0 tensor to keep in these weights (other GGUF types are "
            "dequantized); use weight_format='int8' or 'int4' to quantize them, or 'float'."
        )


def _rank_weights(plan: Plan, state_dict: Mapping[str, torch.Tensor] | None) -> Weights:
    """This rank's neuronfx weights of ``state_dict`` (read from ``plan.checkpoint`` when None:
    a safetensors checkpoint under tensor parallelism slice by slice), on the plan's device;
    the ranks check they were given the same weights. Raises what :func:`compile` documents."""
    tp = plan.inference.tp_degree
    if state_dict is None:
        if plan.checkpoint is None:
            raise ConfigError("compile(plan) needs weights: pass state_dict= or build the plan with a checkpoint path.")
        check_weight_source(plan.inference, plan.checkpoint)
        state_dict = load_checkpoint(plan.checkpoint, lazy=tp > 1, gguf_blocks=plan.inference.weight_format == "gguf").state_dict
    check_blocks(plan, state_dict)
    if tp > 1:
        check_agreement("weights", weights_fingerprint(state_dict))
    weights = convert_hf_state_dict(dict(state_dict), plan.model, plan.inference.dtype, plan.shard,
                                    quantized_formats(plan.inference), plan.inference.weight_group_size)
    weights = get_backend(plan.inference.backend).prepare_weights(plan, weights)  # e.g. int8 packed for its kernel
    return to_device(weights, plan_device(plan))  # a checkpoint read here: only this rank's shard stays resident


def compile(
    plan: Plan,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    progress: bool = True,
    cache: bool | str | os.PathLike | None = None,
) -> Runtime:
    """Compile every (phase, batch, bucket) graph of ``plan`` with its backend.

    ``state_dict``: HF-named tensors (e.g. ``model.state_dict()`` of a transformers model); None
    loads ``plan.checkpoint``. ``cache``: the compile cache (:mod:`neuronfx.io.cache`): None
    (default) uses it for ``export`` and ``inductor``, True / False turn it on / off, a path
    picks its directory (default ``$NEURONFX_CACHE_DIR``, else ``~/.cache/neuronfx``). A cached
    plan loads its graphs; entries hold no weights, so the runtime always runs on ``state_dict``
    (``runtime.from_cache`` says whether it hit). ``progress``: a bar per compile and one line
    per cache event on stderr; False: the same lines through the ``neuronfx.cache`` and
    ``neuronfx.compile`` loggers. Raises ConfigError when no weights are given, ``cache`` is none
    of those or the plan's CUDA device is missing (before anything loads), CheckpointError for
    missing/extra/mis-shaped tensors, BackendUnavailableError for a backend whose optional
    dependencies are missing.

    Tensor parallel (``tp_degree`` > 1): call it on every rank (under torchrun or
    :func:`launch`); each rank gets its plan (``runtime.plan.rank``) and keeps only its shard,
    read slice by slice from a safetensors checkpoint (a GGUF file or a ``state_dict`` is read
    whole, then sliced); the ranks check they got the same plan and weights. Raises ConfigError
    when this process is not one of ``tp_degree`` ranks, TensorParallelError on disagreement.
    """
    check_device(plan.inference)  # a CUDA device this machine lacks: before anything loads
    backend = get_backend(plan.inference.backend)
    backend.check()  # before the (slow) checkpoint read
    if plan.inference.device == "cpu":  # the CPU kernels and compiler probes; CUDA needs none of them
        backend.prepare()  # overlaps it
    root = resolve_cache(cache, plan.inference.backend)
    plan = plan_for_rank(plan, init_tensor_parallel(plan.inference.tp_degree))
    check_agreement("plans", digest(repr((unstructure(plan.model), unstructure(plan.inference)))))
    weights = _rank_weights(plan, state_dict)
    runtime = compile_graphs(plan, weights, root, progress)
    if state_dict is None or (backend.traces and not runtime.from_cache):
        trim_heap()  # reading and tracing garbage would stay resident; skipped otherwise: 0.2 s a call
    return runtime
