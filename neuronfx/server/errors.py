"""OpenAI's error JSON for every error the app answers: an ApiError as raised, FastAPI's 422 as a
400, unknown paths (404) and methods (405), and a 500 without a traceback for anything
unexpected (logged)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from neuronfx.server import protocol as p

logger = logging.getLogger("neuronfx.server")


class ErrorJSON(JSONResponse):
    """An error's JSON with every non-ASCII character escaped: its message may quote the request,
    whose strings JSON lets hold a lone surrogate, which UTF-8 cannot encode."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def add_error_handlers(app: FastAPI) -> None:
    """OpenAI's error JSON for every error: ApiError as raised, FastAPI's 422 as a 400, unknown
    paths (404) and methods (405), and a 500 without a traceback for anything unexpected."""

    @app.exception_handler(p.ApiError)
    async def api_error(request: Request, exc: p.ApiError) -> JSONResponse:
        return ErrorJSON(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = content_type_message(exc.errors(), request.headers.get("content-type")) or validation_message(exc.errors())
        return ErrorJSON(p.error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            body = p.error_body(f"Invalid URL ({where}): no such endpoint; see /docs.", "invalid_request_error", code="unknown_url")
        elif exc.status_code == 405:
            body = p.error_body(f"Method not allowed ({where}); see /docs.", "invalid_request_error", code="method_not_allowed")
        elif exc.status_code == 400 and exc.detail == "There was an error parsing the body":  # FastAPI: not JSON, not UTF-8
            body = p.error_body("the request body could not be read: send a JSON object as UTF-8 text.", "invalid_request_error")
        else:
            body = p.error_body(str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error")
        return ErrorJSON(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return ErrorJSON(p.error_body("internal server error; see the server's log.", "server_error", code="internal_error"),
                         status_code=500)


FIELD_SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "messages": 'a list of {"role": "system"|"developer"|"user"|"assistant"|"tool", "content": text or a list of '
                '{"type": "text", "text": ...} parts} (images and audio are not supported)',
    "content": 'text or a list of {"type": "text", "text": ...} parts (images and audio are not supported)',
}
"""What a union-typed field accepts: its 400 names this instead of one error per union member."""


def content_type_message(errors: Sequence[dict], content_type: str | None) -> tuple[str, None] | None:
    """The 400 for a body sent with a Content-Type other than JSON (curl's ``-d`` alone sends a
    form), else None: FastAPI then hands the raw bytes to the model, and pydantic's "must be a
    JSON object ... got b'{...}'" would blame a body that is a JSON object."""
    if not any(tuple(e["loc"]) == ("body",) and isinstance(e.get("input"), bytes) for e in errors):
        return None
    return (f"the request body was sent with Content-Type {content_type!r}; send it as JSON with the header "
            "Content-Type: application/json (curl: -H 'Content-Type: application/json')."), None


def validation_message(errors: Sequence[dict]) -> tuple[str, str | None]:
    """(message, param) of pydantic's errors for a request body (FastAPI's 422 made a 400): the
    first error, named by its field path (a lone surrogate first: a union field's other members
    fail on the same string only because it is a string); a union field's several member errors
    become one line saying what the field accepts (FIELD_SHAPES)."""
    first = next((e for e in errors if e["type"] == "lone_surrogate"), errors[0])
    loc = [str(part) for part in first["loc"]]
    if first["type"] == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}.", None
    path = loc[1:] if loc and loc[0] == "body" else loc
    if first["type"] == "string_unicode" and isinstance(first.get("input"), str):  # pydantic's own check of a field name
        where = f"in {'.'.join(path)}" if path else "of the request body"
        return (f"a field name {where} has a lone UTF-16 surrogate (got {first['input']!r:.40}); send valid Unicode (a surrogate only "
                "as one half of a pair)."), path[0] if path else None
    if not path:
        return f"the request body must be a JSON object ({first['msg']}; got {first.get('input')!r:.60}).", None
    param = path[0]
    if first["type"] == "extra_forbidden":
        return f"Unrecognized request argument supplied: {'.'.join(path)}.", ".".join(path)
    if first["type"] == "missing":
        return f"{'.'.join(path)} is required.", ".".join(path)
    where = ".".join(p for p in path if not _is_union_tag(p))
    if first["type"] == "lone_surrogate":
        return f"{where} has {first['msg']}; send valid Unicode (a surrogate only as one half of a pair).", param
    shape = next((FIELD_SHAPES[p] for p in reversed(path) if p in FIELD_SHAPES), None)
    if shape is not None and any(_is_union_tag(p) for p in path):
        return f"{where} must be {shape}; got {first.get('input')!r:.80}.", param
    return f"{where}: {first['msg']} (got {first.get('input')!r:.80}).", param


def _is_union_tag(part: str) -> bool:
    # pydantic names a union member in an error location by its type: "str", "list[int]", ...
    return part in ("str", "int", "float", "bool") or "[" in part
