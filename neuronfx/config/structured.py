"""Structured outputs: what a request's tokens must match (vLLM's ``StructuredOutputsParams``),
as a frozen value that rides on :class:`~neuronfx.config.sampling.SamplingParams`.

Exactly one kind per request: ``json`` (a JSON schema), ``json_object`` (any JSON object),
``regex``, ``choice`` (one of these strings) or ``grammar`` (a Lark grammar as llguidance
reads it, or GBNF / EBNF as xgrammar reads it). Construction checks the value's *shape* only
(types, exactly one kind, a non-empty choice); whether the grammar library accepts the schema,
regex or grammar is checked where a request enters (``neuronfx.runtime.structured``), before
anything is queued. A JSON schema is kept as compact JSON text in its declared key order (the
grammar makes the model write properties in that order, so sorting keys would reorder the
output); equal schemas are equal values and a compiled grammar is cached by (kind, spec).
"""

from __future__ import annotations

import json as jsonlib
from typing import Any

import attrs

from neuronfx.errors import SamplingParamsError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
"""The constraint kinds, in vLLM's field names."""


def _compact_json(value: object) -> object:
    """A schema given as a dict (or JSON text) becomes compact JSON text, keys in their given
    order; anything else is left for the check."""
    if isinstance(value, (dict, bool)):
        return jsonlib.dumps(value, separators=(",", ":"))
    if isinstance(value, str):
        try:
            return jsonlib.dumps(jsonlib.loads(value), separators=(",", ":"))
        except ValueError as exc:
            raise SamplingParamsError(f"StructuredOutputs.json={value[:80]!r} is not valid JSON ({exc}); give a JSON schema as "
                                      "a dict or as JSON text.") from None
    return value


def _choices(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


def _check_shape(inst: StructuredOutputs) -> None:
    given = [k for k in KINDS if getattr(inst, k) not in (None, False)]
    if len(given) != 1:
        raise SamplingParamsError(f"StructuredOutputs needs exactly one of {', '.join(KINDS)}; got {given or 'none'}. Give one "
                                  "kind per request (e.g. StructuredOutputs(json=schema)).")
    if inst.json is not None and not isinstance(inst.json, str):
        raise SamplingParamsError(f"StructuredOutputs.json={inst.json!r:.80} must be a JSON schema (a dict or JSON text).")
    for name in ("regex", "grammar"):
        value = getattr(inst, name)
        if value is not None and not (isinstance(value, str) and value):
            raise SamplingParamsError(f"StructuredOutputs.{name}={value!r:.80} must be a non-empty str.")
    if inst.choice is not None and not (isinstance(inst.choice, tuple) and inst.choice
                                        and all(isinstance(c, str) and c for c in inst.choice)):
        raise SamplingParamsError(f"StructuredOutputs.choice={inst.choice!r:.80} must be a non-empty list of non-empty strings.")
    if not isinstance(inst.json_object, bool):
        raise SamplingParamsError(f"StructuredOutputs.json_object={inst.json_object!r} must be a bool.")


@attrs.frozen(kw_only=True)
class StructuredOutputs:
    """What a request's generated text must match; exactly one field set.

    - ``json``: a JSON schema (dict or JSON text; kept as compact JSON text, keys in order);
    - ``json_object``: True for any JSON object (OpenAI's ``{"type": "json_object"}``);
    - ``regex``: a regular expression the whole output matches;
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: a context-free grammar (Lark syntax for llguidance, the default backend;
      GBNF / EBNF for xgrammar).

    Raises SamplingParamsError when no field or more than one is set, or a field has the wrong
    type. vLLM's ``StructuredOutputsParams`` has the same fields
    (``vllm/sampling_params.py``)."""

    json: str | None = attrs.field(default=None, converter=lambda v: None if v is None else _compact_json(v))
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_choices)
    grammar: str | None = None

    def __attrs_post_init__(self) -> None:
        _check_shape(self)

    @property
    def kind(self) -> str:
        """The one kind set (one of :data:`KINDS`)."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> Any:
        """The kind's value: the schema's JSON text, True, the regex, the choices or the
        grammar text; (kind, spec) keys a compiled grammar."""
        return getattr(self, self.kind)
