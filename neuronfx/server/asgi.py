"""One HTTP request through an ASGI app in this process, without a socket: how a Ray Serve
replica (``server/replicas.py``) runs the whole neuronfx app — its validation, its 4xx, its
streams — for a request its ingress forwarded.

:func:`call_app` drives the app as an ASGI server would (the ASGI 3 HTTP spec:
https://asgi.readthedocs.io/en/latest/specs/www.html): it hands the request's body once, then
answers ``http.disconnect`` when the caller stops reading, so the app aborts that request's
engine work as it does for a client that went away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs

EVENT_STREAM = "text/event-stream"
SETTLE_S = 5.0
"""Seconds an app may take to end a request after its caller went away before it is cancelled."""

AsgiApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


@attrs.frozen
class HttpCall:
    """A request as the ingress received it: ``method`` ("GET", "POST", ...), ``path`` ("/v1/...",
    no query), ``query`` (the raw query string, bytes), ``headers`` ((name, value) byte pairs,
    names lower-case, as ASGI gives them) and ``body`` (bytes). ``replica``: the unique id of the
    replica the caller asks for (the ``x-neuronfx-replica`` request header), or None for any;
    ``affinity``: the prompt's prefix key (``server/affinity.py``), or None (no prompt)."""

    method: str
    path: str
    query: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    replica: str | None = None
    affinity: str | None = None


@attrs.frozen
class HttpHead:
    """A response's status, headers ((name, value) byte pairs) and, when it is not a stream,
    its whole body (``streamed`` False): a whole response travels in one piece, so a caller gets
    all of it or none."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    streamed: bool


def scope_of(call: HttpCall) -> dict[str, Any]:
    """The ASGI HTTP scope of ``call`` (a loopback client: the ingress)."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": call.method,
            "scheme": "http", "path": call.path, "raw_path": call.path.encode(), "query_string": call.query, "root_path": "",
            "headers": list(call.headers), "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}


def is_stream(headers: tuple[tuple[bytes, bytes], ...]) -> bool:
    """Whether a response with ``headers`` is a server-sent-event stream."""
    return any(name.lower() == b"content-type" and value.startswith(EVENT_STREAM.encode()) for name, value in headers)


async def call_app(app: AsgiApp, call: HttpCall) -> AsyncIterator[HttpHead | bytes]:
    """Run ``call`` through ``app``; yield its :class:`HttpHead` first, then, for a stream, each
    body chunk (bytes) as the app sends it. Closing the generator early (the caller went away)
    tells the app the client disconnected and waits for it to end. Raises RuntimeError when the
    app ends without a response (an ASGI app's bug)."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(scope_of(call), receive, sent.put))
    try:
        start = await _next_message(sent, task)
        headers = tuple((bytes(k), bytes(v)) for k, v in start.get("headers", ()))
        streamed = is_stream(headers)
        body = b"" if streamed else b"".join([chunk async for chunk in _body(sent, task)])
        yield HttpHead(status=start["status"], headers=headers, body=body, streamed=streamed)
        if streamed:
            async for chunk in _body(sent, task):
                yield chunk
    finally:
        gone.set()
        await _settle(task)


async def _settle(task: asyncio.Future) -> None:
    """Let the app end after the disconnect (it aborts its engine requests) for at most
    SETTLE_S seconds, then cancel it; its exception, if any, is dropped (the caller is gone)."""
    done, _ = await asyncio.wait({task}, timeout=SETTLE_S)
    if not done:
        task.cancel()
    elif not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" warning


async def _next_message(sent: asyncio.Queue, task: asyncio.Future) -> dict:
    """The app's next message; RuntimeError when it ended without one (its exception, if any,
    is raised as is)."""
    get = asyncio.ensure_future(sent.get())
    try:
        await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not get.done():
            get.cancel()
    if get.done() and not get.cancelled():
        return get.result()
    if not sent.empty():
        return sent.get_nowait()
    task.result()  # the app's own exception
    raise RuntimeError("the ASGI app ended without sending its response")


async def _body(sent: asyncio.Queue, task: asyncio.Future) -> AsyncIterator[bytes]:
    """The response's body chunks up to the last (``more_body`` False)."""
    while True:
        message = await _next_message(sent, task)
        if message["type"] != "http.response.body":
            continue
        if message.get("body"):
            yield bytes(message["body"])
        if not message.get("more_body", False):
            return
