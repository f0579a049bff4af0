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

from neuronfx.config.buckets import select_bucket
from neuronfx.config.inputs import ChunkInputs
from neuronfx.config.kv import chunk_positions
from neuronfx.config.sampling import SamplingParams
from neuronfx.errors import EmptyPromptError, InputError, PromptTooLongError, SlotError
from neuronfx.runtime.batch import call_graph, draws, min_tokens_bias, pad, sampler_inputs
from neuronfx.runtime.runtime import Runtime, check_state
from neuronfx.runtime.state import State, advance
from neuronfx.runtime.steps import (
    StepOutput,
    _outputs,
    check_batch,
    check_params,
    check_rows,
    check_slot_ids,
    check_token_ids,
    count_tokens,
    row_finite,
    row_values,
)

NO_TOKEN = -1
"""``StepOutput.tokens`` of a row whose chunk was not its prompt's last: it produced no token
(an id no vocabulary has, so feeding it to a decode step fails loudly)."""


def _chunks(value: object) -> tuple[tuple[int, ...], ...]:
    rows = row_values("chunks")(value)
    for b, row in enumerate(rows):
        if not isinstance(row, (list, tuple)):
            raise InputError(f"chunk of row {b} is {type(row).__name__}; each chunk is a list of token ids.")
    return tuple(tuple(r) for r in rows)


def _optional_rows(value: object) -> tuple | None:
    return None if value is None else row_values("prompt_lens")(value)


@attrs.frozen(kw_only=True)
class ChunkBatch:
    """The next prompt chunk of each row; row b writes ``chunks[b]`` into slot ``seq_ids[b]``
    at positions [cache_len, cache_len + len) (a free slot starts at 0).

    ``final[b]``: the chunk ends the row's prompt (its sampled token is the request's first).
    ``prompt_lens[b]`` (optional): the row's whole prompt length, which a model with a
    length-dependent RoPE (dynamic, longrope) needs on every chunk to rotate as an unchunked
    prefill would; None: each row's cache_len + len(chunk) (exact for every other model).
    """

    seq_ids: tuple[int, ...] = attrs.field(converter=row_values("seq_ids"))  # [n] free slots or live ones still prefilling
    chunks: tuple[tuple[int, ...], ...] = attrs.field(converter=_chunks)  # [n][len_b] ids, 1 <= len_b <= prefill_chunk_size
    sampling: tuple[SamplingParams, ...] = attrs.field(converter=row_values("sampling"))  # [n]
    final: tuple[bool, ...] = attrs.field(converter=row_values("final"))  # [n] last chunk of the row's prompt
    prompt_lens: tuple[int, ...] | None = attrs.field(default=None, converter=_optional_rows)  # [n] or None


def chunk_starts(state: State, seq_ids: Sequence[int]) -> list[int]:
    """Where each slot's chunk starts: 0 for a free slot, its cache_len for a live one."""
    return [state.cache_lens[s] if state.live[s] else 0 for s in seq_ids]


def check_chunk_batch(runtime: Runtime, state: State, batch: ChunkBatch) -> None:
    """Every check of :func:`chunk_step`, before anything changes; raises what it documents."""
    check_state(runtime, state)
    check_batch(batch, ChunkBatch)
    plan = runtime.plan
    size = plan.inference.prefill_chunk_size
    if size is None:
        raise InputError("this runtime has no chunk graphs; compile it with InferenceConfig(prefill_chunk_size=C).")
    for what, rows in (("chunks", batch.chunks), ("sampling", batch.sampling), ("final", batch.final)):
        check_rows(runtime, batch.seq_ids, rows, f"chunk ({what})")
    if batch.prompt_lens is not None:
        check_rows(runtime, batch.seq_ids, batch.prompt_lens, "chunk (prompt_lens)")
    check_slot_ids(state, batch.seq_ids)
    for s in batch.seq_ids:
        if state.live[s] and state.generated[s]:
            raise SlotError(f"slot {s} is decoding (it generated {state.generated[s]} tokens); a chunk goes to a free slot "
                            "or to a live one whose prompt is still being prefilled (generated 0).")
    limit = plan.inference.max_context_length
    starts = chunk_starts(state, batch.seq_ids)
    for b, (chunk, start, final) in enumerate(zip(batch.chunks, starts, batch.final)):
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
        check_token_ids(chunk, plan.model.vocab_size)
        if batch.prompt_lens is not None:
            _check_prompt_len(b, batch.prompt_lens[b], start + len(chunk), final, limit)
    check_params(runtime, batch.sampling)


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
    plan = runtime.plan
    size, vocab = plan.inference.prefill_chunk_size, plan.model.vocab_size
    slots, n = list(batch.seq_ids), len(batch.seq_ids)
    starts = chunk_starts(state, slots)
    lens = [len(c) for c in batch.chunks]
    ends = [s + k for s, k in zip(starts, lens)]
    bsz = select_bucket(plan.batch_buckets, n, "batch rows")
    bucket = select_bucket(plan.chunk_buckets, max(ends), "attended KV length")

    ids = torch.zeros(bsz, size, dtype=torch.int32)
    for b, chunk in enumerate(batch.chunks):
        ids[b, : len(chunk)] = torch.tensor(chunk, dtype=torch.int32)
    chunk_lens = torch.tensor(pad(lens, bsz, 1), dtype=torch.int32)
    positions = chunk_positions(torch.tensor(pad(starts, bsz, 0), dtype=torch.int32), chunk_lens, size)
    seq_ids = torch.tensor(pad(slots, bsz, plan.kv.scratch_slot), dtype=torch.int32)
    seq_lens = torch.tensor(pad(ends if batch.prompt_lens is None else batch.prompt_lens, bsz, 1), dtype=torch.int32)
    prompt_mask = torch.zeros(bsz, vocab, dtype=torch.bool)
    for b, (s, chunk) in enumerate(zip(slots, batch.chunks)):
        if state.live[s]:  # a prompt being continued: the tokens of its earlier chunks (or of a reused prefix)
            prompt_mask[b] = state.prompt_mask[s]
        prompt_mask[b, list(chunk)] = True
    rand, next_key = draws(state.rng_key, batch.sampling, [0] * n, bsz)
    bias = min_tokens_bias(runtime, batch.sampling, [0] * n, bsz)
    sampler = sampler_inputs(runtime, batch.sampling, torch.zeros(bsz, vocab, dtype=torch.int32), prompt_mask, bias, rand, bsz)
    inputs = ChunkInputs(input_ids=ids, position_ids=positions, seq_ids=seq_ids, chunk_lens=chunk_lens, seq_lens=seq_lens,
                         sampler=sampler)

    out = call_graph(runtime, state.kv, "chunk", bsz, bucket, inputs)
    sampled, logits, logprobs = _outputs(runtime, out, batch.sampling, sampler)
    tokens = tuple(t if f else NO_TOKEN for t, f in zip(sampled, batch.final))
    new_tokens = tuple((t,) if f else () for t, f in zip(sampled, batch.final))
    logprobs = tuple(lp if f else None for lp, f in zip(logprobs, batch.final))
    cache_lens, generated, live = list(state.cache_lens), list(state.generated), list(state.live)
    for s, end, final in zip(slots, ends, batch.final):
        cache_lens[s], generated[s], live[s] = end, int(final), True
    # The lease is revoked before the shared host tensors change (see prefill_step).
    new = advance(state, cache_lens=tuple(cache_lens), generated=tuple(generated), live=tuple(live), rng_key=next_key)
    new.prompt_mask[slots] = prompt_mask[:n]
    new.output_counts[slots] = 0
    done = [(s, row) for s, row in zip(slots, new_tokens) if row]
    count_tokens(new, [s for s, _ in done], [row for _, row in done])
    return StepOutput(tokens=tokens, new_tokens=new_tokens, logits=logits, logprobs=logprobs, bucket=bucket, batch_size=bsz,
                      finite=row_finite(out, n), num_drafted=(0,) * n), new
