"""Tensor-parallel processes: joining the process group, starting ranks, checking they agree.

Every rank runs the same program (SPMD, as gpt-fast and transformers' ``tp_plan`` do):
``neuronfx.compile`` gives each rank the graphs and weights of its shard, and ``generate``, the
step functions and the scheduler then run unchanged on every rank (each computes the same
tokens: logits are gathered and the random numbers are the same). Ranks come from torchrun
(``torchrun --nproc-per-node N``; several machines with ``--nnodes``) or, on one machine, from
:func:`launch`, which starts them with torch's elastic launcher. The transport is
torch.distributed's gloo backend on CPU; where torch sees CUDA, the process group also has
nccl, which carries the collectives of CUDA tensors (rank r on GPU r of one machine), while
gloo keeps the CPU ones (:func:`process_group_backend`).

Faults: the launcher stops every rank as soon as one exits abnormally and :func:`launch`
raises :class:`TensorParallelError` naming it; a rank blocked in a collective whose peer is
gone gives up after the process group's timeout (``NEURONFX_TP_TIMEOUT`` seconds, default 60).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import signal
import socket
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from neuronfx.errors import ConfigError, TensorParallelError

DEFAULT_TIMEOUT_S = 60
TIMEOUT_ENV = "NEURONFX_TP_TIMEOUT"
BACKEND = "gloo"
CUDA_BACKEND = "cpu:gloo,cuda:nccl"


def process_group_backend() -> str:
    """The process group's backend: gloo alone on a machine without CUDA; else gloo for CPU
    tensors and nccl for CUDA tensors (torch.distributed picks by each collective's tensors),
    so CPU plans, CUDA plans and the CPU-side agreement checks all run in one group."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return CUDA_BACKEND
    return BACKEND


def timeout_s() -> float:
    """The collective timeout in seconds: ``$NEURONFX_TP_TIMEOUT`` or 60. ConfigError for a
    value that is not a positive number."""
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds (default {DEFAULT_TIMEOUT_S}).")
    return value


def under_launcher() -> bool:
    """Whether this process was started as one rank of several (torchrun, :func:`launch`)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_tensor_parallel(tp_degree: int) -> int:
    """Join the default process group of ``tp_degree`` ranks (:func:`process_group_backend`,
    timeout :func:`timeout_s`; with CUDA, this process's current GPU is its local rank's)
    when this process was launched as a rank and has not joined yet; returns this rank (0 for
    tp_degree 1, which never joins). Raises ConfigError when ``tp_degree`` > 1 and this process was not started
    as one of ``tp_degree`` ranks."""
    if tp_degree == 1:  # a single-rank plan runs alone, even inside a larger job
        return 0
    if not dist.is_initialized():
        if not under_launcher():
            raise ConfigError(
                f"tp_degree={tp_degree} needs {tp_degree} processes: run under `torchrun --nproc-per-node {tp_degree}` "
                f"or through neuronfx.launch(fn, tp_degree={tp_degree}) (the CLI starts them itself)."
            )
        backend = process_group_backend()
        if backend == CUDA_BACKEND:  # nccl: one GPU per rank
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s()))
    if dist.get_world_size() != tp_degree:
        raise ConfigError(
            f"tp_degree={tp_degree} but {dist.get_world_size()} processes were started; start {tp_degree} "
            f"(torchrun --nproc-per-node {tp_degree}) or set tp_degree={dist.get_world_size()}."
        )
    return dist.get_rank()


def check_agreement(what: str, digest: str) -> None:
    """Raise TensorParallelError naming the ranks whose ``digest`` of ``what`` (e.g. "plan",
    "weights") differs from rank 0's; a no-op outside a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise TensorParallelError(
            f"tensor-parallel rank(s) {differ} were given other {what} than rank 0 (sha256 {digests[differ[0]][:12]} vs "
            f"{digests[0][:12]}); every rank must run the same plan on the same checkpoint."
        )


def digest(text: str) -> str:
    """sha256 hex of ``text``."""
    return hashlib.sha256(text.encode()).hexdigest()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable[..., Any], args: tuple, threads: int) -> Any:
    """One rank started by :func:`launch`: join the group, run ``fn(*args)``, leave."""
    torch.set_num_threads(threads)
    init_tensor_parallel(int(os.environ["WORLD_SIZE"]))
    try:
        return fn(*args)
    finally:
        if dist.is_initialized():  # a single rank joins no group
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], *args: Any, tp_degree: int, threads: int | None = None) -> Any:
    """Run ``fn(*args)`` on ``tp_degree`` ranks of this machine, started by torch's elastic
    launcher (``torch.distributed.launcher.elastic_launch``, what torchrun runs), each in a
    process group of all of them; returns rank 0's return value. ``fn`` and ``args`` must be
    picklable (``fn`` a module-level function): the ranks are new processes ("spawn").
    ``threads``: torch threads per rank, default this machine's cores split evenly.

    Raises ConfigError for a ``tp_degree`` < 1; TensorParallelError when a rank fails
    (exception, exit or signal): the launcher stops the others and the error names the rank
    (its ``exit_codes`` maps each failed rank to its exit code, negative for a signal).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not isinstance(tp_degree, int) or isinstance(tp_degree, bool) or tp_degree < 1:
        raise ConfigError(f"tp_degree={tp_degree!r} must be a positive int.")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // tp_degree)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=tp_degree, run_id=f"neuronfx-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0, monitor_interval=0.2,
        start_method="spawn",
    )
    try:
        results = elastic_launch(config, _rank_main)(fn, args, threads)
    except ChildFailedError as exc:
        error = TensorParallelError(describe_failure(exc))
        error.exit_codes = {rank: f.exitcode for rank, f in (getattr(exc, "failures", {}) or {}).items()}
        raise error from None
    return results[0]


def describe_failure(exc: Exception) -> str:
    """One line naming the failed rank(s) of a ChildFailedError and how each ended."""
    failures = getattr(exc, "failures", {}) or {}
    parts = []
    for rank, failure in sorted(failures.items()):
        if failure.exitcode < 0:
            how = f"killed by {signal.Signals(-failure.exitcode).name}"
        else:
            how = f"exited with code {failure.exitcode}"
        parts.append(f"rank {rank} {how}")
    detail = "; ".join(parts) or str(exc).strip().splitlines()[0]
    return f"tensor-parallel run failed: {detail}; the other ranks were stopped."
