"""Compile workers: the inductor backend compiles some of a plan's graphs in other processes.

A cold inductor compile is mostly single-threaded Python (dynamo tracing, AOT, inductor
lowering and code generation) waiting in turns on C++ compiler runs, so one process keeps about
one core busy. The graphs fall into independent units, one per (phase, batch size): the graphs of
a unit share their compiled layer group and epilogue (``inductor_parts.SharedCompile``), different
units share nothing. :func:`build` gives whole units to ``python -c``
subprocesses running :func:`work` (one per idle core, ``NEURONFX_COMPILE_WORKERS``
overrides) and compiles the rest itself, all in the runtime's private inductor directory (its
file locks let processes share kernels). A worker compiles on weights of the same structure,
shapes, dtypes, strides and aliasing as the caller's (large tensors uninitialised, small ones
copied, as index tensors are read), saves each part (``save_compiled_function``) and prints one
line per graph; the caller loads them (``inductor_parts.load_graph``, no tracing). A worker that fails
costs only time: its graphs are compiled in the calling process, with a warning naming its log.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import torch
from torch.utils._pytree import tree_map_only

from neuronfx.config.plan import SHARED_PARTS, GraphSpec, Plan
from neuronfx.errors import ConfigError
from neuronfx.graphs.backends import inductor_parts, warm_up
from neuronfx.graphs.backends.inductor_dir import in_dir
from neuronfx.graphs.models.layers import Weights
from neuronfx.graphs.phases.compose import GraphModule
from neuronfx.graphs.phases.inputs import empty_kv

ENV_VAR = "NEURONFX_COMPILE_WORKERS"
COPIED_BYTES = 4096
"""Tensors whose storage is at most this size travel to a worker by value (layer indices,
norms); larger ones by description only (their values do not change a compile)."""


class CompileWorkerWarning(RuntimeWarning):
    """A compile worker failed; its graphs were compiled in the calling process instead."""


def units(plan: Plan) -> list[list[GraphSpec]]:
    """The plan's graphs grouped by (phase, batch size), in plan order: the graphs of a unit
    share compiled parts, so a unit is compiled by one process (a phase of
    ``config.plan.SHARED_PARTS`` with the phase it shares parts with: greedy with decode)."""
    groups: dict[tuple[str, int], list[GraphSpec]] = {}
    for spec in plan.graphs:
        groups.setdefault((SHARED_PARTS.get(spec.phase, spec.phase), spec.batch_size), []).append(spec)
    return list(groups.values())


def num_workers(plan: Plan, num_units: int) -> int:
    """Worker processes for a plan of ``num_units`` units: ``$NEURONFX_COMPILE_WORKERS`` when
    set, else one per idle core (:func:`idle_cores`), never more than ``num_units - 1`` (a unit
    each, one stays here); none under tensor parallelism (the ranks are processes already, and
    their graphs call collectives of this rank's process group) nor on CUDA (a worker would
    need its own CUDA context and a copy of the weights on the GPU; inductor compiles the Triton
    kernels in its own pool of processes)."""
    if plan.tp_degree > 1 or plan.inference.device != "cpu":
        return 0
    wanted = configured_workers()
    return max(0, min(idle_cores() if wanted is None else wanted, num_units - 1))


def configured_workers() -> int | None:
    """``$NEURONFX_COMPILE_WORKERS`` as a count, None when unset or empty; ConfigError for
    anything but a whole number >= 0 (the inductor backend's ``check``, before any load)."""
    env = os.environ.get(ENV_VAR, "").strip()
    if not env:
        return None
    if not env.isdigit():
        raise ConfigError(f"{ENV_VAR}={env!r} must be a whole number of compile worker processes (0: compile in this process "
                          "only); unset it for one per idle core.")
    return int(env)


def check_env() -> None:
    """Raise ConfigError for a malformed ``$NEURONFX_COMPILE_WORKERS``."""
    configured_workers()


def idle_cores() -> int:
    """Usable cores (the affinity mask where the OS has one) beyond the ones busy over the last
    minute (the load average, this process included). A worker pays only on an idle core:
    SmolLM2's default plan on two cores, measured under a load average of 4, compiled in 79 s
    without a worker and 103 s with one (its start-up and the units' common kernels cost 15-20
    CPU seconds); on two idle cores each process keeps one busy."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        usable = os.cpu_count() or 1
    try:
        busy = int(os.getloadavg()[0])
    except OSError:  # no load average (Windows)
        busy = 1
    return max(0, usable - max(busy, 1))


def unit_cost(unit: list[GraphSpec]) -> int:
    """A unit's compiles: one prologue per bucket, one layer group, one epilogue per phase (a
    greedy graph adds only its epilogue: its prologue and layers are its decode graph's)."""
    return len({spec.bucket for spec in unit}) + 1 + len({spec.phase for spec in unit})


def split(unit_list: list[list[GraphSpec]], workers: int) -> list[list[GraphSpec]]:
    """Assign units to ``workers + 1`` processes (index 0: this one), costliest first to the
    least loaded (:func:`unit_cost`)."""
    loads = [[0, i, []] for i in range(workers + 1)]
    for unit in sorted(unit_list, key=unit_cost, reverse=True):
        target = min(loads, key=lambda x: (x[0], x[1]))
        target[0] += unit_cost(unit)
        target[2].extend(unit)
    return [sorted(specs, key=plan_order(unit_list)) for _, _, specs in loads]


def plan_order(unit_list: list[list[GraphSpec]]) -> Callable[[GraphSpec], int]:
    order = {spec.key: i for i, spec in enumerate(s for unit in unit_list for s in unit)}
    return lambda spec: order[spec.key]


# --- weights a worker can rebuild ----------------------------------------------------------------


@attrs.frozen
class TensorInfo:
    """What a worker needs of one weight tensor: its view of storage ``storage`` (index into
    the description's storages) and, for small storages, the bytes."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    storage: int


def describe(weights: Weights) -> tuple[object, list[int | bytes]]:
    """(the weights' pytree with a :class:`TensorInfo` per tensor, each storage's size in bytes
    or, up to :data:`COPIED_BYTES`, its bytes). Tensors sharing a storage (tied embeddings,
    views) share it in the description."""
    storages: dict[int, int] = {}
    sizes: list[int | bytes] = []

    def info(t: torch.Tensor) -> TensorInfo:
        s = t.untyped_storage()
        if s.data_ptr() not in storages:
            storages[s.data_ptr()] = len(sizes)
            sizes.append(bytes(s) if s.nbytes() <= COPIED_BYTES else s.nbytes())
        return TensorInfo(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, storages[s.data_ptr()])

    return tree_map_only(torch.Tensor, info, weights), sizes


def rebuild(description: object, sizes: list[int | bytes]) -> Weights:
    """The weights :func:`describe` described: same structure, views and aliasing; large
    storages uninitialised."""
    storages = [torch.UntypedStorage(n) if isinstance(n, int) else torch.frombuffer(bytearray(n), dtype=torch.uint8).untyped_storage()
                for n in sizes]

    def tensor(i: TensorInfo) -> torch.Tensor:
        return torch.empty(0, dtype=i.dtype).set_(storages[i.storage], i.offset, i.shape, i.stride)

    return tree_map_only(TensorInfo, tensor, description)


# --- the calling side ------------------------------------------------------------------------------


class Worker:
    """One worker process compiling ``specs`` into ``directory``; ``on_done(key, seconds)`` is
    called (from a reader thread) as each graph is saved."""

    def __init__(self, index: int, plan: Plan, weights_description: tuple, directory: Path, specs: list[GraphSpec],
                 on_done: Callable[[tuple, float], None]):
        self.index, self.plan, self.specs, self.on_done = index, plan, specs, on_done
        self.out = Path(tempfile.mkdtemp(prefix=f"neuronfx-compile-worker-{index}-"))  # parts, job and log; removed once loaded
        job = self.out / "job.pkl"
        job.write_bytes(pickle.dumps({"plan": plan, "weights": weights_description, "directory": str(directory),
                                      "keys": [s.key for s in specs], "out": str(self.out), "num_threads": torch.get_num_threads()}))
        self.log = self.out / "log.txt"
        self.seconds: dict[tuple, float] = {}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", WORKER_MAIN, str(job)],
                                         stdout=subprocess.PIPE, stderr=log, text=True, env=_worker_env())
        self.reader = threading.Thread(target=self._read, name=f"neuronfx-compile-worker-{index}", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            fields = line.split()
            if len(fields) == 5 and fields[0] == "done":
                key = (fields[1], int(fields[2]), int(fields[3]))
                self.seconds[key] = float(fields[4])
                self.on_done(key, self.seconds[key])

    def status(self) -> str:
        """What waiting for this worker waits for, for a progress bar."""
        what = f"compile worker {self.index} ({graph_names(self.specs)})"
        if len(self.seconds) < len(self.specs):
            return f"waiting for {what}: {len(self.seconds)} of {len(self.specs)} graphs done"
        return f"waiting for {what} to save its graphs and exit"

    def finish(self) -> int:
        """Wait until the process has exited and its output is read; its exit status."""
        code = self.proc.wait()
        self.reader.join()
        return code

    def result(self) -> dict[tuple, GraphModule] | None:
        """Its graphs, loaded (call inside the private directory); None, with a
        :class:`CompileWorkerWarning`, when it failed."""
        code = self.finish()
        try:
            if code != 0 or len(self.seconds) != len(self.specs):
                raise RuntimeError(f"exit status {code}, {len(self.seconds)} of {len(self.specs)} graphs done")
            return {spec.key: inductor_parts.load_graph(self.plan, spec, self.out) for spec in self.specs}
        except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as exc:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            warnings.warn(f"neuronfx compile worker failed ({exc}); compiling its {len(self.specs)} graphs here. "
                          f"Its log ends:\n{tail}", CompileWorkerWarning, stacklevel=3)
            return None
        finally:
            shutil.rmtree(self.out, ignore_errors=True)


def _worker_env() -> dict[str, str]:
    """This environment (outside any private directory: the worker warms up in inductor's
    default cache, then enters the private one itself) with the neuronfx this process runs
    first on the path."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])  # the directory holding this neuronfx package
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def build(plan: Plan, weights: Weights, directory: Path, builder: Callable[..., object],
          bar_factory: Callable[[int], object]) -> tuple[dict, dict]:
    """Every graph of ``plan``: units given to workers (:func:`num_workers`) and the rest built
    here with ``builder(plan, spec, weights, kv)`` inside ``directory``; (graphs, seconds) keyed
    by spec key. ``bar_factory(total)`` makes the progress bar (``update``, ``set_postfix_str``,
    ``close``)."""
    unit_list = units(plan)
    shares = split(unit_list, num_workers(plan, len(unit_list)))
    bar = bar_factory(len(plan.graphs))
    lock = threading.Lock()

    def done(key: tuple, seconds: float) -> None:
        with lock:
            bar.update(1)

    described = describe(weights) if len(shares) > 1 else None
    workers = [Worker(i, plan, described, directory, specs, done) for i, specs in enumerate(shares[1:], 1) if specs]
    local = functools.partial(_build_here, plan, weights, directory, builder, empty_kv(plan))
    graphs, seconds = local(shares[0], bar, lock, done)
    for worker in workers:
        with _status(bar, lock, worker.status):
            worker.finish()
        with _status(bar, lock, lambda w=worker: f"loading the {len(w.specs)} graphs of compile worker {w.index}"):
            loaded = in_dir(directory, worker.result)
        # a failed worker's graphs are compiled here (they count again on the bar)
        more = local(worker.specs) if loaded is None else (loaded, worker.seconds)
        graphs, seconds = graphs | more[0], seconds | more[1]
    bar.close()
    return graphs, seconds


def _build_here(plan: Plan, weights: Weights, directory: Path, builder: Callable[..., object], template_kv: object,
                specs: list[GraphSpec], bar: object = None, lock: threading.Lock | None = None,
                done: Callable[[tuple, float], None] | None = None) -> tuple[dict, dict]:
    """``specs`` built in this process inside ``directory``, timed; with ``bar``, each shown on it
    (under ``lock``) and reported to ``done``."""
    graphs, seconds = {}, {}
    for spec in specs:
        if bar is not None:
            with lock:
                bar.set_postfix_str(f"{spec.phase} {spec.batch_size}x{spec.bucket}")
        t0 = time.perf_counter()
        graphs[spec.key] = in_dir(directory, builder, plan, spec, weights, template_kv)
        seconds[spec.key] = time.perf_counter() - t0
        if done is not None:
            done(spec.key, seconds[spec.key])
    return graphs, seconds


def graph_names(specs: list[GraphSpec]) -> str:
    """Graphs by unit, for a person: "prefill 1x16,32,64; decode 1x128"."""
    buckets: dict[tuple[str, int], list[str]] = {}
    for spec in specs:
        buckets.setdefault((spec.phase, spec.batch_size), []).append(str(spec.bucket))
    return "; ".join(f"{phase} {batch}x{','.join(b)}" for (phase, batch), b in buckets.items())


@contextlib.contextmanager
def _status(bar: object, lock: threading.Lock, text: Callable[[], str]) -> Iterator[None]:
    """Show ``text()`` and the seconds spent so far on the bar's postfix, refreshed every second
    while the block runs: a wait on another process shows what it waits for, never a bar that
    looks stuck."""
    done = threading.Event()
    t0 = time.perf_counter()

    def tick() -> None:
        while True:
            with lock:
                bar.set_postfix_str(f"{text()}, {time.perf_counter() - t0:.0f} s")
            if done.wait(1.0):
                return

    thread = threading.Thread(target=tick, name="neuronfx-compile-status", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


# --- the worker side ---------------------------------------------------------------------------------


def work(job_path: str) -> None:
    """The worker: compile the job's graphs, save their parts, print ``done PHASE BATCH BUCKET
    SECONDS`` per graph (stdout) and its CPU time (stderr, its log)."""
    job = pickle.loads(Path(job_path).read_bytes())
    torch.set_num_threads(job["num_threads"])  # compiled code guards on the caller's thread count
    plan: Plan = job["plan"]
    warm_up.warm_up()  # vector-ISA probes and header found in inductor's default cache, before the private one
    weights = rebuild(*job["weights"])
    kv = empty_kv(plan)
    directory, out = Path(job["directory"]), Path(job["out"])
    shared: dict = {}
    build_graph = functools.partial(inductor_parts.build_graph, shared=shared)
    for spec in (plan.graph(*key) for key in job["keys"]):
        t0 = time.perf_counter()
        graph = in_dir(directory, build_graph, plan, spec, weights, kv)
        inductor_parts.save_parts(spec, graph, out)
        print(f"done {spec.phase} {spec.batch_size} {spec.bucket} {time.perf_counter() - t0:.3f}", flush=True)
    used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    print(f"neuronfx compile worker: {len(job['keys'])} graphs; cpu {used[0].ru_utime + used[0].ru_stime:.1f} s, "
          f"compiler {used[1].ru_utime + used[1].ru_stime:.1f} s", file=sys.stderr)


WORKER_MAIN = "import sys; from neuronfx.graphs.backends.compile_workers import work; work(sys.argv[1])"
"""The worker's program (``python -c``, so that this module is imported once, under its name)."""
