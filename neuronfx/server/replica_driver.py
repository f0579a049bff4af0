"""The driver of ``neuronfx serve --data-parallel-size N``: join or start a Ray cluster, check
it can hold the replicas, run the application (``server/replicas.py``) and wait for
SIGINT/SIGTERM, then drain the ingress and leave.

It compiles nothing: ``neuronfx serve`` compiles the plan once into the compile cache before
calling :func:`serve_replicas` (one compile, N loads).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading

import ray
from ray import serve

from neuronfx.errors import InputError
from neuronfx.server.affinity import PREFIX_CHARS
from neuronfx.server.replicas import APP_NAME, ReplicaBuildError, ReplicaSpec, Scaling, application

logger = logging.getLogger("neuronfx.server")


def start_cluster(address: str | None, cores: int) -> None:
    """Join the Ray cluster at ``address``, or start a new local one of ``cores`` CPUs (None: never one
    that ``ray start`` left running);
    no dashboard, no usage report (nothing leaves the machine)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address is None:
        ray.init(address="local", num_cpus=cores, include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(address=address, logging_level=logging.WARNING)


def check_cluster_cpus(scaling: Scaling, threads: int) -> None:
    """InputError when the cluster's nodes cannot hold ``max_replicas`` replicas of ``threads``
    CPUs each (a replica runs on one node: Ray would wait for room for ever)."""
    nodes = [int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive")]
    room = sum(cpus // threads for cpus in nodes)
    if scaling.max_replicas > room:
        raise InputError(f"{scaling.max_replicas} replicas x {threads} threads do not fit the Ray cluster: its nodes have {nodes} "
                         f"CPUs, room for {room}; lower --data-parallel-size / --max-replicas or --replica-threads, or add nodes.")


def serve_replicas(spec: ReplicaSpec, scaling: Scaling, *, host: str, port: int, ray_address: str | None, cores: int,
                   prefix_chars: int = PREFIX_CHARS, stop: threading.Event | None = None) -> int:
    """Serve ``spec`` on ``scaling`` replicas behind one endpoint at http://host:port until
    SIGINT/SIGTERM (or ``stop`` is set); returns the exit status: 0 after a stop (one during the
    start too), 2 when the cluster is too small or the application could not start (a replica
    failed to build: its error printed as one line). ``ray_address``: an existing cluster
    (``ray start --head``; Serve is shut down on return, unless it ran there before: then only
    this application is deleted), or None for a local one of ``cores`` CPUs, stopped on return."""
    start_cluster(ray_address, cores)
    stop = stop if stop is not None else _stop_on_signals()  # after ray.init, which installs its own handlers
    shared = ray_address is not None and serve_running()  # Serve there serves other applications too: leave it up
    if shared:
        logger.warning("Ray Serve already runs on %s: its HTTP address stays as it is (--host/--port apply to a Serve this "
                       "command starts)", ray_address)
    try:
        check_cluster_cpus(scaling, spec.threads)
        serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
        running = _run_until(application(spec, scaling, prefix_chars), stop)
    except Exception as exc:  # whatever failed the start is reported in one line
        print(f"neuronfx: error: {one_line(exc, deployment_messages())}", file=sys.stderr)
        _leave(shared)
        return 2
    if not running:
        logger.info("stopped while starting")
        _leave(shared)
        return 0
    logger.info("serving %s on http://%s:%d: %d replicas x %d threads (Ray Serve)", spec.model_name, host, port, scaling.replicas,
                spec.threads)
    while not stop.wait(0.5):
        pass
    logger.info("stopping: requests in flight may take up to %s s to finish", spec.shutdown_timeout)
    with contextlib.suppress(Exception):  # a stop must not fail: Serve shuts down whatever the drain did
        left = serve.get_app_handle(APP_NAME).drain.remote(spec.shutdown_timeout).result(timeout_s=spec.shutdown_timeout + 10)
        if left:
            logger.warning("%d requests still running after %s s (--shutdown-timeout): aborting them", left, spec.shutdown_timeout)
    _leave(shared)
    logger.info("stopped")
    return 0


def _run_until(app: serve.Application, stop: threading.Event) -> bool:
    """``serve.run(app)`` (which waits for every replica to be built, without a time limit) in a
    thread, so a signal can end the start: True once running, False when ``stop`` was set
    first. Raises what ``serve.run`` raised."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
            outcome.append(None)
        except BaseException as exc:  # handed to the caller's thread
            outcome.append(exc)

    thread = threading.Thread(target=run, name="neuronfx-serve-run", daemon=True)
    thread.start()
    while thread.is_alive() and not stop.is_set():
        thread.join(0.2)
    if not outcome:
        return False
    if outcome[0] is not None:
        raise outcome[0]
    return True


def serve_running() -> bool:
    """Whether a Ray Serve instance already runs on the connected cluster (its status names
    proxies or applications; an empty one when none runs)."""
    status = serve.status()
    return bool(status.proxies or status.applications)


def _leave(shared: bool) -> None:
    """Remove the application and leave the cluster: Serve shuts down with it, unless it ran
    before this command (``shared``: it keeps its other applications and its HTTP address); a
    local cluster stops with ``ray.shutdown``."""
    with contextlib.suppress(Exception):
        if shared:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
    ray.shutdown()


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def deployment_messages() -> str:
    """What Serve's status says of the application and its deployments (a replica's failure:
    its traceback), or "" when it cannot say."""
    with contextlib.suppress(Exception):
        app = serve.status().applications[APP_NAME]
        return "\n".join([app.message, *(d.message for d in app.deployments.values())])
    return ""


def one_line(exc: BaseException, status: str = "") -> str:
    """The cause of a failed start in one line: a replica's ReplicaBuildError message when
    ``exc`` or Serve's ``status`` quotes one (they quote the replica's whole traceback), else the
    error's first line."""
    text = f"{exc}\n{status}"
    marker = f"{ReplicaBuildError.__name__}: "
    lines = [line for line in text.splitlines() if marker in line]
    if lines:
        return lines[-1].split(marker, 1)[1].strip()
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{type(exc).__name__}: {first}" if not isinstance(exc, InputError) else first

