"""Data-parallel serving on Ray Serve: N neuronfx engines behind one OpenAI endpoint
(``neuronfx serve --data-parallel-size N``; ``pip install 'neuronfx[ray]'``).

Two deployments make one Ray Serve application (:func:`application`):

- :class:`Replica` (N of them, or between ``min_replicas`` and ``max_replicas`` with Ray Serve's
  autoscaling): one engine each (``server/engine.py``) on its own share of the cores (its
  threads pinned to them: :func:`replica_cores`), running the whole neuronfx app in its process
  (:func:`neuronfx.server.asgi.call_app`): every route, its validation and its errors are the
  single server's. Its health check fails once its engine has failed; Ray then restarts it.
- :class:`Ingress` (one): Ray Serve's HTTP proxy hands it every request; it keys the request by
  its prompt's prefix (``server/affinity.py``) and forwards it through a deployment handle to
  the replica :class:`AffinityRouter` picks (Ray Serve's request-router API), then streams the
  answer back. A replica that dies or cannot be reached before it answered gives a 503 with
  Retry-After (OpenAI's error JSON); one that dies mid-stream ends the stream with an error event
  and ``data: [DONE]``. Each answer names its replica in the ``x-neuronfx-replica`` header (its
  Ray node in ``x-neuronfx-node``); a
  request that sends that header is routed to that replica while it runs (its /metrics, say).

The driver (``server/replica_driver.py``) starts or joins a Ray cluster, runs the application
and waits for SIGINT/SIGTERM, then drains the ingress and leaves the cluster.

Only imported when Ray is used: ``ray`` is an optional dependency.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import attrs
import ray
import torch
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from neuronfx.config.inference import InferenceConfig
from neuronfx.server import protocol as p
from neuronfx.server.affinity import PREFIX_CHARS, AffinityTable, prefix_key, prefix_text, ranked
from neuronfx.server.asgi import HttpCall, HttpHead, call_app
from neuronfx.server.engine import RETRY_AFTER_S, Engine
from neuronfx.server.errors import ErrorJSON
from neuronfx.server.metrics import make_metrics
from neuronfx.server.served import Served

logger = logging.getLogger("neuronfx.server")

APP_NAME = "neuronfx"
REPLICA_HEADER = "x-neuronfx-replica"
NODE_HEADER = "x-neuronfx-node"
READY_POLL_S = 0.2

# What a replica that died or cannot be reached raises at the ingress (Ray's own exceptions).
UNREACHABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, DeploymentUnavailableError,
               ReplicaUnavailableError)


class ReplicaBuildError(RuntimeError):
    """A replica's engine could not load or compile its runtime (the message: the cause, one line)."""


@attrs.frozen(kw_only=True)
class ReplicaSpec:
    """What every replica serves and how: ``build`` (loads or compiles the runtime and its
    tokenizer: picklable, run in each replica's engine thread; ``neuronfx serve`` gives its
    ``build_served`` bound to its options), ``inference`` (the plan's InferenceConfig),
    ``model_name`` (the name requests give), ``threads`` (torch threads per replica, pinned to
    as many cores), the engine's ``max_waiting``, ``max_num_batched_tokens`` and ``async_decode``,
    ``tool_parser`` and ``shutdown_timeout`` (seconds a stopping replica drains)."""

    build: Callable[[], Served]
    inference: InferenceConfig
    model_name: str
    threads: int
    max_waiting: int = 64
    max_num_batched_tokens: int | None = None
    async_decode: bool = False
    tool_parser: str | None = None
    shutdown_timeout: float = 10.0


def replica_cores(cores: Sequence[int], local_rank: int, threads: int) -> list[int]:
    """The cores replica ``local_rank`` of a node pins its threads to: the ``local_rank``-th run
    of ``threads`` cores of the node's ``cores`` (sorted), wrapping around when the node has
    fewer than (local_rank + 1) x threads (Ray placed more replicas than cores: they share).
    Raises ValueError for ``threads`` < 1 or no cores."""
    if threads < 1 or not cores:
        raise ValueError(f"threads={threads} must be >= 1 and cores={list(cores)} not empty.")
    ordered = sorted(cores)
    start = (local_rank * threads) % len(ordered)
    return [ordered[(start + i) % len(ordered)] for i in range(min(threads, len(ordered)))]


def pin_threads(cores: Sequence[int], threads: int) -> None:
    """Pin the calling thread (the engine's: the threads it starts inherit the mask) to
    ``cores`` and give torch ``threads`` threads."""
    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(threads)


class Replica:
    """One neuronfx engine serving the whole app (a Ray Serve deployment class; module doc).
    The constructor returns once the runtime is built: Ray routes to a replica only then.
    Raises ReplicaBuildError when the runtime cannot be built (Ray reports the deployment
    failed)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        from neuronfx.server.app import make_app

        self.spec = spec
        self.engine: Engine | None = None  # until built: Ray may call __del__ on a replica whose constructor raised
        logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s", stream=sys.stderr)  # Ray forwards stderr
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.node = ray.get_runtime_context().get_node_id()
        self.cores = replica_cores(sorted(os.sched_getaffinity(0)), context.rank.local_rank, spec.threads)

        def build() -> Served:
            pin_threads(self.cores, spec.threads)
            return spec.build()

        self.engine = Engine(build, max_waiting=spec.max_waiting, metrics=make_metrics(spec.model_name),
                             max_num_batched_tokens=spec.max_num_batched_tokens, async_decode=spec.async_decode)
        self.engine.start()
        while not self.engine.ready and self.engine.failure is None:
            time.sleep(READY_POLL_S)
        if self.engine.failure is not None:
            failure = self.engine.failure
            raise ReplicaBuildError(f"replica {self.replica} could not build its runtime: {type(failure).__name__}: {failure}")
        logger.info("replica %s (rank %d) ready on node %s, cores %s, %d threads", self.replica, context.rank.rank,
                    self.node, self.cores, spec.threads)
        self.app = make_app(self.engine, spec.model_name, stop_timeout=spec.shutdown_timeout, tool_parser=spec.tool_parser)

    async def forward(self, call: HttpCall) -> AsyncIterator[HttpHead | bytes]:
        """Answer ``call`` through the app: its :class:`HttpHead` (with the replica's id in
        ``x-neuronfx-replica`` and its Ray node's in ``x-neuronfx-node``), then a stream's chunks."""
        names = ((REPLICA_HEADER.encode(), self.replica.encode()), (NODE_HEADER.encode(), self.node.encode()))
        async with contextlib.aclosing(call_app(self.app, call)) as answer:  # closed at once when the ingress cancels
            async for item in answer:
                if isinstance(item, HttpHead):
                    item = attrs.evolve(item, headers=(*item.headers, *names))
                yield item

    def check_health(self) -> None:
        """Ray Serve's health check: raises once the engine thread failed or ended."""
        if self.engine is None or self.engine.failure is not None or not self.engine.ready:
            raise RuntimeError(f"replica {self.replica}: its engine is not running.")

    def __del__(self) -> None:
        # Ray Serve's graceful shutdown: requests already drained (graceful_shutdown_timeout_s); stop the engine thread.
        if self.engine is not None:
            self.engine.stop(self.spec.shutdown_timeout)


class AffinityRouter(RequestRouter):
    """Ray Serve request router of the replicas: prefix affinity while the load is balanced,
    least queue otherwise (``server/affinity.py``); a request naming a running replica
    (:attr:`HttpCall.replica`) goes to it. ``imbalance``: how many more requests the prefix's
    replica may have in flight than the least loaded before its requests spread."""

    def initialize_state(self, imbalance: int = 8) -> None:
        self.imbalance = imbalance
        self.table = AffinityTable()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        call = _call_of(pending_request)
        # Ray takes the first of equally short queues: a random order spreads ties (as its power-of-two router)
        by_id = {r.replica_id.unique_id: r for r in random.sample(candidate_replicas, len(candidate_replicas))}
        if call is not None and call.replica in by_id:
            return [[by_id[call.replica]]]
        owner = self.table.owner(call.affinity) if call is not None and call.affinity is not None else None
        lens = {rid: self.replica_queue_len_cache.get(r.replica_id) for rid, r in by_id.items()}
        return [[by_id[rid] for rid in rank] for rank in ranked(owner, lens, self.imbalance)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        call = _call_of(pending_request)
        if call is not None and call.affinity is not None:
            self.table.routed(call.affinity, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget([replica_id.unique_id])


def _call_of(pending_request: PendingRequest | None) -> HttpCall | None:
    """The HttpCall a pending ``forward`` request carries, or None (a health probe, say)."""
    if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], HttpCall):
        return None
    return pending_request.args[0]


class Ingress:
    """The HTTP entry (a Ray Serve deployment class; module doc): forwards each request to a
    replica and relays its answer. ``prefix_chars``: characters of a prompt that key its
    replica (``server/affinity.py``). :meth:`drain` stops it taking requests (503
    ``shutting_down``) and waits for those in flight: the driver's graceful stop."""

    def __init__(self, replicas: serve.handle.DeploymentHandle, prefix_chars: int = PREFIX_CHARS) -> None:
        self.replicas = replicas
        self.prefix_chars = prefix_chars
        self.in_flight = 0  # requests forwarded and not answered to the end
        self.draining = False

    async def __call__(self, request: Request) -> Response:
        if self.draining:
            return ErrorJSON(p.error_body("the server is shutting down; it takes no new request.", "server_error",
                                          code="shutting_down"), status_code=503)
        self.in_flight += 1
        try:
            response = await self._forward(request)
        except BaseException:
            self.in_flight -= 1
            raise
        if not isinstance(response, RelayResponse):
            self.in_flight -= 1
        return response

    async def _forward(self, request: Request) -> Response:
        body = await request.body()
        text = prefix_text(request.url.path, body)
        call = HttpCall(method=request.method, path=request.url.path, query=request.scope.get("query_string", b""),
                        headers=tuple(request.scope["headers"]), body=body, replica=request.headers.get(REPLICA_HEADER),
                        affinity=None if text is None else prefix_key(text, self.prefix_chars))
        stream = self.replicas.options(stream=True).forward.remote(call)
        try:
            head = await stream.__anext__()
        except BackPressureError:
            stream.cancel()
            return busy()
        except UNREACHABLE as exc:
            stream.cancel()
            logger.warning("%s %s: no replica answered: %s", request.method, request.url.path, type(exc).__name__)
            return unavailable(exc)
        except BaseException:
            stream.cancel()
            raise
        if not head.streamed:
            response = Response(head.body, status_code=head.status)
            response.raw_headers = list(head.headers)
            return response
        return RelayResponse(stream, head, self._ended)

    def _ended(self) -> None:
        self.in_flight -= 1

    async def drain(self, timeout: float) -> int:
        """Take no new request; wait up to ``timeout`` seconds for those in flight to end.
        Returns how many still run."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return self.in_flight


class RelayResponse(StreamingResponse):
    """A replica's stream relayed to the client: its chunks; a replica lost mid-stream ends it
    with an error event (``replica_lost``) and ``data: [DONE]``. However the response ends (done,
    the client gone, never started), the replica's stream is cancelled and ``ended`` is called
    once: the ingress's in-flight count cannot leak and a replica stops generating for nobody."""

    def __init__(self, stream: Any, head: HttpHead, ended: Callable[[], None]) -> None:
        super().__init__(_relay(stream), status_code=head.status)
        self.raw_headers = [(k, v) for k, v in head.headers if k.lower() != b"content-length"]
        self.stream, self.ended = stream, ended

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.cancel()
            self.ended()


async def _relay(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A stream's chunks; a replica lost mid-stream ends it with an error event and [DONE]."""
    try:
        async for chunk in stream:
            yield chunk
    except UNREACHABLE as exc:
        error = p.error_body(f"the replica serving this stream was lost ({type(exc).__name__}); retry the request.",
                             "server_error", code="replica_lost")
        yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


def busy() -> Response:
    """The ingress's 503 when every replica is full and ``--max-waiting`` requests wait already
    (Ray Serve's back-pressure; the single server's code for a full queue)."""
    body = p.error_body(f"the server is busy: every replica is full and the queue is too; retry in {RETRY_AFTER_S} s.",
                        "server_error", code="overloaded")
    return ErrorJSON(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


def unavailable(exc: BaseException) -> Response:
    """The ingress's 503 for a replica that died or cannot be reached (OpenAI's error JSON)."""
    body = p.error_body(f"no replica could serve the request ({type(exc).__name__}); retry in {RETRY_AFTER_S} s.",
                        "server_error", code="replica_unavailable")
    return ErrorJSON(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


@attrs.frozen(kw_only=True)
class Scaling:
    """How many replicas: ``replicas`` at the start; Ray Serve's autoscaling between
    ``min_replicas`` and ``max_replicas`` when they differ (target: ``target_ongoing`` requests
    in flight per replica)."""

    replicas: int
    min_replicas: int
    max_replicas: int
    target_ongoing: int


def application(spec: ReplicaSpec, scaling: Scaling, prefix_chars: int = PREFIX_CHARS) -> serve.Application:
    """The Ray Serve application: :class:`Ingress` over ``scaling`` replicas of ``spec``
    (their deployment options: :func:`replica_options`)."""
    replica = serve.deployment(Replica).options(name="Replica", **replica_options(spec, scaling))
    ingress = serve.deployment(Ingress).options(name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
    return ingress.bind(replica.bind(spec), prefix_chars)


def replica_options(spec: ReplicaSpec, scaling: Scaling) -> dict[str, Any]:
    """The replicas' Ray Serve deployment options: each asks Ray for ``spec.threads`` CPUs (so
    Ray places at most cores / threads of them on a node), takes up to batch_size + max_waiting
    requests (its engine's own bound; past that and ``max_waiting`` more queued at the ingress, a
    503 ``overloaded``), drains for ``spec.shutdown_timeout`` seconds, is built
    once (a runtime that cannot be built fails the start rather than being retried) and is
    routed by :class:`AffinityRouter`; ``scaling.replicas`` of them, or Ray Serve's autoscaling
    between ``min_replicas`` and ``max_replicas`` (target: a replica's slots in flight)."""
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": spec.threads}, "max_ongoing_requests": spec.inference.batch_size + spec.max_waiting,
        "max_queued_requests": spec.max_waiting,
        "graceful_shutdown_timeout_s": spec.shutdown_timeout, "max_constructor_retry_count": 1,
        "request_router_config": RequestRouterConfig(request_router_class=AffinityRouter,
                                                     request_router_kwargs={"imbalance": spec.inference.batch_size}),
    }
    if scaling.min_replicas == scaling.max_replicas:
        return options | {"num_replicas": scaling.replicas}
    return options | {"autoscaling_config": {"min_replicas": scaling.min_replicas, "max_replicas": scaling.max_replicas,
                                             "initial_replicas": scaling.replicas, "target_ongoing_requests": scaling.target_ongoing}}
