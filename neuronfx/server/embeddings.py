"""OpenAI's /v1/embeddings, served by an embedding runtime (``neuronfx serve --task embed``).

The request (:class:`EmbeddingRequest`) takes ``input`` as a string, a list of strings, a list
of token ids or a list of such lists; strings are tokenized as completions' prompts are. The
answer is OpenAI's: ``{"object": "list", "data": [{"object": "embedding", "index": i,
"embedding": [...]}, ...], "model", "usage": {"prompt_tokens", "total_tokens"}}``, vectors in
input order, each a list of floats or, with ``encoding_format="base64"`` (what the official
client asks for), the base64 of its little-endian float32 bytes.

An embedding runtime keeps no state: the handler runs :func:`neuronfx.runtime.embed.embed` in a
worker thread (one call at a time), while the engine thread only waits for the stop. Bad input
is a 400 before anything runs: /v1/embeddings on a generation runtime, completions, chat or
responses on an embedding runtime (``requests.checked_request``), an empty input, a prompt
longer than ``max_context_length``, ids outside the vocabulary.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import threading
from typing import Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import StrictInt

from neuronfx.errors import InputError
from neuronfx.runtime.embed import check_embed_prompts, embed, is_embedding
from neuronfx.server import protocol as p
from neuronfx.server.engine import Engine
from neuronfx.server.requests import check_chars, check_model, prompt_error, served_by
from neuronfx.server.served import Served


class EmbeddingRequest(p.RequestModel):
    """OpenAI's embeddings request (``dimensions``: only the model's hidden size, or none)."""

    input: p.Text | list[p.Text] | list[StrictInt] | list[list[StrictInt]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None


def embedding_prompts(body: EmbeddingRequest, served: Served) -> list[list[int]]:
    """Token ids of each input (strings tokenized with special tokens, as completions); 400s for
    a generation runtime, an empty input, a ``dimensions`` other than the hidden size, or a
    prompt the plan cannot take (empty, too long, ids outside the vocabulary)."""
    if not is_embedding(served.runtime):
        raise p.ApiError(400, "this server generates: it has no embed graphs; serve an embedding runtime with "
                              "neuronfx serve --task embed (--pooling last or mean) for /v1/embeddings.", param="model")
    hidden = served.runtime.plan.model.hidden_size
    if body.dimensions is not None and body.dimensions != hidden:
        raise p.ApiError(400, f"dimensions={body.dimensions}: this model's embeddings have {hidden}; omit dimensions.", param="dimensions")
    raw = body.input
    if not raw:
        raise p.ApiError(400, "input is empty; give a string, a list of strings or token ids.", param="input")
    inputs = [raw] if isinstance(raw, str) or isinstance(raw[0], int) else raw
    prompts = [list(served.tokenizer(check_chars(x, served, "input"))["input_ids"]) if isinstance(x, str) else list(x) for x in inputs]
    try:
        return check_embed_prompts(served.runtime, prompts)
    except InputError as exc:
        raise prompt_error(exc, "input") from exc


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def add_embeddings_routes(app: FastAPI, engine: Engine, model_name: str) -> None:
    """POST /v1/embeddings (module doc); one embed call runs at a time."""
    lock = threading.Lock()

    def run(served: Served, prompts: list[list[int]]) -> list[list[float]]:
        with lock:
            return embed(served.runtime, prompts).tolist()

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> JSONResponse:
        served = served_by(engine)
        check_model(body.model, model_name)
        prompts = embedding_prompts(body, served)
        vectors = await asyncio.to_thread(run, served, prompts)
        tokens = sum(map(len, prompts))
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)} for i, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data, "model": model_name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
