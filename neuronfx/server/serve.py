"""Run the app under uvicorn with a graceful stop.

uvicorn listens at once; the engine thread builds the runtime meanwhile (GET /health answers 503
until it is ready). On SIGINT or SIGTERM the engine takes no new request (503), uvicorn stops
listening and waits up to ``shutdown_timeout`` seconds for in-flight requests to finish, cancels
the rest (their requests are aborted), and the process exits 0. A second SIGINT stops at once.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable
from types import FrameType

import uvicorn

from neuronfx.server.app import make_app
from neuronfx.server.engine import Engine, Served
from neuronfx.server.metrics import make_metrics

logger = logging.getLogger("neuronfx.server")


class GracefulServer(uvicorn.Server):
    """uvicorn's Server whose signal handler first stops the engine taking requests, and which
    does not re-raise the signal after its shutdown (uvicorn's own handler does, so the process
    would end with the signal's status instead of 0)."""

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.engine.begin_stop()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop now
        else:
            self.should_exit = True
        logger.info("signal %s: no new requests; finishing in-flight ones for up to %s s", signal.Signals(sig).name,
                    self.config.timeout_graceful_shutdown)


def serve(build: Callable[[], Served], *, model_name: str, host: str, port: int, max_waiting: int, shutdown_timeout: float,
          access_log: bool = False, max_num_batched_tokens: int | None = None, async_decode: bool = False) -> int:
    """Serve until SIGINT/SIGTERM. ``build`` (run in the engine thread) loads or compiles the
    runtime; ``max_num_batched_tokens`` is the scheduler's token budget per iteration under
    chunked prefill (None: derived, ``scheduler.token_budget``); ``async_decode``: the engine
    overlaps decode steps (``runtime/overlap.py``). Returns the exit status: 0 after a stop, 2 when ``build`` failed (its error is
    printed as one line)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s", stream=sys.stderr)
    server_box: list[GracefulServer] = []

    def on_failure(exc: BaseException) -> None:
        logger.error("the runtime could not be built: %s: %s", type(exc).__name__, exc)
        server_box[0].should_exit = True

    engine = Engine(build, max_waiting=max_waiting, metrics=make_metrics(), on_failure=on_failure,
                    max_num_batched_tokens=max_num_batched_tokens, async_decode=async_decode)
    config = uvicorn.Config(make_app(engine, model_name), host=host, port=port, timeout_graceful_shutdown=shutdown_timeout,
                            access_log=access_log, log_level="info", lifespan="on")
    server = GracefulServer(config, engine)
    server_box.append(server)
    logger.info("serving %s on http://%s:%d (loading and compiling first: /health answers 503 until ready)", model_name, host, port)
    server.run()
    if engine.failure is not None:
        print(f"neuronfx: error: {type(engine.failure).__name__}: {engine.failure}", file=sys.stderr)
        return 2
    logger.info("stopped")
    return 0
