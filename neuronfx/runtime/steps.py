"""Step functions a scheduler drives: prefill new requests into slots, decode live slots, release
(``speculate_step`` is in ``runtime/speculate.py``).

Each step validates its whole input first (raising a named error before anything changes),
picks the (phase, batch, bucket) graph from host integers it already has, fills that graph's
step-input record (``config.inputs``) with ``batch.token_inputs`` and ``batch.sampler_inputs``,
runs it, and returns (StepOutput, new State); the input state is consumed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import attrs
import torch

from neuronfx.config.buckets import select_bucket
from neuronfx.config.inputs import DecodeInputs, PrefillInputs, SamplerInputs
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
from neuronfx.graphs.inputs import KVCache
from neuronfx.graphs.sampling import sample
from neuronfx.runtime.batch import call_graph, draws, min_tokens_bias, pad, sampler_inputs, token_inputs
from neuronfx.runtime.runtime import Runtime, check_state
from neuronfx.runtime.state import State, advance

Tensor = torch.Tensor


def _rows(prompts: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    prompts = row_values("prompts")(prompts)
    for b, row in enumerate(prompts):
        if not isinstance(row, (list, tuple)):
            raise InputError(f"prompt of row {b} is {type(row).__name__}; each prompt is a list of token ids.")
    return tuple(tuple(r) for r in prompts)


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


@attrs.frozen(kw_only=True)
class PrefillBatch:
    """New requests to prefill; row b goes to slot ``seq_ids[b]``."""

    seq_ids: tuple[int, ...] = attrs.field(converter=row_values("seq_ids"))  # [n] free slots, distinct
    prompts: tuple[tuple[int, ...], ...] = attrs.field(converter=_rows)  # [n][len_b] ids
    sampling: tuple[SamplingParams, ...] = attrs.field(converter=row_values("sampling"))  # [n]


@attrs.frozen(kw_only=True)
class DecodeBatch:
    """One token for each of the live slots ``seq_ids``."""

    seq_ids: tuple[int, ...] = attrs.field(converter=row_values("seq_ids"))  # [n] live slots, distinct
    input_ids: tuple[int, ...] = attrs.field(converter=row_values("input_ids"))  # [n] last token of each row
    sampling: tuple[SamplingParams, ...] = attrs.field(converter=row_values("sampling"))  # [n]


@attrs.frozen(kw_only=True)
class Logprobs:
    """Raw logprobs (log_softmax of the model's logits, before penalties and temperature: vLLM
    V1's default ``raw_logprobs`` mode) for one sampled token."""

    token_id: int  # the sampled token
    logprob: float  # its raw logprob
    top_ids: tuple[int, ...]  # [N] most likely token ids, descending
    top_logprobs: tuple[float, ...]  # [N] their raw logprobs


@attrs.frozen(kw_only=True, eq=False)
class StepOutput:
    """What one step produced, row-aligned with its batch. Prefill and decode produce one token
    per row; speculate 1 to k."""

    tokens: tuple[int, ...]  # [n] the last token each row produced: the next step's input_ids
    new_tokens: tuple[tuple[int, ...], ...]  # [n][m_b] every token row b produced, in order
    logits: torch.Tensor | None  # [n, vocab] float32 of the last position, when output_logits (prefill, decode)
    logprobs: tuple[tuple[Logprobs, ...] | None, ...]  # [n][m_b], one per new token; None for rows that did not ask
    bucket: int  # tokens: prompt bucket (prefill) or attended KV length (decode, speculate)
    batch_size: int  # rows of the graph that ran (the batch bucket; rows past n were padding)
    finite: tuple[bool, ...]  # [n] False where the row's logits held NaN/inf: its tokens are garbage
    num_drafted: tuple[int, ...]  # [n] draft tokens proposed for the row (speculate: k - 1; else 0)


# --- validation ---------------------------------------------------------------------------------


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


def check_batch(batch: object, kind: type) -> None:
    """Raise InputError unless ``batch`` is a ``kind`` (PrefillBatch, DecodeBatch, SpeculateBatch)."""
    if not isinstance(batch, kind):
        raise InputError(f"batch is a {type(batch).__name__}; this step takes a neuronfx.{kind.__name__}.")


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
        check_sampling(sp, plan.topk_width, plan.logprobs_width, plan.model.vocab_size)


def check_room(state: State, seq_ids: Sequence[int], tokens: int, sequence_length: int, fix: str) -> None:
    """Raise SequenceLengthExceededError when a slot cannot take ``tokens`` more tokens."""
    for s in seq_ids:
        if state.cache_lens[s] + tokens > sequence_length:
            raise SequenceLengthExceededError(
                f"slot {s} holds {state.cache_lens[s]} tokens and this step writes {tokens} more > sequence_length="
                f"{sequence_length}; {fix}"
            )


def check_decode(runtime: Runtime, state: State, batch: object, kind: type) -> None:
    """Everything :func:`decode_step` (``kind`` DecodeBatch) or ``speculate_step`` (SpeculateBatch)
    checks before anything changes, except room in the cache."""
    check_state(runtime, state)
    plan = runtime.plan
    check_batch(batch, kind)
    check_rows(runtime, batch.seq_ids, batch.input_ids, kind.__name__.removesuffix("Batch").lower())
    check_rows(runtime, batch.seq_ids, batch.sampling, kind.__name__.removesuffix("Batch").lower())
    check_slots(state, batch.seq_ids, live=True)
    check_token_ids(batch.input_ids, plan.model.vocab_size)


# --- outputs ------------------------------------------------------------------------------------


def row_logprobs(out: dict[str, Tensor], r: int, token: int, k: int) -> Logprobs:
    """Row ``r``'s Logprobs (top ``k``) from the sampler's logprob outputs."""
    return Logprobs(token_id=token, logprob=float(out["sampled_logprobs"][r]),
                    top_ids=tuple(out["top_ids"][r, :k].tolist()), top_logprobs=tuple(out["top_logprobs"][r, :k].tolist()))


def _outputs(runtime: Runtime, out: dict[str, Tensor], params: Sequence[SamplingParams], sampler: SamplerInputs,
             ) -> tuple[tuple[int, ...], Tensor | None, tuple[tuple[Logprobs, ...] | None, ...]]:
    plan, n = runtime.plan, len(params)
    if not plan.inference.on_device_sampling:  # same sampler as the graph, on the host
        out = out | sample(out["logits"], sampler, plan.topk_width, plan.logprobs_width)
    tokens = tuple(out["tokens"][:n].tolist())
    logits = out["logits"][:n] if plan.inference.output_logits else None
    logprobs = tuple(None if sp.logprobs is None else (row_logprobs(out, r, tokens[r], sp.logprobs),)
                     for r, sp in enumerate(params))
    return tokens, logits, logprobs


def row_finite(out: dict[str, Tensor], n: int) -> tuple[bool, ...]:
    """[n] per-row finiteness of the logits: the graph's ``finite`` output (computed in the
    prefill/decode epilogue)."""
    return tuple(bool(f) for f in out["finite"][:n].tolist())


def count_tokens(state: State, slots: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
    """Add each row's new tokens to its slot's output counts (after the lease is revoked)."""
    for s, row in zip(slots, tokens):
        state.output_counts[s].index_put_((torch.tensor(row, dtype=torch.long),), torch.ones(len(row), dtype=torch.int32),
                                          accumulate=True)


def single(tokens: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    return tuple((t,) for t in tokens)


# --- steps --------------------------------------------------------------------------------------


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
    plan = runtime.plan

    n, vocab = len(batch.prompts), plan.model.vocab_size
    bsz = select_bucket(plan.batch_buckets, n, "batch rows")
    bucket = select_bucket(plan.prefill_buckets, max(len(p) for p in batch.prompts), "prompt length")
    ids, positions, seq_ids = token_inputs(runtime, bsz, bucket, batch.seq_ids, batch.prompts, [0] * n)
    prompt_mask = torch.zeros(bsz, vocab, dtype=torch.bool)
    for b, prompt in enumerate(batch.prompts):
        prompt_mask[b, list(prompt)] = True
    rand, next_key = draws(state.rng_key, batch.sampling, [0] * n, bsz)
    bias = min_tokens_bias(runtime, batch.sampling, [0] * n, bsz)
    sampler = sampler_inputs(runtime, batch.sampling, torch.zeros(bsz, vocab, dtype=torch.int32), prompt_mask, bias, rand, bsz)
    lens = torch.tensor(pad([len(p) for p in batch.prompts], bsz, 1), dtype=torch.int32)
    inputs = PrefillInputs(input_ids=ids, position_ids=positions, seq_ids=seq_ids, prompt_lens=lens, sampler=sampler)

    out = call_graph(runtime, state.kv, "prefill", bsz, bucket, inputs)
    draft = _prefill_draft(runtime, state, batch)
    tokens, logits, logprobs = _outputs(runtime, out, batch.sampling, sampler)
    finite = row_finite(out, n)
    slots = list(batch.seq_ids)
    cache_lens, generated, live = list(state.cache_lens), list(state.generated), list(state.live)
    for s, prompt in zip(slots, batch.prompts):
        cache_lens[s], generated[s], live[s] = len(prompt), 1, True
    # The lease is revoked before the shared host tensors change: an interrupt from here on
    # leaves the input state clearly consumed, never silently half-updated.
    new = advance(state, cache_lens=tuple(cache_lens), generated=tuple(generated), live=tuple(live), rng_key=next_key, draft=draft)
    new.prompt_mask[slots] = prompt_mask[:n]
    new.output_counts[slots] = 0
    count_tokens(new, slots, single(tokens))
    return StepOutput(tokens=tokens, new_tokens=single(tokens), logits=logits, logprobs=logprobs, bucket=bucket,
                      batch_size=bsz, finite=finite, num_drafted=(0,) * n), new


def _prefill_draft(runtime: Runtime, state: State, batch: PrefillBatch) -> State | None:
    """The draft runtime's state after prefilling the same prompts into the same slots (greedy:
    its tokens are not used), or None without a draft runtime."""
    if runtime.draft is None:
        return None
    greedy = PrefillBatch(seq_ids=batch.seq_ids, prompts=batch.prompts, sampling=[SamplingParams()] * len(batch.prompts))
    return prefill_step(runtime.draft, state.draft, greedy)[1]


def one_token(runtime: Runtime, kv: KVCache, phase: str, slots: Sequence[int], input_ids: Sequence[int], positions: Sequence[int],
              sampler: SamplerInputs, n: int) -> tuple[dict[str, Tensor], int, int]:
    """Run the ``phase`` ("decode" or "draft") graph of ``runtime`` on ``kv`` for one token per
    row at ``positions`` (inputs already validated; ``sampler`` already padded to the batch
    bucket of ``n`` rows). Returns (graph outputs, batch bucket, KV bucket >= max(positions) + 1)."""
    plan = runtime.plan
    bsz = select_bucket(plan.batch_buckets, n, "batch rows")
    bucket = select_bucket(plan.decode_buckets, max(positions) + 1, "attended KV length")
    ids, pos, seq_ids = token_inputs(runtime, bsz, 1, slots, [[t] for t in input_ids], positions)
    inputs = DecodeInputs(input_ids=ids, position_ids=pos, seq_ids=seq_ids, sampler=sampler)
    return call_graph(runtime, kv, phase, bsz, bucket, inputs), bsz, bucket


def decode_sampler(runtime: Runtime, state: State, slots: Sequence[int], params: Sequence[SamplingParams],
                   generated: Sequence[int], rand: Tensor, bsz: int) -> SamplerInputs:
    """The sampler inputs of one decode-like step for ``slots``: their counts and prompt masks
    from the state, the min_tokens bias at ``generated``, ``rand``; padded to ``bsz`` rows."""
    slots = list(slots)
    bias = min_tokens_bias(runtime, params, generated, bsz)
    return sampler_inputs(runtime, params, state.output_counts[slots], state.prompt_mask[slots], bias, rand, bsz)


def decode_step(runtime: Runtime, state: State, batch: DecodeBatch) -> tuple[StepOutput, State]:
    """Decode one token for each live slot in ``batch.seq_ids``, feeding ``batch.input_ids``.

    Runs the (decode, batch bucket >= n rows, KV bucket >= longest cache_len + 1) graph; padding
    rows write only the scratch slot; a row whose logits were NaN/inf (e.g. a poisoned cache) has
    ``finite[r] == False`` and no other row is affected. With a draft runtime the draft decodes
    the same tokens (its cache follows the target's). Raises (before any change) InputError
    (not a DecodeBatch, empty batch, row counts differ, non-int ids), BatchTooLargeError, SlotError
    (out of range, duplicate or free), TokenOutOfVocabError, SequenceLengthExceededError (slot
    already holds sequence_length tokens), SamplingParamsError, StateConsumedError /
    StateMismatchError.
    """
    check_decode(runtime, state, batch, DecodeBatch)
    plan = runtime.plan
    check_room(state, batch.seq_ids, 1, plan.inference.sequence_length,
               "release it or compile with a larger sequence_length.")
    check_params(runtime, batch.sampling)

    slots, n = list(batch.seq_ids), len(batch.seq_ids)
    generated = [state.generated[s] for s in slots]
    bsz = select_bucket(plan.batch_buckets, n, "batch rows")
    rand, next_key = draws(state.rng_key, batch.sampling, generated, bsz)
    sampler = decode_sampler(runtime, state, slots, batch.sampling, generated, rand, bsz)
    positions = [state.cache_lens[s] for s in slots]
    out, bsz, bucket = one_token(runtime, state.kv, "decode", slots, batch.input_ids, positions, sampler, n)
    draft = _follow_draft(runtime, state, slots, batch.input_ids)
    return _one_token_each(runtime, state, slots, batch.sampling, out, sampler, next_key, draft, bucket, bsz)


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
    plan = runtime.plan
    for s, row in zip(batch.seq_ids, batch.prompts):
        if len(row) != state.cache_lens[s] + 1:
            raise InputError(f"refill of slot {s}: {len(row)} tokens given, the slot holds {state.cache_lens[s]}; "
                             "give its whole sequence (prompt, generated tokens and the new token).")

    slots, n = list(batch.seq_ids), len(batch.seq_ids)
    generated = [state.generated[s] for s in slots]
    bsz = select_bucket(plan.batch_buckets, n, "batch rows")
    bucket = select_bucket(plan.prefill_buckets, max(len(p) for p in batch.prompts), "prompt length")
    rand, next_key = draws(state.rng_key, batch.sampling, generated, bsz)
    sampler = decode_sampler(runtime, state, slots, batch.sampling, generated, rand, bsz)
    ids, positions, seq_ids = token_inputs(runtime, bsz, bucket, slots, batch.prompts, [0] * n)
    lens = torch.tensor(pad([len(p) for p in batch.prompts], bsz, 1), dtype=torch.int32)
    inputs = PrefillInputs(input_ids=ids, position_ids=positions, seq_ids=seq_ids, prompt_lens=lens, sampler=sampler)
    out = call_graph(runtime, state.kv, "prefill", bsz, bucket, inputs)
    draft = None
    if runtime.draft is not None:
        greedy = attrs.evolve(batch, sampling=[SamplingParams()] * n)
        draft = refill_step(runtime.draft, state.draft, greedy)[1]
    return _one_token_each(runtime, state, slots, batch.sampling, out, sampler, next_key, draft, bucket, bsz)


def _one_token_each(runtime: Runtime, state: State, slots: list[int], sampling: Sequence[SamplingParams], out: dict,
                    sampler: SamplerInputs, next_key: int, draft: State | None, bucket: int, bsz: int) -> tuple[StepOutput, State]:
    """The output and new state of a step that gave each slot one token (decode, refill): its
    cache_len and generated count grow by one."""
    n = len(slots)
    tokens, logits, logprobs = _outputs(runtime, out, sampling, sampler)
    new_lens, new_generated = list(state.cache_lens), list(state.generated)
    for s in slots:
        new_lens[s] += 1
        new_generated[s] += 1
    new = advance(state, cache_lens=tuple(new_lens), generated=tuple(new_generated), live=state.live, rng_key=next_key, draft=draft)
    count_tokens(new, slots, single(tokens))  # after the lease is revoked (see prefill_step)
    return StepOutput(tokens=tokens, new_tokens=single(tokens), logits=logits, logprobs=logprobs, bucket=bucket,
                      batch_size=bsz, finite=row_finite(out, n), num_drafted=(0,) * n), new


def _follow_draft(runtime: Runtime, state: State, slots: Sequence[int], input_ids: Sequence[int]) -> State | None:
    """The draft runtime's state after writing ``input_ids`` at each slot's cache_len (a plain
    decode step keeps the draft's cache in step with the target's), or None without one."""
    if runtime.draft is None:
        return None
    batch = DecodeBatch(seq_ids=slots, input_ids=input_ids, sampling=[SamplingParams()] * len(slots))
    return decode_step(runtime.draft, state.draft, batch)[1]


def release(runtime: Runtime, state: State, seq_ids: Sequence[int]) -> State:
    """Free live slots ``seq_ids`` (their KV content becomes unreachable; with a draft runtime,
    the draft's too). Raises SlotError for ``seq_ids`` that is not a list, or a slot that is out
    of range, duplicated or already free."""
    check_state(runtime, state)
    if not isinstance(seq_ids, (list, tuple)):
        raise SlotError(f"seq_ids={seq_ids!r} must be a list of slot indices, e.g. [{seq_ids!r}].")
    check_slots(state, seq_ids, live=True)
    draft = release(runtime.draft, state.draft, seq_ids) if runtime.draft is not None else None
    cache_lens, generated, live = list(state.cache_lens), list(state.generated), list(state.live)
    for s in seq_ids:
        cache_lens[s], generated[s], live[s] = 0, 0, False
    return advance(state, cache_lens=tuple(cache_lens), generated=tuple(generated), live=tuple(live), rng_key=state.rng_key,
                   draft=draft)
