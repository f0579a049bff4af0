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
import json
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from neuronfx.errors import ConfigError, TensorParallelError
from neuronfx.runtime import fork_preload

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


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                      "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
"""What torch's elastic launcher sets for each rank beside the ``TORCHELASTIC_`` variables (torch
2.13, ``LocalElasticAgent._start_workers``; the CUDA_VISIBLE_DEVICES and OMP_NUM_THREADS it sets
are the caller's own)."""


def _adopt_environment(caller: dict[str, str]) -> None:
    """Give this rank the environment its :func:`launch` call saw (``caller``) with the launcher's
    per-rank variables over it, as a spawned rank had: a rank forked from the fork server
    inherits the server's environment, which is the first launch's."""
    launcher = {k: v for k, v in os.environ.items() if k in LAUNCHER_VARIABLES or k.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update(caller)
    os.environ.update(launcher)


def _rank_main(fn: Callable[..., Any], args: tuple, threads: int, caller_env: dict[str, str]) -> Any:
    """One rank started by :func:`launch`: take the caller's environment, join the group, run
    ``fn(*args)``, leave (a failing rank of several after :data:`FAILED_RANK_LINGER_S`)."""
    _adopt_environment(caller_env)
    torch.set_num_threads(threads)
    init_tensor_parallel(int(os.environ["WORLD_SIZE"]))
    try:
        return fn(*args)
    except (Exception, SystemExit) as exc:
        # A rank whose peer died fails at once (its collective breaks); lingering lets the launcher,
        # which reports the first exit it sees, report the peer's (forked ranks' exits reach it together).
        if not (isinstance(exc, SystemExit) and exc.code in (None, 0)) and int(os.environ["WORLD_SIZE"]) > 1:
            time.sleep(FAILED_RANK_LINGER_S)
        raise
    finally:
        if dist.is_initialized():  # a single rank joins no group
            dist.destroy_process_group()


MONITOR_INTERVAL_S = 0.2
"""How often the launcher looks at its ranks."""
FAILED_RANK_LINGER_S = 3 * MONITOR_INTERVAL_S
"""How long a failing rank of :func:`launch` waits before it exits (see ``_rank_main``)."""


def launch(fn: Callable[..., Any], *args: Any, tp_degree: int, threads: int | None = None) -> Any:
    """Run ``fn(*args)`` on ``tp_degree`` ranks of this machine, started by torch's elastic
    launcher (``torch.distributed.launcher.elastic_launch``, what torchrun runs), each in a
    process group of all of them; returns rank 0's return value. ``fn`` and ``args`` must be
    picklable (``fn`` a module-level function): on Linux the ranks are new processes forked
    from multiprocessing's fork server (:func:`_start_method`), which the first launch of this
    process starts with torch, neuronfx and that launch's ``fn`` module imported, so that a
    rank starts in a fraction of a second where a spawned one imported them itself (measured
    2026-12-06, 2-core AMD EPYC: a launch of 2 ranks of a tiny function 2.8-3.6 s spawned,
    0.3-0.5 s forked after the first); elsewhere they are spawned. Each rank gets this call's
    working directory, import path and environment, as a spawned one would, but a module the
    server imported read the environment of the first launch. ``threads``: torch threads per
    rank, default this machine's cores split evenly.

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
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0, monitor_interval=MONITOR_INTERVAL_S,
        start_method=_start_method(fn),
    )
    try:
        results = elastic_launch(config, _rank_main)(fn, args, threads, dict(os.environ))
    except ChildFailedError as exc:
        error = TensorParallelError(describe_failure(exc))
        error.exit_codes = {rank: f.exitcode for rank, f in (getattr(exc, "failures", {}) or {}).items()}
        raise error from None
    return results[0]


def _start_method(fn: Callable[..., Any]) -> str:
    """"forkserver" on Linux, starting this process's fork server if it is not running
    (:func:`_start_fork_server`); else "spawn" (macOS's system frameworks are not safe to fork
    and Python spawns there by default; Windows cannot fork). Forking from a server that only
    imported modules is safe where forking this process is not (its OpenMP threads may run)."""
    if not sys.platform.startswith("linux"):
        return "spawn"
    _start_fork_server(["torch", __name__] + ([fn.__module__] if fn.__module__ not in (None, "__main__") else []))
    return "forkserver"


_FORK_SERVER_LOCK = threading.Lock()
"""One thread starts the fork server at a time (its environment variable must not interleave)."""


def _start_fork_server(modules: list[str]) -> None:
    """Start this process's fork server if it is not running, importing ``modules`` and this
    process's import path into it (``runtime/fork_preload.py``; ``__main__`` is imported by each
    rank, as a spawned one does). The server then runs for the life of this process; it replaces
    any preload list set with ``multiprocessing.set_forkserver_preload``."""
    from multiprocessing import forkserver

    spec = json.dumps({"sys_path": [str(p) for p in sys.path], "modules": modules})
    with _FORK_SERVER_LOCK:
        multiprocessing.set_forkserver_preload([fork_preload.__name__])
        os.environ[fork_preload.ENV_VAR] = spec  # the server inherits it when it starts
        try:
            forkserver.ensure_running()
        finally:
            del os.environ[fork_preload.ENV_VAR]


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
