"""Prefix affinity for data-parallel replicas: which replica a request should go to.

A replica's prefix cache only helps the requests that reach it, so requests that share a long
prefix (a system prompt, a document, a few-shot preamble) should land on the same replica. The
router (``server/replicas.py``'s :class:`AffinityRouter`) keys a request by the first
``chars`` characters of its prompt text (:func:`prefix_text`, :func:`prefix_key`) and keeps the
replica each key went to last (:class:`AffinityTable`); a key seen before goes back to its
replica unless that replica's queue is more than ``imbalance`` requests longer than the
shortest (:func:`ranked`), and a new key (or a request without a prompt: /v1/models, /metrics)
goes to the replica with the shortest queue. This is the policy of Ray Serve LLM's
``PrefixCacheAffinityRouter`` (prefix match while the load is balanced, least queue otherwise)
with the whole-prefix key of SGLang's and llm-d's simplest routers instead of a character tree.

Pure functions and a bounded table: no Ray here, so they are tested without a cluster.
"""

from __future__ import annotations

import collections
import hashlib
import json
from collections.abc import Mapping, Sequence

PREFIX_CHARS = 256
"""Characters of a prompt that key its replica by default: about 60 tokens of English, longer
than a chat template's fixed head, shorter than a system prompt worth caching."""

TABLE_SIZE = 65_536
"""Keys an :class:`AffinityTable` remembers (the least recently routed go first)."""

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def prefix_text(path: str, body: bytes) -> str | None:
    """The prompt's text of a request to ``path`` with JSON ``body``, in the order the model
    reads it: chat messages as "role: content" lines (text parts only), a completion's prompt
    (the first of a list; token ids as text), a response's instructions then input. None for
    other paths and for a body that is not such a JSON object (the replica answers its 400)."""
    if path not in GENERATION_PATHS:
        return None
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict):
        return None
    if path == "/v1/chat/completions":
        return _messages_text(request.get("messages"))
    if path == "/v1/completions":
        return _prompt_text(request.get("prompt"))
    head = request.get("instructions") if isinstance(request.get("instructions"), str) else ""
    rest = request.get("input")
    text = rest if isinstance(rest, str) else _messages_text(rest)
    return None if text is None else head + "\n" + text


def _messages_text(messages: object) -> str | None:
    if not isinstance(messages, list):
        return None
    lines = [f"{m.get('role')}: {_content_text(m.get('content'))}" for m in messages if isinstance(m, dict)]
    return "\n".join(lines) if lines else None


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


def _prompt_text(prompt: object) -> str | None:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts: keyed by its first
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return ",".join(map(str, prompt))
    return None


def prefix_key(text: str, chars: int = PREFIX_CHARS) -> str:
    """The key of a prompt ``text``: sha256 hex of its first ``chars`` characters (the whole
    text when shorter). Raises ValueError for ``chars`` < 1."""
    if chars < 1:
        raise ValueError(f"chars={chars} must be >= 1 (characters of a prompt that key its replica).")
    return hashlib.sha256(text[:chars].encode("utf-8", "surrogatepass")).hexdigest()


def ranked(owner: str | None, queue_lens: Mapping[str, int | None], imbalance: int) -> list[list[str]]:
    """Replica ids in ranks, most preferred first (Ray Serve's ``choose_replicas`` contract: the
    shortest queue of a rank wins, the next rank is tried when every replica of a rank is full
    or does not answer).

    ``queue_lens``: each candidate replica's queue length (requests in flight), None where the
    router has no recent figure (a replica just started or restarted, or idle a while);
    ``owner``: the replica the request's key went to last, or None. The owner alone first while
    its queue is at most ``imbalance`` longer than the shortest known one; then the replicas
    without a figure (Ray asks them their queue: a new replica gets its share at once), then
    the others."""
    known = {r: n for r, n in queue_lens.items() if n is not None}
    shortest = min(known.values(), default=0)
    first: list[list[str]] = []
    if owner in queue_lens and (known.get(owner) is None or known[owner] - shortest <= imbalance):
        first = [[owner]]
    rest = [r for r in queue_lens if r != (owner if first else None)]
    ranks = [*first, [r for r in rest if r not in known], [r for r in rest if r in known]]
    return [rank for rank in ranks if rank]


class AffinityTable:
    """Which replica each prefix key went to last: at most ``size`` keys, the least recently
    routed forgotten first. Not thread-safe: one router's event loop owns it."""

    def __init__(self, size: int = TABLE_SIZE) -> None:
        if size < 1:
            raise ValueError(f"size={size} must be >= 1 (keys remembered).")
        self.size = size
        self._owners: collections.OrderedDict[str, str] = collections.OrderedDict()

    def owner(self, key: str) -> str | None:
        """The replica ``key`` went to last, or None."""
        return self._owners.get(key)

    def routed(self, key: str, replica: str) -> None:
        """Record that ``key`` went to ``replica`` (now its owner)."""
        self._owners[key] = replica
        self._owners.move_to_end(key)
        while len(self._owners) > self.size:
            self._owners.popitem(last=False)

    def forget(self, replicas: Sequence[str]) -> None:
        """Drop every key owned by ``replicas`` (replicas that died or were removed)."""
        gone = set(replicas)
        for key in [k for k, r in self._owners.items() if r in gone]:
            del self._owners[key]

    def __len__(self) -> int:
        return len(self._owners)
