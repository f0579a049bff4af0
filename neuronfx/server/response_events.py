"""The Responses API's output: the response object, its output items (an assistant ``message``
with ``output_text``, ``function_call`` items) and the stream of typed events OpenAI sends
(``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` / ``.done``,
``response.content_part.done``, ``response.function_call_arguments.delta`` / ``.done``,
``response.output_item.done``, then ``response.completed`` or ``response.incomplete``), each
with its ``sequence_number``. Shapes as OpenAI's API reference and the ``openai`` client's
types (``openai/types/responses``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import attrs

from neuronfx.server.tool_parsers import Scan
from neuronfx.server.tools import CallDelta, CallStream, new_call_id


def item_id(prefix: str) -> str:
    """An id of the Responses API: ``resp_``, ``msg_`` or ``fc_`` and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(input_tokens: int, output_tokens: int) -> dict:
    """The Responses API's ``usage`` object."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": input_tokens + output_tokens}


def text_part(text: str) -> dict:
    """An ``output_text`` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(id: str, text: str, status: str = "completed") -> dict:
    """An assistant ``message`` output item (no content parts while in progress)."""
    return {"id": id, "type": "message", "status": status, "role": "assistant", "content": [text_part(text)] if status == "completed" else []}


def call_item(id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    """A ``function_call`` output item."""
    return {"id": id, "type": "function_call", "status": status, "call_id": call_id, "name": name, "arguments": arguments}


def output_items(scan: Scan) -> list[dict]:
    """The output items of a whole answer: its content as a message (when any), then its calls."""
    items = [message_item(item_id("msg"), scan.content)] if scan.content or not scan.calls else []
    return items + [call_item(item_id("fc"), new_call_id(), c.name, c.arguments) for c in scan.calls]


def output_messages(items: list[dict]) -> list[dict[str, Any]]:
    """The output items as chat-template messages (what a later ``previous_response_id`` turn
    sees): the text as an assistant message, the calls as its ``tool_calls``."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": _json_or_text(it["arguments"])}}
             for it in items if it["type"] == "function_call"]
    return [{"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {})]


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) of an answer that ended with ``finish_reason``."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def event(kind: str, seq: int, **fields: Any) -> str:
    """One Server-Sent Event of the Responses API stream."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq} | fields)}\n\n"


@attrs.define
class EventStream:
    """The events of one streamed response so far (mutable; one per stream): the output items
    opened, which is the open message, and the next sequence number. ``base`` is the response
    object without its status, output and usage."""

    base: dict
    seq: int = 0
    items: list[dict] = attrs.Factory(list)
    message: int | None = None  # output index of the open message item
    calls: dict[int, int] = attrs.Factory(dict)  # call index -> output index
    sent: CallStream = attrs.Factory(CallStream)

    def emit(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return event(kind, self.seq - 1, **fields)

    def start(self) -> list[str]:
        response = self.base | {"status": "in_progress", "output": [], "usage": None}
        return [self.emit("response.created", response=response), self.emit("response.in_progress", response=response)]

    def text(self, delta: str) -> list[str]:
        """Events of new content: the message item and its part opened first."""
        out = []
        if self.message is None:
            self.message = len(self.items)
            self.items.append(message_item(item_id("msg"), "", "in_progress"))
            out.append(self.emit("response.output_item.added", output_index=self.message, item=self.items[self.message]))
            out.append(self.emit("response.content_part.added", item_id=self.items[self.message]["id"], output_index=self.message,
                                   content_index=0, part=text_part("")))
            self.items[self.message]["content"] = [text_part("")]
        part = self.items[self.message]["content"][0]
        part["text"] += delta
        return out + [self.emit("response.output_text.delta", item_id=self.items[self.message]["id"], output_index=self.message,
                                  content_index=0, delta=delta, logprobs=[])]

    def close_message(self) -> list[str]:
        """Events that finish the open message item (none when none is open)."""
        if self.message is None:
            return []
        index, item = self.message, self.items[self.message]
        self.message = None
        item["status"] = "completed"
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [self.emit("response.output_text.done", **where, text=part["text"], logprobs=[]),
                self.emit("response.content_part.done", **where, part=part),
                self.emit("response.output_item.done", output_index=index, item=item)]

    def call(self, delta: CallDelta) -> list[str]:
        """Events of a call's new text: its item opened first (the message closed before it)."""
        out = []
        if delta.id is not None:
            out = self.close_message()
            self.calls[delta.index] = len(self.items)
            self.items.append(call_item(item_id("fc"), delta.id, delta.name or "", "", "in_progress"))
            out.append(self.emit("response.output_item.added", output_index=self.calls[delta.index], item=dict(self.items[-1])))
        index = self.calls[delta.index]
        if delta.arguments:
            self.items[index]["arguments"] += delta.arguments
            out.append(self.emit("response.function_call_arguments.delta", item_id=self.items[index]["id"], output_index=index,
                                   delta=delta.arguments))
        return out

    def finish(self, finish_reason: str | None, usage: dict) -> tuple[list[str], dict]:
        """The closing events and the final response object (an answer with no output at all
        gets an empty message, as a whole response does)."""
        out = self.text("") if not self.items else []
        out += self.close_message()
        for index in self.calls.values():
            item = self.items[index]
            item["status"] = "completed"
            out.append(self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
            out.append(self.emit("response.output_item.done", output_index=index, item=item))
        status, details = status_of(finish_reason)
        response = self.base | {"status": status, "incomplete_details": details, "output": self.items, "usage": usage}
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + [self.emit(kind, response=response)], response
