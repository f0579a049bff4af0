"""What the step API checks where a batch enters it: one function per rule, each raising its
named error (naming the value, the limit and the fix) before anything changes.

Checked once: the public step functions (``prefill_step``, ``decode_step``, ``chunk_step``,
``speculate_step``, ``release``) call these and then run the step's pipeline, which trusts its
input; the scheduler's ``submit`` and the server's handler check a request once
(``scheduler.check_request``) and the scheduler then calls the pipelines directly. The graph's
input tensors are checked at the graph boundary (``batch.call_graph``), once per call. One rule
is left to the pipeline: free KV blocks of a decode step without a draft model, which
``blocks.reserve`` checks before it changes anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from neuronfx.config.sampling import SamplingParams, check_sampling
from neuronfx.errors import (
    BatchTooLargeError,
    EmptyPromptError,
    InputError,
    PromptTooLongError,
    SequenceLengthExceededError,
    SlotError,
    TokenOutOfVocabError,
)
from neuronfx.runtime.blocks import check_blocks
from neuronfx.runtime.runtime import Runtime, check_state
from neuronfx.runtime.state import State
from neuronfx.runtime.structured import check_constraints


def row_values(field: str) -> Callable[[object], tuple]:
    """attrs converter: an iterable of per-row values (list, tuple, range, 1-D tensor) -> tuple;
    raises InputError naming ``field`` for anything else (an int, a str, None, a 0-d tensor)."""

    def convert(value: object) -> tuple:
        if isinstance(value, torch.Tensor) and value.dim() == 1:
            value = value.tolist()
        if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Iterable):
            raise InputError(f"{field}={value!r:.60} must be a list with one entry per row, e.g. [{value!r:.20}].")
        return tuple(value)

    return convert


def token_rows(field: str, what: str) -> Callable[[object], tuple[tuple[int, ...], ...]]:
    """attrs converter: per-row lists of token ids (``field``: "prompts", "chunks") -> a tuple of
    tuples; raises InputError naming the row whose ``what`` ("prompt", "chunk") is not a list."""

    def convert(value: object) -> tuple[tuple[int, ...], ...]:
        rows = row_values(field)(value)
        for b, row in enumerate(rows):
            if not isinstance(row, (list, tuple)):
                raise InputError(f"{what} of row {b} is {type(row).__name__}; each {what} is a list of token ids.")
        return tuple(tuple(r) for r in rows)

    return convert


def check_batch(batch: object, kind: type) -> None:
    """Raise InputError unless ``batch`` is a ``kind`` (PrefillBatch, DecodeBatch, ...)."""
    if not isinstance(batch, kind):
        raise InputError(f"batch is a {type(batch).__name__}; this step takes a neuronfx.{kind.__name__}.")


def check_rows(runtime: Runtime, seq_ids: Sequence[int], other: Sequence[object], what: str) -> None:
    """Raise InputError for an empty batch or per-row inputs whose count differs from the rows',
    BatchTooLargeError for more rows than ``batch_size``; ``what`` names the step."""
    limit = runtime.plan.inference.batch_size
    if len(seq_ids) == 0:
        raise InputError(f"{what} batch is empty; give at least one row.")
    if len(seq_ids) > limit:
        raise BatchTooLargeError(
            f"{what} batch has {len(seq_ids)} rows > batch_size={limit}; split it or compile with a larger batch_size."
        )
    if len(other) != len(seq_ids):
        raise InputError(f"{what} batch has {len(seq_ids)} seq_ids but {len(other)} rows of inputs; give one per row.")


def check_slot_ids(state: State, seq_ids: Sequence[int]) -> None:
    """Raise SlotError for a slot that is not an int in [0, batch_size) or a duplicate."""
    n = state.num_slots
    for s in seq_ids:
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < n:
            raise SlotError(f"seq_id {s!r} is not a slot in [0, {n}); use a slot index below batch_size={n}.")
    if len(set(seq_ids)) != len(seq_ids):
        raise SlotError(f"seq_ids {list(seq_ids)} contain duplicates; each row needs its own slot.")


def check_slots(state: State, seq_ids: Sequence[int], live: bool) -> None:
    """Raise SlotError for a slot that is not an int in [0, batch_size), a duplicate, or one whose
    liveness is not ``live`` (a prefill needs free slots, decode and speculate live ones)."""
    check_slot_ids(state, seq_ids)
    for s in seq_ids:
        if state.live[s] != live:
            need = "a live request (prefill it first)" if live else "free (release it first)"
            raise SlotError(f"slot {s} must be {need}; free slots are {list(state.free_slots)}.")


def check_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    """Raise InputError for an id that is not an int (bools and floats included) and
    TokenOutOfVocabError for one outside [0, vocab_size)."""
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise InputError(
                f"token id {t!r} is a {type(t).__name__}; token ids are ints in [0, {vocab_size}): convert them with int()."
            )
        if not 0 <= t < vocab_size:
            raise TokenOutOfVocabError(f"token id {t!r} is outside the vocabulary [0, {vocab_size}); check the tokenizer matches the model.")


def check_prompts(runtime: Runtime, prompts: Sequence[Sequence[int]], start: int = 0) -> None:
    """Raise EmptyPromptError, PromptTooLongError (> max_context_length) or TokenOutOfVocabError
    for the first bad prompt (messages number rows from ``start``)."""
    limit = runtime.plan.inference.max_context_length
    for b, prompt in enumerate(prompts, start):
        if not prompt:
            raise EmptyPromptError(f"prompt of row {b} is empty; every prompt needs at least one token.")
        if len(prompt) > limit:
            raise PromptTooLongError(
                f"prompt of row {b} has {len(prompt)} tokens > max_context_length={limit}; shorten it or compile with a larger max_context_length."
            )
        check_token_ids(prompt, runtime.plan.model.vocab_size)


def check_params(runtime: Runtime, sampling: Sequence[SamplingParams]) -> None:
    """What the plan bounds in each row's SamplingParams (``config.sampling.check_sampling``)."""
    plan = runtime.plan
    for sp in sampling:
        check_sampling(sp, plan.topk_width, plan.logprobs_width, plan.model.vocab_size, plan.inference.enable_prompt_logprobs)


def check_room(state: State, seq_ids: Sequence[int], tokens: int, sequence_length: int, fix: str) -> None:
    """Raise SequenceLengthExceededError when a slot cannot take ``tokens`` more tokens."""
    for s in seq_ids:
        if state.cache_lens[s] + tokens > sequence_length:
            raise SequenceLengthExceededError(
                f"slot {s} holds {state.cache_lens[s]} tokens and this step writes {tokens} more > sequence_length="
                f"{sequence_length}; {fix}"
            )


def check_kv_blocks(runtime: Runtime, state: State, slots: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> None:
    """Raise KVCacheFullError when rows writing positions [starts[b], ends[b]) of ``slots[b]``
    need more free KV blocks than the blocks layout has (the draft runtime's cache too, when it
    has its own); nothing for the slots layout (``blocks.check_blocks``)."""
    check_blocks(runtime.plan, state.blocks, slots, starts, ends)
    if runtime.draft is not None:
        check_blocks(runtime.draft.plan, state.draft.blocks, slots, starts, ends)


def check_decode(runtime: Runtime, state: State, batch: object, kind: type) -> None:
    """Everything :func:`decode_step` (``kind`` DecodeBatch) or ``speculate_step`` (SpeculateBatch)
    checks before anything changes, except room in the cache."""
    check_state(runtime, state)
    check_batch(batch, kind)
    what = kind.__name__.removesuffix("Batch").lower()
    check_rows(runtime, batch.seq_ids, batch.input_ids, what)
    check_rows(runtime, batch.seq_ids, batch.sampling, what)
    check_slots(state, batch.seq_ids, live=True)
    check_token_ids(batch.input_ids, runtime.plan.model.vocab_size)
    check_params(runtime, batch.sampling)
    check_constraints(batch.constraints, batch.sampling)
