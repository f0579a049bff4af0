"""The prompt in a completion: OpenAI's ``echo`` (the prompt's text before the completion's and,
with ``logprobs``, the prompt tokens' logprobs first, the first token's null) and vLLM's
``prompt_logprobs`` extra (per prompt token ``{token id: {logprob, rank, decoded_token}}``, the
first null). The logprobs come from the scheduler (``SamplingParams.prompt_logprobs``, on a
runtime compiled with ``enable_prompt_logprobs``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from neuronfx.runtime.pipeline import Logprobs

PromptEntries = Sequence[Logprobs | None]


def echo_logprobs(prompt: Sequence[int], entries: PromptEntries, decode: Callable[[int], str], width: int) -> dict:
    """The legacy completions logprobs object of the prompt tokens (OpenAI's echo): token
    strings, their logprobs (None for the first), the top ``width`` as {token string: logprob}
    (None for the first) and text offsets from 0."""
    tokens = [decode(t) for t in prompt]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    entries = list(entries) or [None] * len(prompt)
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [None if e is None else {decode(i): lp for i, lp in zip(e.top_ids[:width], e.top_logprobs[:width])}
                         for e in entries],
        "text_offset": offsets,
    }


def joined(first: dict, then: dict) -> dict:
    """Two legacy logprobs objects, one after the other (their text offsets already counted from
    the start of the whole text)."""
    return {key: first[key] + then[key] for key in first}


def vllm_prompt_logprobs(entries: PromptEntries, decode: Callable[[int], str]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` of a choice: per prompt token None (the first) or
    ``{str(id): {"logprob", "rank", "decoded_token"}}`` for the token and its top-k (rank: its
    1-based place among the top-k; None for a prompt token outside them)."""
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        top = {str(i): {"logprob": lp, "rank": r + 1, "decoded_token": decode(i)}
               for r, (i, lp) in enumerate(zip(e.top_ids, e.top_logprobs))}
        out.append({str(e.token_id): top.get(str(e.token_id), {"logprob": e.logprob, "rank": None,
                                                                "decoded_token": decode(e.token_id)})} | top)
    return out
