"""Where a plan's tensors live: the few helpers every device placement goes through.

A plan names its device (``InferenceConfig.device``: "cpu", "cuda", "cuda:N"). The weights, the
KV cache and each graph's step inputs are on that device; the host keeps the bookkeeping
(``cache_lens``, ``generated``, ``live``, prompts) and the sampler's per-slot counts, which
the steps build on the host from Python lists. A step builds its input record on the host and
:func:`to_device` moves it in one non-blocking copy per tensor (pinned host memory, so the copy
does not wait for the GPU: vLLM's ``InputBatch`` does the same with its pinned CPU buffers); the
graph runs under :func:`device_scope` (its GPU current) and makes every tensor of its own on its
inputs' device (RoPE's tables too: nothing is copied in from the host during a step or a CUDA
graph capture); :func:`to_host` brings the outputs back,
the one synchronisation of a step (it reads the sampled tokens). On the CPU every helper is the
identity: the CPU path does exactly what it did before devices existed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from neuronfx.config.inference import InferenceConfig
from neuronfx.config.inference_checks import is_cuda
from neuronfx.config.plan import Plan
from neuronfx.errors import ConfigError

Tensor = torch.Tensor


def plan_device(plan: Plan) -> torch.device:
    """The torch device ``plan``'s tensors live on: cpu; "cuda" is cuda:rank (tensor-parallel
    rank r on GPU r; cuda:0 for one rank); "cuda:N" is cuda:N."""
    name = plan.inference.device
    if name == "cuda":
        return torch.device("cuda", plan.rank)
    return torch.device(name)


def check_device(inference: InferenceConfig) -> None:
    """ConfigError, before anything is loaded, when ``inference.device`` is not on this machine:
    a CUDA device where torch sees none (no GPU, or a CPU-only torch build), or an index past
    the count ("cuda" under tensor parallelism needs ``tp_degree`` GPUs, cuda:0 .. cuda:tp-1)."""
    name = inference.device
    if not is_cuda(name):
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device={name!r} but torch sees no CUDA device here (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda or 'none'}); run on a machine with an NVIDIA GPU and a CUDA build "
            "of torch, or pass device='cpu' (CLI: --device cpu)."
        )
    count = torch.cuda.device_count()
    index = int(name.partition(":")[2] or 0) if name != "cuda" else inference.tp_degree - 1
    if index >= count:
        need = (f"tp_degree={inference.tp_degree} needs {inference.tp_degree} GPUs, one per rank" if name == "cuda"
                else f"the largest index here is cuda:{count - 1}")
        raise ConfigError(
            f"device={name!r} needs cuda:{index} but this machine has {count} CUDA device(s): {need}; "
            "pass an index below the count (CUDA_VISIBLE_DEVICES renumbers them from 0), or device='cpu'."
        )


def device_scope(plan: Plan) -> contextlib.AbstractContextManager:
    """The context a graph of ``plan`` is traced, captured and run in: on CUDA, ``plan``'s GPU
    as torch's current CUDA device (streams, CUDA graphs and memory pools are per device); on the
    CPU nothing. The graph code names the device of every tensor it makes (``device=x.device``),
    so no host tensor is copied in inside a step or a capture."""
    if plan.inference.device == "cpu":
        return contextlib.nullcontext()
    return torch.cuda.device(plan_device(plan))


def to_device(tree: object, device: torch.device | str) -> object:
    """``tree`` (tensors in dicts, lists, tuples and NamedTuples, e.g. weights, a KV cache or a
    step-input record) with every tensor on ``device``; tensors already there are kept as they
    are (no copy), and a tensor shared by two leaves (tied embeddings) stays one tensor. A host
    tensor bound for a CUDA device goes through pinned memory with ``non_blocking=True``, so no
    copy waits for the GPU. Other leaves (None, ints) are kept. When no tensor moves (a CPU
    plan) ``tree`` itself is returned."""
    device = torch.device(device)
    moved: dict[int, Tensor] = {}

    def move(t: Tensor) -> Tensor:
        if _same_device(t.device, device):
            return t
        if id(t) not in moved:
            moved[id(t)] = _copy_to(t, device)
        return moved[id(t)]

    mapped = _map_tensors(tree, move)
    return tree if not moved else mapped  # nothing moved (the CPU): the caller's own objects, untouched


def to_host(outputs: Mapping[str, object]) -> dict[str, object]:
    """A graph's outputs (name -> tensor) on the host. From a CUDA device: every copy started
    without waiting (into pinned memory), then one wait for the stream, the step's only one (it
    reads the sampled tokens). CPU outputs are returned as they are."""
    if not any(isinstance(v, Tensor) and v.device.type == "cuda" for v in outputs.values()):
        return dict(outputs)
    host = {k: v.to("cpu", non_blocking=True) if isinstance(v, Tensor) else v for k, v in outputs.items()}
    torch.cuda.current_stream().synchronize()
    return host


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return b.index is None or a.index == b.index


def _copy_to(t: Tensor, device: torch.device) -> Tensor:
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _map_tensors(tree: object, fn: object, memo: dict[int, object] | None = None) -> object:
    """``tree`` with ``fn`` applied to every tensor; a container met twice (a tied quantized
    record: embed and lm_head) is mapped once, so what was one object stays one object."""
    memo = {} if memo is None else memo
    if isinstance(tree, Tensor):
        return fn(tree)  # type: ignore[operator]
    if id(tree) in memo:
        return memo[id(tree)]
    if isinstance(tree, dict):
        out: object = {k: _map_tensors(v, fn, memo) for k, v in tree.items()}
    elif isinstance(tree, tuple) and type(tree) is not tuple:  # NamedTuple records (LayerKV, step inputs, quantized weights)
        out = type(tree)(*(_map_tensors(v, fn, memo) for v in tree))
    elif isinstance(tree, (list, tuple)):
        out = type(tree)(_map_tensors(v, fn, memo) for v in tree)
    else:
        return tree
    memo[id(tree)] = out
    return out
