"""Step functions a scheduler drives: prefill new requests into slots, decode live slots, release.

Each step validates its whole input first (raising a named error before anything changes), picks
the (phase, bucket) graph from host integers it already has, runs it, and returns
(StepOutput, new State); the input state is consumed.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from neuronfx.config.buckets import select_bucket
from neuronfx.config.sampling import SamplingParams, pack_sampling
from neuronfx.errors import (
    BatchTooLargeError,
    EmptyPromptError,
    InputError,
    PromptTooLongError,
    SequenceLengthExceededError,
    SlotError,
    TokenOutOfVocabError,
)
from neuronfx.graphs.sampling import sample
from neuronfx.runtime.runtime import Runtime
from neuronfx.runtime.state import State, advance, check_usable


def _rows(prompts: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    for b, row in enumerate(prompts):
        if not isinstance(row, (list, tuple)):
            raise InputError(f"prompt of row {b} is {type(row).__name__}; each prompt is a list of token ids.")
    return tuple(tuple(r) for r in prompts)


@attrs.frozen(kw_only=True)
class PrefillBatch:
    """New requests to prefill; row b goes to slot ``seq_ids[b]``."""

    seq_ids: tuple[int, ...] = attrs.field(converter=tuple)  # [n] free slots, distinct
    prompts: tuple[tuple[int, ...], ...] = attrs.field(converter=_rows)  # [n][len_b] ids
    sampling: tuple[SamplingParams, ...] = attrs.field(converter=tuple)  # [n]


@attrs.frozen(kw_only=True)
class DecodeBatch:
    """One token for each of the live slots ``seq_ids``."""

    seq_ids: tuple[int, ...] = attrs.field(converter=tuple)  # [n] live slots, distinct
    input_ids: tuple[int, ...] = attrs.field(converter=tuple)  # [n] last token of each row
    sampling: tuple[SamplingParams, ...] = attrs.field(converter=tuple)  # [n]


@attrs.frozen(kw_only=True, eq=False)
class StepOutput:
    """What one step produced, row-aligned with its batch."""

    tokens: tuple[int, ...]  # [n] sampled token ids
    logits: torch.Tensor | None  # [n, vocab] float32 of the last position, when output_logits
    bucket: int  # tokens: prompt bucket (prefill) or attended KV length (decode)


def _check_rows(runtime: Runtime, seq_ids: Sequence[int], other: Sequence[object], what: str) -> None:
    limit = runtime.plan.inference.batch_size
    if len(seq_ids) == 0:
        raise InputError(f"{what} batch is empty; give at least one row.")
    if len(seq_ids) > limit:
        raise BatchTooLargeError(
            f"{what} batch has {len(seq_ids)} rows > batch_size={limit}; split it or compile with a larger batch_size."
        )
    if len(other) != len(seq_ids):
        raise InputError(f"{what} batch has {len(seq_ids)} seq_ids but {len(other)} rows of inputs; give one per row.")


def _check_slots(state: State, seq_ids: Sequence[int], live: bool) -> None:
    n = state.num_slots
    for s in seq_ids:
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < n:
            raise SlotError(f"seq_id {s!r} is not a slot in [0, {n}); use a slot index below batch_size={n}.")
    if len(set(seq_ids)) != len(seq_ids):
        raise SlotError(f"seq_ids {list(seq_ids)} contain duplicates; each row needs its own slot.")
    for s in seq_ids:
        if state.live[s] != live:
            need = "a live request (prefill it first)" if live else "free (release it first)"
            raise SlotError(f"slot {s} must be {need}; free slots are {list(state.free_slots)}.")


def check_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    """Raise TokenOutOfVocabError unless every id is an int in [0, vocab_size)."""
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise TokenOutOfVocabError(f"token id {t!r} is outside the vocabulary [0, {vocab_size}); check the tokenizer matches the model.")


def check_prompts(runtime: Runtime, prompts: Sequence[Sequence[int]]) -> None:
    """Raise EmptyPromptError, PromptTooLongError (> max_context_length) or TokenOutOfVocabError
    for the first bad prompt."""
    limit = runtime.plan.inference.max_context_length
    for b, prompt in enumerate(prompts):
        if not prompt:
            raise EmptyPromptError(f"prompt of row {b} is empty; every prompt needs at least one token.")
        if len(prompt) > limit:
            raise PromptTooLongError(
                f"prompt of row {b} has {len(prompt)} tokens > max_context_length={limit}; shorten it or compile with a larger max_context_length."
            )
        check_token_ids(prompt, runtime.plan.model.vocab_size)


def _draws(key: int, n: int) -> tuple[torch.Tensor, int]:
    """(n uniform floats in [0, 1), next key) from the state's RNG key; pure in ``key``."""
    g = torch.Generator().manual_seed(key)
    rand = torch.rand(n, generator=g)
    return rand, int(torch.randint(0, 2**62, (1,), generator=g))


def _pad(rows: list[list[float]] | list[int], n: int, fill: object) -> list:
    return list(rows) + [fill] * (n - len(rows))


def _outputs(runtime: Runtime, out: dict[str, torch.Tensor], n: int, params: torch.Tensor, rand: torch.Tensor) -> tuple[tuple[int, ...], torch.Tensor | None]:
    logits = out["logits"][:n] if runtime.plan.inference.output_logits else None
    if runtime.plan.inference.on_device_sampling:
        tokens = out["tokens"][:n]
    else:  # same sampler as the graph, on the host
        tokens = sample(out["logits"][:n], params[:n], rand[:n], runtime.plan.topk_width)
    return tuple(tokens.tolist()), logits


def prefill_step(runtime: Runtime, state: State, batch: PrefillBatch) -> tuple[StepOutput, State]:
    """Prefill ``batch.prompts`` into free slots ``batch.seq_ids``; returns each row's first token.

    Raises (before any change) BatchTooLargeError, SlotError (slot out of range, duplicate or
    live), EmptyPromptError, PromptTooLongError (> max_context_length), TokenOutOfVocabError,
    SamplingParamsError, StateConsumedError / StateMismatchError.
    """
    plan = runtime.plan
    check_usable(state, plan)
    _check_rows(runtime, batch.seq_ids, batch.prompts, "prefill")
    _check_rows(runtime, batch.seq_ids, batch.sampling, "prefill")
    _check_slots(state, batch.seq_ids, live=False)
    check_prompts(runtime, batch.prompts)
    rows = pack_sampling(batch.sampling, plan.topk_width)

    n, bsz = len(batch.prompts), plan.inference.batch_size
    bucket = select_bucket(plan.prefill_buckets, max(len(p) for p in batch.prompts), "prompt length")
    ids = torch.zeros(bsz, bucket, dtype=torch.int32)
    for b, prompt in enumerate(batch.prompts):
        ids[b, : len(prompt)] = torch.tensor(prompt, dtype=torch.int32)
    positions = torch.arange(bucket, dtype=torch.int32).expand(bsz, bucket).contiguous()
    seq_ids = torch.tensor(_pad(list(batch.seq_ids), bsz, plan.kv.scratch_slot), dtype=torch.int32)
    lens = torch.tensor(_pad([len(p) for p in batch.prompts], bsz, 1), dtype=torch.int32)
    params = torch.tensor(_pad(rows, bsz, [1.0, 1.0, 1.0]), dtype=torch.float32)
    rand, next_key = _draws(state.rng_key, bsz)

    with torch.no_grad():  # inference only; compiled graphs are specialised for no-grad
        out = runtime.graphs[("prefill", bucket)](runtime.weights, list(state.kv), ids, positions, seq_ids, lens, params, rand)
    tokens, logits = _outputs(runtime, out, n, params, rand)
    cache_lens, live = list(state.cache_lens), list(state.live)
    for s, prompt in zip(batch.seq_ids, batch.prompts):
        cache_lens[s], live[s] = len(prompt), True
    new = advance(state, cache_lens=tuple(cache_lens), live=tuple(live), rng_key=next_key)
    return StepOutput(tokens=tokens, logits=logits, bucket=bucket), new


def decode_step(runtime: Runtime, state: State, batch: DecodeBatch) -> tuple[StepOutput, State]:
    """Decode one token for each live slot in ``batch.seq_ids``, feeding ``batch.input_ids``.

    Raises (before any change) BatchTooLargeError, SlotError (out of range, duplicate or free),
    TokenOutOfVocabError, SequenceLengthExceededError (slot already holds sequence_length
    tokens), SamplingParamsError, StateConsumedError / StateMismatchError.
    """
    plan = runtime.plan
    check_usable(state, plan)
    _check_rows(runtime, batch.seq_ids, batch.input_ids, "decode")
    _check_rows(runtime, batch.seq_ids, batch.sampling, "decode")
    _check_slots(state, batch.seq_ids, live=True)
    check_token_ids(batch.input_ids, plan.model.vocab_size)
    seq_len = plan.inference.sequence_length
    for s in batch.seq_ids:
        if state.cache_lens[s] >= seq_len:
            raise SequenceLengthExceededError(
                f"slot {s} holds {state.cache_lens[s]} tokens = sequence_length={seq_len}; release it or compile with a larger sequence_length."
            )
    rows = pack_sampling(batch.sampling, plan.topk_width)

    n, bsz = len(batch.seq_ids), plan.inference.batch_size
    cache_lens = [state.cache_lens[s] for s in batch.seq_ids]
    bucket = select_bucket(plan.decode_buckets, max(cache_lens) + 1, "attended KV length")
    ids = torch.tensor(_pad(list(batch.input_ids), bsz, 0), dtype=torch.int32)[:, None]
    positions = torch.tensor(_pad(cache_lens, bsz, 0), dtype=torch.int32)[:, None]
    seq_ids = torch.tensor(_pad(list(batch.seq_ids), bsz, plan.kv.scratch_slot), dtype=torch.int32)
    params = torch.tensor(_pad(rows, bsz, [1.0, 1.0, 1.0]), dtype=torch.float32)
    rand, next_key = _draws(state.rng_key, bsz)

    with torch.no_grad():
        out = runtime.graphs[("decode", bucket)](runtime.weights, list(state.kv), ids, positions, seq_ids, params, rand)
    tokens, logits = _outputs(runtime, out, n, params, rand)
    new_lens = list(state.cache_lens)
    for s in batch.seq_ids:
        new_lens[s] += 1
    new = advance(state, cache_lens=tuple(new_lens), live=state.live, rng_key=next_key)
    return StepOutput(tokens=tokens, logits=logits, bucket=bucket), new


def release(runtime: Runtime, state: State, seq_ids: Sequence[int]) -> State:
    """Free live slots ``seq_ids`` (their KV content becomes unreachable). Raises SlotError for a
    slot that is out of range, duplicated or already free."""
    check_usable(state, runtime.plan)
    _check_slots(state, seq_ids, live=True)
    cache_lens, live = list(state.cache_lens), list(state.live)
    for s in seq_ids:
        cache_lens[s], live[s] = 0, False
    return advance(state, cache_lens=tuple(cache_lens), live=tuple(live), rng_key=state.rng_key)
