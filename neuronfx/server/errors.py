"""OpenAI's error JSON for every error the app answers: an ApiError as raised, FastAPI's 422 as a
400, unknown paths (404) and methods (405), and a 500 without a traceback for anything
unexpected (logged)."""

from __future__ import annotations

import json
import logging

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
        message, param = p.validation_message(exc.errors())
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
