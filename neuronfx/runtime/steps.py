"""Step functions a scheduler drives: prefill new requests into slots, decode live slots, refill
(recompute) live slots, release (``chunk_step`` is in ``chunked.py``, ``speculate_step`` in
``speculate.py``).

Each public step checks its whole batch first (``checks.py``; raising a named error before
anything changes), then runs its pipeline (``pipeline.py``): :func:`prefill`, :func:`decode`,
:func:`refill`, which trust their batch (the scheduler calls them directly: its requests were
checked at submit). Each returns (StepOutput, new State); the input state is consumed. With a
draft runtime the draft's cache follows (``speculate.follow_draft``).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from neuronfx.config.plan import has_greedy_graphs
from neuronfx.config.sampling import SamplingParams
from neuronfx.errors import InputError, PromptTooLongError, SlotError
from neuronfx.runtime.acceptance import raw_argmax
from neuronfx.runtime.batch import draws
from neuronfx.runtime.blocks import release as release_blocks
from neuronfx.runtime.checks import (
    check_batch,
    check_decode,
    check_kv_blocks,
    check_params,
    check_prompts,
    check_room,
    check_rows,
    check_slots,
    row_values,
    token_rows,
)
from neuronfx.runtime.pipeline import StepOutput, plan_rows, row_sampler, run_rows, token_step
from neuronfx.runtime.prompt_logprobs import step_prompt_logprobs
from neuronfx.runtime.runtime import Runtime, check_state
from neuronfx.runtime.speculate import follow_draft
from neuronfx.runtime.state import State, advance
from neuronfx.runtime.structured import Constraints, check_constraints, constraint_rows


@attrs.frozen(kw_only=True)
class PrefillBatch:
    """New requests to prefill; row b goes to slot ``seq_ids[b]``.

    ``constraints`` (structured outputs): None, or per row a
    :class:`~neuronfx.runtime.structured.Matcher` (or None) whose mask the row's token obeys. The
    step only reads a matcher; the caller consumes the token it produced (``matcher.consume``)
    before the row's next step (the scheduler and ``generate`` do)."""

    seq_ids: tuple[int, ...] = attrs.field(converter=row_values("seq_ids"))  # [n] free slots, distinct
    prompts: tuple[tuple[int, ...], ...] = attrs.field(converter=token_rows("prompts", "prompt"))  # [n][len_b] ids
    sampling: tuple[SamplingParams, ...] = attrs.field(converter=row_values("sampling"))  # [n]
    constraints: Constraints = attrs.field(default=None, converter=constraint_rows)  # [n] Matcher or None, or None


@attrs.frozen(kw_only=True)
class DecodeBatch:
    """One token for each of the live slots ``seq_ids``. ``constraints``: as
    :class:`PrefillBatch`'s (read by the step; the caller consumes the new tokens)."""

    seq_ids: tuple[int, ...] = attrs.field(converter=row_values("seq_ids"))  # [n] live slots, distinct
    input_ids: tuple[int, ...] = attrs.field(converter=row_values("input_ids"))  # [n] last token of each row
    sampling: tuple[SamplingParams, ...] = attrs.field(converter=row_values("sampling"))  # [n]
    constraints: Constraints = attrs.field(default=None, converter=constraint_rows)  # [n] Matcher or None, or None


# --- checks: once, where a batch enters ---------------------------------------------------------


def check_prefill_batch(runtime: Runtime, state: State, batch: PrefillBatch, what: str, live: bool) -> None:
    """Every check of a prefill (``live=False``: free slots) or refill (``live=True``) batch,
    before anything changes; raises what :func:`prefill_step` documents."""
    check_state(runtime, state)
    check_batch(batch, PrefillBatch)
    check_rows(runtime, batch.seq_ids, batch.prompts, what)
    check_rows(runtime, batch.seq_ids, batch.sampling, what)
    check_slots(state, batch.seq_ids, live=live)
    check_prompts(runtime, batch.prompts)
    limit = runtime.plan.prefill_buckets[-1]
    for b, prompt in enumerate(batch.prompts):
        if len(prompt) > limit:  # only with prefill_chunk_size: otherwise the ladder ends at max_context_length
            raise PromptTooLongError(
                f"prompt of row {b} has {len(prompt)} tokens > the largest prefill bucket {limit} (prefill_chunk_size); "
                "prefill it in chunks with neuronfx.chunk_step (generate and the scheduler do)."
            )
    check_params(runtime, batch.sampling)
    check_constraints(batch.constraints, batch.sampling)


def check_refill_rows(state: State, batch: PrefillBatch) -> None:
    """Raise InputError when a refill row's sequence is not its slot's cache_len + 1 tokens."""
    for s, row in zip(batch.seq_ids, batch.prompts):
        if len(row) != state.cache_lens[s] + 1:
            raise InputError(f"refill of slot {s}: {len(row)} tokens given, the slot holds {state.cache_lens[s]}; "
                             "give its whole sequence (prompt, generated tokens and the new token).")


# --- the pipelines: T tokens per row, then the phase's commit -----------------------------------


def _prefill(runtime: Runtime, state: State, batch: PrefillBatch) -> tuple[StepOutput, State]:
    """Prefill of the target alone: T = the prompt bucket from position 0; the rows start their
    requests (prompt masks, zero counts) holding their prompts."""
    prompts, plan = batch.prompts, runtime.plan
    rows = plan_rows(runtime, "prefill", plan.prefill_buckets, batch.seq_ids, prompts, (0,) * len(prompts))
    mask = torch.zeros(rows.bsz, plan.model.vocab_size, dtype=torch.bool)
    for b, prompt in enumerate(prompts):
        mask[b, list(prompt)] = True
    sampler, key = row_sampler(runtime, state, rows, batch.sampling, (0,) * len(prompts), fresh_mask=mask,
                               constraints=batch.constraints)
    out = run_rows(runtime, state, rows, sampler)
    scored = step_prompt_logprobs(out, prompts, rows.starts, batch.sampling)
    return token_step(runtime, state, rows, batch.sampling, out, sampler, key, [len(p) for p in prompts], fresh_mask=mask,
                      prompt_logprobs=scored)


def decode_phase(runtime: Runtime, state: State, batch: DecodeBatch) -> str:
    """The phase of a decode step's graph: "greedy" (``InferenceConfig.greedy_graphs``) where
    the plan has those graphs and every row takes the argmax of its raw logits
    (``acceptance.raw_argmax``) with no logprobs and no grammar, else "decode". The step's draws
    are taken either way (a greedy step builds no other sampler input), so the state's RNG key
    and every later step are the same whichever graph ran."""
    if not has_greedy_graphs(runtime.plan.inference):
        return "decode"
    if batch.constraints is not None and any(m is not None for m in batch.constraints):
        return "decode"
    plain = all(raw_argmax(sp, state.generated[s]) and sp.logprobs is None for sp, s in zip(batch.sampling, batch.seq_ids))
    return "greedy" if plain else "decode"


def decode_target(runtime: Runtime, state: State, batch: DecodeBatch) -> tuple[StepOutput, State]:
    """Decode of the target alone: T = 1 token per row at its slot's cache_len, through the
    decode or greedy graph (:func:`decode_phase`). A greedy graph reads no sampler inputs, so
    none are built for it; its draws are still taken, so the state's RNG key moves as a decode
    step's would."""
    slots = batch.seq_ids
    starts = [state.cache_lens[s] for s in slots]
    generated = [state.generated[s] for s in slots]
    rows = plan_rows(runtime, decode_phase(runtime, state, batch), runtime.plan.decode_buckets, slots,
                     [(t,) for t in batch.input_ids], starts, width=1)
    if rows.phase == "greedy":
        sampler, key = None, draws(state.rng_key, batch.sampling, generated, rows.bsz)[1]
    else:
        sampler, key = row_sampler(runtime, state, rows, batch.sampling, generated, constraints=batch.constraints)
    out = run_rows(runtime, state, rows, sampler)
    return token_step(runtime, state, rows, batch.sampling, out, sampler, key, [p + 1 for p in starts])


def _refill(runtime: Runtime, state: State, batch: PrefillBatch) -> tuple[StepOutput, State]:
    """Refill of the target alone: the prefill graph over each live slot's whole sequence, sampled
    with the slot's request state (counts, prompt mask, generated), as a decode step would."""
    slots, seqs = batch.seq_ids, batch.prompts
    rows = plan_rows(runtime, "prefill", runtime.plan.prefill_buckets, slots, seqs, (0,) * len(seqs))
    sampler, key = row_sampler(runtime, state, rows, batch.sampling, [state.generated[s] for s in slots],
                               constraints=batch.constraints)
    out = run_rows(runtime, state, rows, sampler)
    return token_step(runtime, state, rows, batch.sampling, out, sampler, key, [len(q) for q in seqs])


def prefill(runtime: Runtime, state: State, batch: PrefillBatch) -> tuple[StepOutput, State]:
    """:func:`prefill_step` without its checks (``batch`` must be valid for ``state``)."""
    return follow_draft(_prefill, runtime, state, batch)


def decode(runtime: Runtime, state: State, batch: DecodeBatch) -> tuple[StepOutput, State]:
    """:func:`decode_step` without its checks (``batch`` must be valid for ``state``)."""
    return follow_draft(decode_target, runtime, state, batch)


def refill(runtime: Runtime, state: State, batch: PrefillBatch) -> tuple[StepOutput, State]:
    """:func:`refill_step` without its checks (``batch`` must be valid for ``state``)."""
    return follow_draft(_refill, runtime, state, batch)


# --- the public steps ---------------------------------------------------------------------------


def prefill_step(runtime: Runtime, state: State, batch: PrefillBatch) -> tuple[StepOutput, State]:
    """Prefill ``batch.prompts`` into free slots ``batch.seq_ids``; returns each row's first token.

    Runs the (prefill, batch bucket >= n rows, prompt bucket >= longest prompt) graph; a row
    whose logits were NaN/inf has ``finite[r] == False``. With a draft runtime the draft's slots
    are prefilled too. Raises (before any change) InputError (not a PrefillBatch, empty batch,
    row counts differ, non-int ids), BatchTooLargeError, SlotError (slot out of range, duplicate
    or live), EmptyPromptError, PromptTooLongError (> max_context_length), TokenOutOfVocabError,
    SamplingParamsError, StateConsumedError / StateMismatchError.
    """
    check_prefill_batch(runtime, state, batch, "prefill", live=False)
    check_kv_blocks(runtime, state, batch.seq_ids, [0] * len(batch.prompts), [len(p) for p in batch.prompts])
    return prefill(runtime, state, batch)


def decode_step(runtime: Runtime, state: State, batch: DecodeBatch) -> tuple[StepOutput, State]:
    """Decode one token for each live slot in ``batch.seq_ids``, feeding ``batch.input_ids``.

    Runs the (decode, batch bucket >= n rows, KV bucket >= longest cache_len + 1) graph (its
    greedy twin when every row is plain greedy: ``decode_phase``); padding
    rows write only the scratch slot; a row whose logits were NaN/inf (e.g. a poisoned cache) has
    ``finite[r] == False`` and no other row is affected. With a draft runtime the draft decodes
    the same tokens (its cache follows the target's). Raises (before any change) InputError
    (not a DecodeBatch, empty batch, row counts differ, non-int ids), BatchTooLargeError, SlotError
    (out of range, duplicate or free), TokenOutOfVocabError, SequenceLengthExceededError (slot
    already holds sequence_length tokens), KVCacheFullError (the blocks layout: fewer free KV
    blocks than the rows' writes need), SamplingParamsError, StateConsumedError /
    StateMismatchError.
    """
    check_decode(runtime, state, batch, DecodeBatch)
    check_room(state, batch.seq_ids, 1, runtime.plan.inference.sequence_length,
               "release it or compile with a larger sequence_length.")
    if runtime.draft is not None:
        # Two caches: the draft's blocks are reserved after the target's have changed. Alone,
        # ``blocks.reserve`` checks the free blocks before the step changes anything, and a
        # second count of them is a handful of numpy ops, each run cold right after a graph.
        starts = [state.cache_lens[s] for s in batch.seq_ids]
        check_kv_blocks(runtime, state, batch.seq_ids, starts, [n + 1 for n in starts])
    return decode(runtime, state, batch)


def refill_step(runtime: Runtime, state: State, batch: PrefillBatch) -> tuple[StepOutput, State]:
    """Recompute live slots ``batch.seq_ids`` from scratch and decode one token each:
    ``batch.prompts[b]`` is row b's whole sequence so far (prompt and generated tokens, the
    last one the token a decode step would feed), run through the prefill graph, which rewrites
    the slot's K/V at every position; the slot keeps its request (generated count, output
    counts and prompt mask, as a decode step would see them).

    What it is for: longrope switches to its long factors once a row's sequence is longer than
    ``original_max_position_embeddings``, and transformers' Phi-3 ``generate`` then recomputes the
    whole cache with them (``Phi3ForCausalLM.prepare_inputs_for_generation`` drops the cache);
    the scheduler calls this at that token (``rope_switch_refill``), so greedy tokens match it.
    Raises what :func:`prefill_step` raises for its rows (the slots must be live) and InputError
    when a row's sequence is not its slot's cache_len + 1 tokens.
    """
    check_prefill_batch(runtime, state, batch, "refill", live=True)
    check_refill_rows(state, batch)
    check_kv_blocks(runtime, state, batch.seq_ids, [0] * len(batch.prompts), [len(p) for p in batch.prompts])
    return refill(runtime, state, batch)


def release(runtime: Runtime, state: State, seq_ids: Sequence[int]) -> State:
    """Free live slots ``seq_ids`` (their KV content becomes unreachable; with a draft runtime,
    the draft's too). Raises SlotError for ``seq_ids`` that is not a list, or a slot that is out
    of range, duplicated or already free."""
    check_state(runtime, state)
    if not isinstance(seq_ids, (list, tuple)):
        raise SlotError(f"seq_ids={seq_ids!r} must be a list of slot indices, e.g. [{seq_ids!r}].")
    check_slots(state, seq_ids, live=True)
    return free(runtime, state, seq_ids)


def free(runtime: Runtime, state: State, seq_ids: Sequence[int]) -> State:
    """:func:`release` without its checks (``seq_ids`` must be live slots of ``state``)."""
    draft = free(runtime.draft, state.draft, seq_ids) if runtime.draft is not None else None
    release_blocks(runtime.plan, state.blocks, seq_ids)
    cache_lens, generated, live = list(state.cache_lens), list(state.generated), list(state.live)
    for s in seq_ids:
        cache_lens[s], generated[s], live[s] = 0, 0, False
    return advance(state, cache_lens=tuple(cache_lens), generated=tuple(generated), live=tuple(live), rng_key=state.rng_key,
                   draft=draft)
