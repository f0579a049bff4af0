"""Run the app under uvicorn with a graceful stop.

The port is bound first, before anything loads: a busy port is an InputError at once (``neuronfx
serve`` exits 2 with one line naming the port and ``--port``). uvicorn then listens on it while
the engine thread builds the runtime (GET /health answers 503 until it is ready).

On SIGINT or SIGTERM the server drains: it keeps listening and answers every new request with 503
(``shutting_down``), while the requests in flight run to their end, for up to ``shutdown_timeout``
seconds; those still running then are aborted (a stream ends with an error event and ``data:
[DONE]``, a whole response is a 503). Then uvicorn stops listening, gives the last responses up to
``FINAL_WRITE_S`` seconds to be written, the engine stops and the process exits 0. A second SIGINT
stops at once.
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from neuronfx.errors import InputError
from neuronfx.server.app import make_app
from neuronfx.server.engine import Engine
from neuronfx.server.metrics import make_metrics
from neuronfx.server.served import Served

logger = logging.getLogger("neuronfx.server")

FINAL_WRITE_S = 2.0
"""Seconds uvicorn waits, after the drain, for the last responses (final chunks, error events) to
reach their clients before it cancels what is left."""


class GracefulServer(uvicorn.Server):
    """uvicorn's Server that drains before it stops (see the module doc): its signal handler stops
    the engine taking requests and starts the drain, and ``on_tick`` (uvicorn's main loop, every
    0.1 s) ends the loop once nothing is in flight, aborting what still runs after
    ``drain_timeout`` seconds. It does not re-raise the signal after its shutdown (uvicorn's own
    handler does, so the process would end with the signal's status instead of 0)."""

    def __init__(self, config: uvicorn.Config, engine: Engine, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self.drain_started: float | None = None  # time.monotonic() of the first signal
        self.aborted = False  # the drain timed out and aborted what still ran

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_started is None and not self.should_exit:
            self.engine.begin_stop()
            self.drain_started = time.monotonic()
            logger.info("signal %s: new requests get 503; finishing %d in-flight ones for up to %s s (Ctrl-C again: stop now)",
                        signal.Signals(sig).name, self.engine.in_flight, self.drain_timeout)
        elif sig == signal.SIGINT:  # a second Ctrl-C: stop now
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self.drain_started is None:
            return False
        in_flight = self.engine.in_flight
        if in_flight == 0:
            logger.info("drained in %.1f s", time.monotonic() - self.drain_started)
            return True
        if not self.aborted and time.monotonic() - self.drain_started >= self.drain_timeout:
            self.aborted = True
            logger.warning("%d requests still running after %s s (--shutdown-timeout): aborting them", in_flight, self.drain_timeout)
            self.engine.abort_all()
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), as uvicorn would bind it (SO_REUSEADDR, IPv6 for a
    host with ':'); uvicorn listens on it. Raises InputError naming the address and the fix when
    it cannot be bound (the port is taken, the host is not this machine's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            fix = "another process listens there (another neuronfx serve?): stop it, or pick a free port with --port"
        else:
            fix = "check --host (an address of this machine) and --port"
        raise InputError(f"cannot listen on {host}:{port} (--host {host} --port {port}): {exc.strerror or exc}; {fix}.") from exc
    sock.set_inheritable(True)
    return sock


def serve(build: Callable[[], Served], *, model_name: str, host: str, port: int, max_waiting: int, shutdown_timeout: float,
          access_log: bool = False, max_num_batched_tokens: int | None = None, async_decode: bool = False,
          tool_parser: str | None = None) -> int:
    """Serve until SIGINT/SIGTERM. ``build`` (run in the engine thread) loads or compiles the
    runtime; ``max_num_batched_tokens`` is the scheduler's token budget per iteration under
    chunked prefill (None: derived, ``scheduler.token_budget``); ``async_decode``: the engine
    overlaps decode steps (``runtime/overlap.py``); ``tool_parser``: how "auto" tool calls are
    read (None: from the chat template); ``shutdown_timeout``: seconds a stop drains
    in-flight requests (module doc). Returns the exit status: 0 after a stop, 2 when ``build``
    failed (its error is printed as one line). Raises InputError when (host, port) cannot be
    bound (:func:`bind_socket`), before anything loads."""
    sock = bind_socket(host, port)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s", stream=sys.stderr)
    server_box: list[GracefulServer] = []

    def on_failure(exc: BaseException) -> None:
        logger.error("the runtime could not be built: %s: %s", type(exc).__name__, exc)
        server_box[0].should_exit = True

    engine = Engine(build, max_waiting=max_waiting, metrics=make_metrics(model_name), on_failure=on_failure,
                    max_num_batched_tokens=max_num_batched_tokens, async_decode=async_decode)
    config = uvicorn.Config(make_app(engine, model_name, tool_parser=tool_parser), timeout_graceful_shutdown=FINAL_WRITE_S, access_log=access_log,
                            log_level="info", lifespan="on")
    server = GracefulServer(config, engine, drain_timeout=shutdown_timeout)
    server_box.append(server)
    url_host = f"[{host}]" if ":" in host else host
    logger.info("serving %s on http://%s:%d (loading and compiling first: /health answers 503 until ready)", model_name, url_host,
                sock.getsockname()[1])
    server.run(sockets=[sock])
    if engine.failure is not None:
        print(f"neuronfx: error: {type(engine.failure).__name__}: {engine.failure}", file=sys.stderr)
        return 2
    logger.info("stopped")
    return 0
