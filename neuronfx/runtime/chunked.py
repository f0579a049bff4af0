"""Chunked prefill: ``chunk_step`` writes the next piece of each row's prompt into its slot from
the slot's cache_len (prefill at an offset), through the plan's "chunk" graphs
(``InferenceConfig.prefill_chunk_size``).

A row's slot is either FREE (its prompt starts at position 0 and the slot becomes live) or LIVE
with ``generated == 0``: a prompt still being prefilled, continued at its cache_len, whatever
filled [0, cache_len) (earlier chunks, or KV copied in by a prefix cache). The row's last chunk
(``final``) samples the request's first token, as :func:`neuronfx.prefill_step` does; earlier
chunks produce no token. vLLM v1 does the same with one mechanism for every request
("num_computed_tokens"): ``vllm/v1/core/sched/scheduler.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from neuronfx.config.sampling import SamplingParams
from neuronfx.errors import EmptyPromptError, InputError, PromptTooLongError, SlotError
from neuronfx.runtime.checks import (
    check_batch,
    check_kv_blocks,
    check_params,
    check_rows,
    check_slot_ids,
    check_token_ids,
    row_values,
    token_rows,
)
from neuronfx.runtime.pipeline import StepOutput, plan_rows, row_sampler, run_rows, token_step
from neuronfx.runtime.prompt_logprobs import step_prompt_logprobs
from neuronfx.runtime.runtime import Runtime, check_state
from neuronfx.runtime.state import State
from neuronfx.runtime.structured import Constraints, check_constraints, constraint_rows


def _optional_rows(value: object) -> tuple | None:
    return None if value is None else row_values("prompt_lens")(value)


def _optional_next(value: object) -> tuple | None:
    return None if value is None else row_values("next_tokens")(value)


@attrs.frozen(kw_only=True)
class ChunkBatch:
    """The next prompt chunk of each row; row b writes ``chunks[b]`` into slot ``seq_ids[b]``
    at positions [cache_len, cache_len + len) (a free slot starts at 0).

    ``final[b]``: the chunk ends the row's prompt (its sampled token is the request's first).
    ``prompt_lens[b]`` (optional): the row's whole prompt length, which a model with a
    length-dependent RoPE (dynamic, longrope) needs on every chunk to rotate as an unchunked
    prefill would; None: each row's cache_len + len(chunk) (exact for every other model).
    ``constraints`` (structured outputs): as ``PrefillBatch``'s; a final row's token obeys its
    matcher's mask (read by the step; the caller consumes the token).
    ``next_tokens[b]`` (optional): the prompt token after a non-final chunk (None on a final
    one), which a row asking ``SamplingParams.prompt_logprobs`` needs scored by this chunk
    (``runtime/prompt_logprobs.py``); without it such a row's entries stop at its chunk's end.
    """

    seq_ids: tuple[int, ...] = attrs.field(converter=row_values("seq_ids"))  # [n] free slots or live ones still prefilling
    chunks: tuple[tuple[int, ...], ...] = attrs.field(converter=token_rows("chunks", "chunk"))  # [n][len_b] ids, 1 <= len_b <= prefill_chunk_size
    sampling: tuple[SamplingParams, ...] = attrs.field(converter=row_values("sampling"))  # [n]
    final: tuple[bool, ...] = attrs.field(converter=row_values("final"))  # [n] last chunk of the row's prompt
    prompt_lens: tuple[int, ...] | None = attrs.field(default=None, converter=_optional_rows)  # [n] or None
    constraints: Constraints = attrs.field(default=None, converter=constraint_rows)  # [n] Matcher or None, or None
    next_tokens: tuple[int | None, ...] | None = attrs.field(default=None, converter=_optional_next)  # [n] or None


def chunk_starts(state: State, seq_ids: Sequence[int]) -> list[int]:
    """Where each slot's chunk starts: 0 for a free slot, its cache_len for a live one."""
    return [state.cache_lens[s] if state.live[s] else 0 for s in seq_ids]


def check_chunk_batch(runtime: Runtime, state: State, batch: ChunkBatch) -> None:
    """Every check of :func:`chunk_step`, before anything changes; raises what it documents."""
    check_state(runtime, state)
    check_batch(batch, ChunkBatch)
    size = runtime.plan.inference.prefill_chunk_size
    if size is None:
        raise InputError("this runtime has no chunk graphs; compile it with InferenceConfig(prefill_chunk_size=C).")
    for what, rows in (("chunks", batch.chunks), ("sampling", batch.sampling), ("final", batch.final)):
        check_rows(runtime, batch.seq_ids, rows, f"chunk ({what})")
    for what, extra in (("prompt_lens", batch.prompt_lens), ("next_tokens", batch.next_tokens)):
        if extra is not None:
            check_rows(runtime, batch.seq_ids, extra, f"chunk ({what})")
    check_slot_ids(state, batch.seq_ids)
    for s in batch.seq_ids:
        if state.live[s] and state.generated[s]:
            raise SlotError(f"slot {s} is decoding (it generated {state.generated[s]} tokens); a chunk goes to a free slot "
                            "or to a live one whose prompt is still being prefilled (generated 0).")
    starts = chunk_starts(state, batch.seq_ids)
    for b, start in enumerate(starts):
        _check_chunk(runtime, b, batch, start)
    check_kv_blocks(runtime, state, batch.seq_ids, starts, [s + len(c) for s, c in zip(starts, batch.chunks)])
    check_params(runtime, batch.sampling)
    check_constraints(batch.constraints, batch.sampling)


def _check_chunk(runtime: Runtime, b: int, batch: ChunkBatch, start: int) -> None:
    """Row ``b``'s chunk, final flag and prompt length, for a slot holding ``start`` tokens."""
    chunk, final = batch.chunks[b], batch.final[b]
    size, limit = runtime.plan.inference.prefill_chunk_size, runtime.plan.inference.max_context_length
    if not isinstance(final, bool):
        raise InputError(f"final[{b}]={final!r} must be True or False.")
    if not chunk:
        raise EmptyPromptError(f"chunk of row {b} is empty; every chunk needs at least one token.")
    if len(chunk) > size:
        raise PromptTooLongError(f"chunk of row {b} has {len(chunk)} tokens > prefill_chunk_size={size}; split it.")
    if start + len(chunk) > limit:
        raise PromptTooLongError(
            f"row {b}: slot {batch.seq_ids[b]} holds {start} prompt tokens + a chunk of {len(chunk)} > max_context_length="
            f"{limit}; shorten the prompt or compile with a larger max_context_length."
        )
    check_token_ids(chunk, runtime.plan.model.vocab_size)
    after = None if batch.next_tokens is None else batch.next_tokens[b]
    if after is not None and final:
        raise InputError(f"next_tokens[{b}]={after!r} follows a final chunk; a prompt's last chunk has no next token (None).")
    if after is not None:
        check_token_ids([after], runtime.plan.model.vocab_size)
    if batch.prompt_lens is not None:
        _check_prompt_len(b, batch.prompt_lens[b], start + len(chunk), final, limit)


def _check_prompt_len(b: int, prompt_len: object, end: int, final: bool, limit: int) -> None:
    """InputError unless ``prompt_len`` is an int that the prompt's tokens so far (``end``)
    reach (equal on the final chunk) and max_context_length (``limit``) holds."""
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or not end <= prompt_len <= limit or (final and prompt_len != end):
        raise InputError(
            f"prompt_lens[{b}]={prompt_len!r} must be the row's whole prompt length: >= {end} (its tokens after this chunk), "
            f"== {end} on its final chunk, <= max_context_length={limit}."
        )


def chunk_step(runtime: Runtime, state: State, batch: ChunkBatch) -> tuple[StepOutput, State]:
    """Prefill the next chunk of each row's prompt at its slot's cache_len.

    Runs the (chunk, batch bucket >= n rows, attended bucket >= longest cache_len + chunk) graph
    (T = ``prefill_chunk_size`` tokens per row, right-padded; pads write only the scratch slot).
    Each slot becomes (or stays) live with cache_len + len(chunk) tokens; its prompt mask
    (repetition penalty) gains the chunk's tokens (a free slot's is reset first). A ``final``
    row's sampled token is the request's first (generated becomes 1, its output counts start);
    other rows produce none: ``new_tokens[r] == ()``, ``tokens[r] == NO_TOKEN``, no logprobs.
    ``logits`` (with ``output_logits``) are at each row's last real token, final or not.

    Raises (before any change) InputError (not a ChunkBatch, no chunk graphs, empty batch, row
    counts differ, non-int ids, a ``final`` that is not a bool, bad ``prompt_lens``),
    BatchTooLargeError, SlotError (out of range, duplicate, or a live slot already decoding),
    EmptyPromptError, PromptTooLongError (chunk > prefill_chunk_size, or the prompt so far >
    max_context_length), TokenOutOfVocabError, SamplingParamsError, StateConsumedError /
    StateMismatchError.
    """
    check_chunk_batch(runtime, state, batch)
    return chunk(runtime, state, batch)


def chunk(runtime: Runtime, state: State, batch: ChunkBatch) -> tuple[StepOutput, State]:
    """:func:`chunk_step` without its checks (``batch`` must be valid for ``state``): T =
    ``prefill_chunk_size`` tokens per row from each slot's cache_len; the rows (re)start their
    requests, holding their prompts so far (a continued prompt keeps its earlier tokens' mask)."""
    plan, slots = runtime.plan, batch.seq_ids
    starts = chunk_starts(state, slots)
    rows = plan_rows(runtime, "chunk", plan.chunk_buckets, slots, batch.chunks, starts, width=plan.inference.prefill_chunk_size,
                     seq_lens=batch.prompt_lens)
    mask = torch.zeros(rows.bsz, plan.model.vocab_size, dtype=torch.bool)
    for b, (s, tokens) in enumerate(zip(slots, batch.chunks)):
        if state.live[s]:  # a prompt being continued: the tokens of its earlier chunks (or of a reused prefix)
            mask[b] = state.prompt_mask[s]
        mask[b, list(tokens)] = True
    sampler, key = row_sampler(runtime, state, rows, batch.sampling, (0,) * len(slots), fresh_mask=mask,
                               constraints=batch.constraints)
    out = run_rows(runtime, state, rows, sampler)
    ends = [p + len(c) for p, c in zip(starts, batch.chunks)]
    scored = step_prompt_logprobs(out, batch.chunks, starts, batch.sampling, batch.next_tokens)
    return token_step(runtime, state, rows, batch.sampling, out, sampler, key, ends, fresh_mask=mask, keep=batch.final,
                      prompt_logprobs=scored)
