"""A request's structured-output fields as one :class:`neuronfx.StructuredOutputs`.

OpenAI's ``response_format`` (``{"type": "json_object"}``, ``{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}``), vLLM's ``structured_outputs`` extra (``json``,
``json_object``, ``regex``, ``choice``, ``grammar``) and vLLM's older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` all say the same thing: at most one of
them per request, else a 400 naming the second. A value of the wrong shape (an empty choice
list, a schema that is not an object) is a 400 naming its field; whether the grammar library
takes the schema, regex or grammar is checked with the engine's request (``requests.py``),
before anything is queued.
"""

from __future__ import annotations

from typing import Any

from neuronfx.config.structured import StructuredOutputs
from neuronfx.errors import SamplingParamsError
from neuronfx.server import protocol as p


def structured_outputs(req: p.GenerationRequest) -> tuple[StructuredOutputs | None, str | None]:
    """(the request's constraint, the field that gave it), or (None, None) for free text;
    ApiError 400 naming the field for two constraints or a malformed one."""
    given = [(field, kind) for field, kind in _sources(req) if kind is not None]
    if len(given) > 1:
        names = ", ".join(field for field, _ in given)
        raise p.ApiError(400, f"{names}: give at most one structured-output constraint per request (response_format, "
                              "structured_outputs or a guided_* field).", param=given[1][0])
    if not given:
        return None, None
    field, arguments = given[0]
    try:
        return StructuredOutputs(**arguments), field
    except SamplingParamsError as exc:
        raise p.ApiError(400, f"{field}: {exc}", param=field) from exc


def _sources(req: p.GenerationRequest) -> list[tuple[str, dict[str, Any] | None]]:
    """Each structured-output field with the StructuredOutputs arguments it gives (None: unset)."""
    so = req.structured_outputs
    body = None
    if so is not None:
        body = {k: v for k, v in {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                                  "json_object": so.json_object}.items() if v is not None}
    guided = {"guided_json": ("json", req.guided_json), "guided_regex": ("regex", req.guided_regex),
              "guided_choice": ("choice", req.guided_choice), "guided_grammar": ("grammar", req.guided_grammar)}
    return [("response_format", _response_format(req.response_format)), ("structured_outputs", body),
            *((field, None if value is None else {kind: value}) for field, (kind, value) in guided.items())]


def _response_format(fmt: p.ResponseFormat | None) -> dict[str, Any] | None:
    """StructuredOutputs arguments of ``response_format`` (None for text)."""
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise p.ApiError(400, "response_format.json_schema is only allowed with type 'json_schema'.", param="response_format")
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise p.ApiError(400, "response_format of type 'json_schema' needs json_schema.schema (a JSON schema), e.g. "
                              '{"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}.',
                         param="response_format")
    return {"json": fmt.json_schema.schema_}
