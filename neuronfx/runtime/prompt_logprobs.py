"""Prompt logprobs on the host: a prefill or chunk graph of a plan with
``enable_prompt_logprobs`` returns, per row and position t of the step, the raw logprob of the
step's token t + 1 and the top ``logprobs_width`` alternatives
(``graphs/phases/prompt_logprobs.py``); :func:`step_prompt_logprobs` turns them into one
:class:`~neuronfx.runtime.pipeline.Logprobs` per prompt token the step scored.

A row's entries follow its prompt tokens: a row starting at position 0 begins with None (the
first prompt token has no logprob, as in vLLM and OpenAI's ``echo``), then one entry per later
token of the step. A chunk that is not its prompt's last also scores the prompt's next token
(the next chunk's first) when the caller names it (``ChunkBatch.next_tokens``), from the
log_softmax row the chunk graph returns at its last position; the entries of a prompt's steps,
concatenated, are then one per prompt token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from neuronfx.config.sampling import SamplingParams
from neuronfx.runtime.pipeline import Logprobs

Tensor = torch.Tensor

PromptLogprobs = tuple[Logprobs | None, ...]
"""One request's prompt logprobs: per prompt token, None for the first."""


def step_prompt_logprobs(out: dict[str, Tensor], tokens: Sequence[Sequence[int]], starts: Sequence[int],
                         params: Sequence[SamplingParams], next_tokens: Sequence[int | None] | None = None,
                         ) -> tuple[PromptLogprobs | None, ...]:
    """Per row of the step (``tokens[b]`` written from position ``starts[b]``), the prompt
    logprobs it scored (see the module), or None where the row's SamplingParams did not ask
    (``prompt_logprobs`` None) or the graph returned none. ``next_tokens[b]``: the prompt token
    after row b's chunk, None at the prompt's end."""
    if "prompt_logprobs" not in out:
        return (None,) * len(params)
    rows: list[PromptLogprobs | None] = []
    for r, sp in enumerate(params):
        if sp.prompt_logprobs is None:
            rows.append(None)
            continue
        entries = _row_entries(out, r, tokens[r], sp.prompt_logprobs)
        after = None if next_tokens is None else next_tokens[r]
        if after is not None:
            entries.append(_from_row(out["prompt_last_logprobs"][r], after, sp.prompt_logprobs))
        rows.append(((None,) if starts[r] == 0 else ()) + tuple(entries))
    return tuple(rows)


def _row_entries(out: dict[str, Tensor], r: int, tokens: Sequence[int], k: int) -> list[Logprobs | None]:
    """Row ``r``'s Logprobs of its tokens 1 .. len - 1, read at positions 0 .. len - 2."""
    n = len(tokens) - 1
    picked = out["prompt_logprobs"][r, :n].tolist()
    top_ids = out["prompt_top_ids"][r, :n, :k].tolist()
    top_vals = out["prompt_top_logprobs"][r, :n, :k].tolist()
    return [Logprobs(token_id=tokens[t + 1], logprob=picked[t], top_ids=tuple(top_ids[t]), top_logprobs=tuple(top_vals[t]))
            for t in range(n)]


def _from_row(row: Tensor, token: int, k: int) -> Logprobs:
    """The Logprobs of ``token`` (top ``k``) from a whole log_softmax row (V,) float32."""
    vals, ids = torch.topk(row, k)
    return Logprobs(token_id=token, logprob=float(row[token]), top_ids=tuple(ids.tolist()), top_logprobs=tuple(vals.tolist()))
