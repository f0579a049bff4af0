"""What a server serves: the runtime, its tokenizer and grammars, and the prompt-size bound its
handlers check before they tokenize."""

from __future__ import annotations

from typing import Any

import attrs

from neuronfx.runtime.runtime import Runtime
from neuronfx.runtime.structured import Grammars


@attrs.frozen(kw_only=True, eq=False)
class Served:
    """What the engine serves: a runtime, its tokenizer (transformers) and the grammars of its
    structured outputs (llguidance over that tokenizer, by default: handlers check a request's
    constraint with them, the scheduler's queue makes its matchers with them; one cache), and
    ``max_prompt_chars`` (:func:`prompt_char_limit`, by default)."""

    runtime: Runtime
    tokenizer: Any
    grammars: Grammars = attrs.field(default=attrs.Factory(lambda s: Grammars.for_runtime(s.runtime, s.tokenizer), takes_self=True))
    max_prompt_chars: int = attrs.field(default=attrs.Factory(
        lambda s: prompt_char_limit(s.tokenizer, s.runtime.plan.inference.max_context_length), takes_self=True))


NORMALIZER_SLACK = 4
"""How many more characters than its vocabulary entry one token may stand for in the text a
normalizer saw (Unicode composition joins characters): a margin on :func:`prompt_char_limit`."""


def prompt_char_limit(tokenizer: Any, max_context_length: int) -> int:
    """The most characters a prompt of ``max_context_length`` tokens can have: no token stands
    for more characters than its longest vocabulary entry (a byte-level entry has one character
    per byte), times :data:`NORMALIZER_SLACK`. A longer text cannot fit, so handlers refuse it
    before tokenizing it (a 12 MB prompt took 4.6 s to tokenize, on the event loop every request
    shares)."""
    longest = max((len(entry) for entry in tokenizer.get_vocab()), default=1)
    return NORMALIZER_SLACK * max(longest, 1) * max_context_length
