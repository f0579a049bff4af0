"""Collectives inside graphs: torch's functional collectives over the default process group.

Functional collectives (``torch.distributed._functional_collectives``) are plain ops that
eager mode runs, ``torch.export`` keeps and inductor compiles into its graphs, so one model
function serves every backend. A graph names its group by the default group's name (a
string), so compiled and saved graphs hold no process-group object.

All-reduce is an all-gather followed by a sum over ranks in rank order: gloo's all-reduce
measured 1.3-1.9 ms per call on this 2-core host against 0.5 ms for an all-gather of the same
tensor (its ring algorithm needs several rounds for two ranks), and the fixed summation order
makes every rank's result bitwise equal, so every rank samples the same token. The
reduce-scatter of sequence-parallel prefill is the same all-gather, summed over the rank's
rows only. :func:`tensor_parallel_ops` puts these collectives into an ops bundle.
"""

from __future__ import annotations

import functools

import attrs
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from neuronfx.errors import ConfigError
from neuronfx.graphs.models.ops import Ops, identity

Tensor = torch.Tensor


def world_group(tp_degree: int) -> str:
    """The default process group's name, checked to span ``tp_degree`` ranks. Raises
    ConfigError when no process group is initialised or it has another size."""
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            f"tp_degree={tp_degree} needs {tp_degree} processes in a torch.distributed process group: run under "
            f"`torchrun --nproc-per-node {tp_degree}` or through neuronfx.launch(fn, tp_degree={tp_degree})."
        )
    if dist.get_world_size() != tp_degree:
        raise ConfigError(
            f"tp_degree={tp_degree} but the process group has {dist.get_world_size()} ranks; start "
            f"{tp_degree} processes (torchrun --nproc-per-node {tp_degree}) or set tp_degree={dist.get_world_size()}."
        )
    return dist.group.WORLD.group_name


def _stacked(x: Tensor, tp_degree: int, group: str) -> Tensor:
    """Every rank's ``x`` stacked in rank order: (tp, *x.shape)."""
    return funcol.all_gather_single(x.contiguous(), 0, group).view(tp_degree, *x.shape)


def all_reduce(x: Tensor, tp_degree: int, group: str) -> Tensor:
    """Sum of ``x`` over ranks (same shape and dtype), summed in rank order on every rank."""
    return _stacked(x, tp_degree, group).sum(0)


def reduce_scatter(x: Tensor, dim: int, tp_degree: int, rank: int, group: str) -> Tensor:
    """This rank's 1/tp of the sum over ranks of ``x``, split along ``dim`` (whose size tp divides)."""
    n = x.shape[dim] // tp_degree
    # Summing only this rank's rows gives a new tensor with the strides of any other shard
    # (a narrowed view would not: compiled layer groups are specialised on input strides).
    return _stacked(x, tp_degree, group).narrow(dim + 1, rank * n, n).sum(0)


def all_gather(x: Tensor, dim: int, group: str) -> Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order."""
    return funcol.all_gather_single(x.contiguous(), dim % x.dim(), group)  # funcol mis-shapes negative dims


def tensor_parallel_ops(ops: Ops, tp_degree: int, rank: int, group: str, sequence_parallel: bool) -> Ops:
    """``ops`` with the collectives of rank ``rank`` of ``tp_degree`` over process group
    ``group`` (:func:`world_group`): Megatron-LM's tensor parallelism (Shoeybi et al. 2019),
    with sequence parallelism (Korthikanti et al. 2022) when ``sequence_parallel`` (prefill
    only: a decode step has one token per row)."""
    if sequence_parallel:
        parallel_in = functools.partial(all_gather, dim=1, group=group)
        parallel_out = functools.partial(reduce_scatter, dim=1, tp_degree=tp_degree, rank=rank, group=group)
    else:
        parallel_in = identity
        parallel_out = functools.partial(all_reduce, tp_degree=tp_degree, group=group)
    gather_vocab = functools.partial(all_gather, dim=-1, group=group)
    return attrs.evolve(ops, name=f"{ops.name}+tp{tp_degree}{'-sp' if sequence_parallel else ''}", parallel_in=parallel_in,
                        parallel_out=parallel_out, gather_vocab=gather_vocab)
