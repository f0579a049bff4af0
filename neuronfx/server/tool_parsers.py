"""Tool calls in a model's text: what part of it is content and which calls it writes.

A parser is a pure function ``scan(text, final) -> Scan`` over the text generated so far
(``final``: the answer is complete). Its results only grow as the text grows: the content is a
prefix of the final content and each call's ``arguments`` a prefix of its final arguments, so a
stream sends the difference between two scans and the deltas concatenate to the whole answer
(``tools.py``). The arguments are the JSON text the model wrote, verbatim.

The formats (behaviour as vLLM's ``hermes_tool_parser.py`` and ``llama_tool_parser.py``; the
code is neuronfx's own):

- ``hermes`` (Qwen2.5, Qwen3, SmolLM3, Hermes templates): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` blocks; the text before the first block is content, text between and
  after blocks is dropped.
- ``llama3_json`` (Llama 3.1 / 3.2 templates): the whole answer is one or more
  ``{"name": ..., "parameters": {...}}`` objects (optionally after ``<|python_tag|>``, separated
  by ``;``); an answer that does not start with ``{`` is content.

An answer with no readable call is all content (vLLM's fallback). Two forced shapes serve
``tool_choice`` "required" (:func:`forced_required`: a JSON array of ``{"name", "parameters"}``)
and a named function (:func:`forced_function`: the arguments object itself), whose text a
grammar constrains.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import attrs

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_NAME = r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'
_HEADERS = {"hermes": re.compile(_NAME + r'"arguments"\s*:\s*'),
            "llama3_json": re.compile(_NAME + r'"(?:parameters|arguments)"\s*:\s*'),
            "required": re.compile(_NAME + r'"parameters"\s*:\s*')}
_ARGUMENT_KEYS = {"hermes": ("arguments",), "llama3_json": ("parameters", "arguments"), "required": ("parameters",)}
_CLOSE = re.compile(r"\s*\}")
_DECODER = json.JSONDecoder()


@attrs.frozen
class CallScan:
    """One tool call as read so far: its function's name and its arguments' JSON text."""

    name: str
    arguments: str
    complete: bool  # its JSON object closed


@attrs.frozen
class Scan:
    """What a text says so far: its content (safe to send now) and its tool calls."""

    content: str
    calls: tuple[CallScan, ...] = ()


Scanner = Callable[[str, bool], Scan]


def read_call(text: str, pos: int, fmt: str) -> tuple[CallScan | None, int]:
    """The call whose JSON object starts at ``text[pos]`` ("{") in format ``fmt``: (the call,
    or None while neither its name nor the whole object is readable, the position after it).
    With the name first, the arguments stream as written (an unfinished object or array is a
    prefix of itself); otherwise the call is read once its object is whole."""
    header = _HEADERS[fmt].match(text, pos)
    if header is None:
        try:
            obj, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            return None, pos
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None, pos
        arguments = next((obj[k] for k in _ARGUMENT_KEYS[fmt] if k in obj), {})
        return CallScan(obj["name"], json.dumps(arguments, ensure_ascii=False), True), end
    name = json.loads(f'"{header.group(1)}"')
    start = header.end()
    try:
        _, end = _DECODER.raw_decode(text, start)
    except ValueError:  # not finished yet (or broken): what there is, when it can only grow
        partial = text[start:] if text[start:start + 1] in ("{", "[") else ""
        return CallScan(name, partial, False), len(text)
    close = _CLOSE.match(text, end)
    return CallScan(name, text[start:end], close is not None), close.end() if close else len(text)


def hold_back(text: str, tag: str) -> str:
    """``text`` without a tail that may be the start of ``tag`` (it is not content yet)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text


def hermes(text: str, final: bool) -> Scan:
    """Hermes ``<tool_call>`` blocks (module doc)."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return Scan(text if final else hold_back(text, HERMES_OPEN))
    calls, pos = [], start
    while pos >= 0:
        body_start = pos + len(HERMES_OPEN)
        close = text.find(HERMES_CLOSE, body_start)
        body = text[body_start:close if close >= 0 else len(text)]
        first = len(body) - len(body.lstrip())
        call = read_call(body, first, "hermes")[0] if body[first:first + 1] == "{" else None
        if call is not None:
            calls.append(call)
        if close < 0:
            break
        pos = text.find(HERMES_OPEN, close)
    return Scan(text if final and not calls else text[:start], tuple(calls))


def llama3_json(text: str, final: bool) -> Scan:
    """Llama 3's JSON tool calls (module doc)."""
    pos = len(text) - len(text.lstrip())
    if text.startswith(PYTHON_TAG, pos):
        pos = len(text) - len(text[pos + len(PYTHON_TAG):].lstrip())
    elif not final and PYTHON_TAG.startswith(text[pos:]):
        return Scan("")  # nothing but blanks (or the start of the tag) yet: content or calls, undecided
    if not text.startswith("{", pos):
        return Scan("" if pos == len(text) and not final else text)
    calls = _call_list(text, pos, "llama3_json", ";")
    return Scan(text if final and not calls else "", calls)


def forced_required(text: str, final: bool) -> Scan:
    """``tool_choice`` "required": a JSON array of ``{"name", "parameters"}`` objects."""
    pos = len(text) - len(text.lstrip())
    calls = _call_list(text, pos + 1, "required", ",") if text.startswith("[", pos) else ()
    return Scan(text if final and not calls else "", calls)


def forced_function(name: str) -> Scanner:
    """A named ``tool_choice``: the whole text is the arguments of a call of ``name``."""

    def scan(text: str, final: bool) -> Scan:
        return Scan("", (CallScan(name, text, final),))

    return scan


def _call_list(text: str, pos: int, fmt: str, separator: str) -> tuple[CallScan, ...]:
    """The calls of a list of JSON objects from ``pos``, separated by blanks and ``separator``."""
    calls = []
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == separator):
            pos += 1
        if not text.startswith("{", pos):
            return tuple(calls)
        call, pos = read_call(text, pos, fmt)
        if call is None:
            return tuple(calls)
        calls.append(call)
        if not call.complete:
            return tuple(calls)


PARSERS: dict[str, Scanner] = {"hermes": hermes, "llama3_json": llama3_json}
"""``--tool-call-parser`` choices."""


def parser_for_template(template: str | None) -> str | None:
    """The parser a chat template's tool format calls for: "hermes" for a template that writes
    ``<tool_call>``, "llama3_json" for Llama 3.1's (``<|python_tag|>`` or its
    ``"parameters": dictionary`` instruction), else None."""
    if not template:
        return None
    if HERMES_OPEN in template:
        return "hermes"
    if PYTHON_TAG in template or '"parameters": dictionary' in template:
        return "llama3_json"
    return None
