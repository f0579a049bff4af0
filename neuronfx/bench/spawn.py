"""Servers that ``neuronfx bench serving --launch`` starts for the run: ``neuronfx serve`` and
llama-cpp-python's OpenAI server on free loopback ports, each with ``OMP_NUM_THREADS`` set,
its output in a log file; the run waits until each answers, and stops them after (SIGTERM,
then SIGKILL after 30 s)."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs

from neuronfx.bench.options import Log
from neuronfx.errors import NeuronfxError

LAUNCHABLE = ("neuronfx", "llama.cpp")


@attrs.frozen(kw_only=True)
class ServerCommand:
    """A server to start: its label, command line and the URL that answers 200 once it is ready."""

    label: str
    argv: tuple[str, ...]
    url: str  # base URL of its OpenAI API
    ready_url: str


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(kind: str, model: str, port: int, threads: int, slots: int, max_prompt: int, max_total: int,
                   extra: str = "") -> ServerCommand:
    """The command line of a ``kind`` server ("neuronfx" or "llama.cpp") of ``model`` on
    ``port``: neuronfx serve with ``slots`` slots, prompts up to ``max_prompt`` tokens and
    ``max_total`` tokens per slot, plus ``extra`` options; llama.cpp's server with ``threads``
    threads, a context of at least ``max_total`` tokens and ``--interrupt_requests False`` (by
    default it cuts a running stream short whenever another request arrives)."""
    base = f"http://127.0.0.1:{port}"
    if kind == "neuronfx":
        argv = (sys.executable, "-m", "neuronfx", "serve", model, "--host", "127.0.0.1", "--port", str(port), "--batch-size",
                str(slots), "--max-context-length", str(max_prompt), "--sequence-length", str(max_total), *shlex.split(extra))
        return ServerCommand(label="neuronfx serve", argv=argv, url=base, ready_url=f"{base}/health")
    argv = (sys.executable, "-m", "llama_cpp.server", "--model", model, "--n_threads", str(threads), "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(max(2048, max_total)), "--interrupt_requests", "False")
    return ServerCommand(label="llama.cpp server", argv=argv, url=base, ready_url=f"{base}/v1/models")  # it has no /health


@contextmanager
def launched(server: ServerCommand, threads: int, timeout_s: float, log: Log) -> Iterator[ServerCommand]:
    """Start ``server`` (``OMP_NUM_THREADS=threads``, output to a log file), wait until its
    ready URL answers 200, stop it when the block ends. NeuronfxError with the log's tail when
    it exits or is not ready within ``timeout_s`` seconds."""
    with tempfile.TemporaryDirectory(prefix="neuronfx-bench-serving-") as logs:
        path = Path(logs) / "server.log"
        log(f"starting {server.label}: {shlex.join(server.argv)}")
        with path.open("w") as out:
            proc = subprocess.Popen(server.argv, env=os.environ | {"OMP_NUM_THREADS": str(threads)}, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_ready(server, proc, path, timeout_s)
            log(f"{server.label} ready")
            yield server
        finally:
            stop(proc)


def wait_ready(server: ServerCommand, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    """Poll the ready URL until it answers 200; NeuronfxError with the log's tail if the process
    exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(server.ready_url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet, or still loading (503)
        if proc.poll() is not None or time.monotonic() > deadline:
            what = f"exited with {proc.returncode}" if proc.poll() is not None else f"was not ready after {timeout_s:.0f} s"
            raise NeuronfxError(f"{server.label} {what}; its log ends:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (a neuronfx server drains), then SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
