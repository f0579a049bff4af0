"""Step functions a scheduler drives: prefill new requests into slots, decode live slots, release.

Each step validates its whole input first (raising a named error before anything changes), picks
the (phase, bucket) graph from host integers it already has, runs it, and returns
(StepOutput, new State); the input state is consumed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import attrs
import torch

from neuronfx.config.buckets import select_bucket
from neuronfx.config.sampling import SamplingParams, check_sampling, pack_sampling
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
    prompts = _row_values("prompts")(prompts)
    for b, row in enumerate(prompts):
        if not isinstance(row, (list, tuple)):
            raise InputError(f"prompt of row {b} is {type(row).__name__}; each prompt is a list of token ids.")
    return tuple(tuple(r) for r in prompts)


def _row_values(field: str) -> Callable[[object], tuple]:
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

    seq_ids: tuple[int, ...] = attrs.field(converter=_row_values("seq_ids"))  # [n] free slots, distinct
    prompts: tuple[tuple[int, ...], ...] = attrs.field(converter=_rows)  # [n][len_b] ids
    sampling: tuple[SamplingParams, ...] = attrs.field(converter=_row_values("sampling"))  # [n]


@attrs.frozen(kw_only=True)
class DecodeBatch:
    """One token for each of the live slots ``seq_ids``."""

    seq_ids: tuple[int, ...] = attrs.field(converter=_row_values("seq_ids"))  # [n] live slots, distinct
    input_ids: tuple[int, ...] = attrs.field(converter=_row_values("input_ids"))  # [n] last token of each row
    sampling: tuple[SamplingParams, ...] = attrs.field(converter=_row_values("sampling"))  # [n]


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
    """What one step produced, row-aligned with its batch."""

    tokens: tuple[int, ...]  # [n] sampled token ids
    logits: torch.Tensor | None  # [n, vocab] float32 of the last position, when output_logits
    logprobs: tuple[Logprobs | None, ...]  # [n]; None for rows that did not ask (logprobs=None)
    bucket: int  # tokens: prompt bucket (prefill) or attended KV length (decode)
    batch_size: int  # rows of the graph that ran (the batch bucket; rows past n were padding)
    finite: tuple[bool, ...]  # [n] False where the row's logits held NaN/inf: its token is garbage


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
    """Raise InputError unless ``batch`` is a ``kind`` (PrefillBatch or DecodeBatch)."""
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


def _pad(rows: list, n: int, fill: object) -> list:
    return list(rows) + [fill] * (n - len(rows))


_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = 2**64 - 1


def seeded_uniform(seed: int, index: int) -> float:
    """The uniform in [0, 1) for draw ``index`` (0-based, tokens sampled so far) of a request
    seeded with ``seed``: a pure function of (seed, index), so a seeded request samples the same
    tokens whatever shares its batch and whichever slot it holds (vLLM keeps one torch.Generator
    per seeded request for the same reason). Mixing: splitmix64 (Steele et al. 2014)."""
    z = (seed + (index + 1) * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return float(torch.rand(1, generator=torch.Generator().manual_seed(z >> 1)))


def _draws(key: int, params: Sequence[SamplingParams], generated: Sequence[int], bsz: int) -> tuple[torch.Tensor, int]:
    """(bsz uniforms, next key). Unseeded rows draw from the state's key (pure in ``key``);
    seeded rows from their own (seed, index)."""
    g = torch.Generator().manual_seed(key)
    rand = torch.rand(bsz, generator=g)
    for r, (sp, n) in enumerate(zip(params, generated)):
        if sp.seed is not None:
            rand[r] = seeded_uniform(sp.seed, n)
    return rand, int(torch.randint(0, 2**62, (1,), generator=g))


def _stop_ids(plan_eos: Sequence[int], sp: SamplingParams) -> list[int]:
    """Tokens min_tokens holds back: the model's eos ids (unless ignore_eos) and stop_token_ids."""
    return ([] if sp.ignore_eos else list(plan_eos)) + list(sp.stop_token_ids)


def _sampler_inputs(
    runtime: Runtime, state: State, params: Sequence[SamplingParams], generated: Sequence[int],
    counts: torch.Tensor, prompt_mask: torch.Tensor,
) -> tuple[tuple[torch.Tensor, ...], int]:
    """Graph inputs (sampling_params, output_counts, prompt_mask, logits_bias, rand), each padded
    to ``counts.shape[0]`` rows, and the next RNG key. ``counts``/``prompt_mask``: [bsz, vocab]
    with the real rows filled."""
    plan = runtime.plan
    bsz, n = counts.shape[0], len(params)
    rows = pack_sampling(params, plan.topk_width) + pack_sampling([SamplingParams()] * (bsz - n), plan.topk_width)
    bias = torch.zeros(bsz, plan.model.vocab_size, dtype=torch.float32)
    for r, (sp, done) in enumerate(zip(params, generated)):
        if done < sp.min_tokens:
            bias[r, _stop_ids(plan.model.eos_token_ids, sp)] = float("-inf")
    rand, next_key = _draws(state.rng_key, params, generated, bsz)
    return (torch.tensor(rows, dtype=torch.float32), counts, prompt_mask, bias, rand), next_key


def row_finite(out: dict[str, torch.Tensor], n: int) -> tuple[bool, ...]:
    """[n] per-row finiteness of the logits: the graph's ``finite`` output (computed in the
    prefill/decode epilogue)."""
    return tuple(bool(f) for f in out["finite"][:n].tolist())


def _outputs(runtime: Runtime, out: dict[str, torch.Tensor], params: Sequence[SamplingParams], inputs: tuple[torch.Tensor, ...]) -> tuple[tuple[int, ...], torch.Tensor | None, tuple[Logprobs | None, ...]]:
    plan, n = runtime.plan, len(params)
    if not plan.inference.on_device_sampling:  # same sampler as the graph, on the host
        out = out | sample(out["logits"], *inputs, plan.topk_width, plan.logprobs_width)
    tokens = tuple(out["tokens"][:n].tolist())
    logits = out["logits"][:n] if plan.inference.output_logits else None
    logprobs = []
    for r, sp in enumerate(params):
        if sp.logprobs is None:
            logprobs.append(None)
            continue
        k = sp.logprobs
        logprobs.append(Logprobs(
            token_id=tokens[r], logprob=float(out["sampled_logprobs"][r]),
            top_ids=tuple(out["top_ids"][r, :k].tolist()), top_logprobs=tuple(out["top_logprobs"][r, :k].tolist()),
        ))
    return tokens, logits, tuple(logprobs)


def _count_tokens(state: State, slots: Sequence[int], tokens: Sequence[int]) -> None:
    state.output_counts[list(slots), list(tokens)] += 1  # distinct slots: no duplicate index


def _check_params(runtime: Runtime, sampling: Sequence[SamplingParams]) -> None:
    plan = runtime.plan
    for sp in sampling:
        check_sampling(sp, plan.topk_width, plan.logprobs_width, plan.model.vocab_size)


def prefill_step(runtime: Runtime, state: State, batch: PrefillBatch) -> tuple[StepOutput, State]:
    """Prefill ``batch.prompts`` into free slots ``batch.seq_ids``; returns each row's first token.

    Runs the (prefill, batch bucket >= n rows, prompt bucket >= longest prompt) graph; a row
    whose logits were NaN/inf has ``finite[r] == False``. Raises (before any change) InputError
    (not a PrefillBatch, empty batch, row counts differ, non-int ids), BatchTooLargeError, SlotError (slot out of range, duplicate or live),
    EmptyPromptError, PromptTooLongError (> max_context_length), TokenOutOfVocabError,
    SamplingParamsError, StateConsumedError / StateMismatchError.
    """
    plan = runtime.plan
    check_usable(state, plan)
    check_batch(batch, PrefillBatch)
    _check_rows(runtime, batch.seq_ids, batch.prompts, "prefill")
    _check_rows(runtime, batch.seq_ids, batch.sampling, "prefill")
    _check_slots(state, batch.seq_ids, live=False)
    check_prompts(runtime, batch.prompts)
    _check_params(runtime, batch.sampling)

    n, vocab = len(batch.prompts), plan.model.vocab_size
    bsz = select_bucket(plan.batch_buckets, n, "batch rows")
    bucket = select_bucket(plan.prefill_buckets, max(len(p) for p in batch.prompts), "prompt length")
    ids = torch.zeros(bsz, bucket, dtype=torch.int32)
    prompt_mask = torch.zeros(bsz, vocab, dtype=torch.bool)
    for b, prompt in enumerate(batch.prompts):
        ids[b, : len(prompt)] = torch.tensor(prompt, dtype=torch.int32)
        prompt_mask[b, list(prompt)] = True
    positions = torch.arange(bucket, dtype=torch.int32).expand(bsz, bucket).contiguous()
    seq_ids = torch.tensor(_pad(list(batch.seq_ids), bsz, plan.kv.scratch_slot), dtype=torch.int32)
    lens = torch.tensor(_pad([len(p) for p in batch.prompts], bsz, 1), dtype=torch.int32)
    counts = torch.zeros(bsz, vocab, dtype=torch.int32)
    inputs, next_key = _sampler_inputs(runtime, state, batch.sampling, [0] * n, counts, prompt_mask)

    with torch.no_grad():  # inference only; compiled graphs are specialised for no-grad
        out = runtime.graphs[("prefill", bsz, bucket)](runtime.weights, list(state.kv), ids, positions, seq_ids, lens, *inputs)
    tokens, logits, logprobs = _outputs(runtime, out, batch.sampling, inputs)
    finite = row_finite(out, n)
    slots = list(batch.seq_ids)
    cache_lens, generated, live = list(state.cache_lens), list(state.generated), list(state.live)
    for s, prompt in zip(slots, batch.prompts):
        cache_lens[s], generated[s], live[s] = len(prompt), 1, True
    # The lease is revoked before the shared host tensors change: an interrupt from here on
    # leaves the input state clearly consumed, never silently half-updated.
    new = advance(state, cache_lens=tuple(cache_lens), generated=tuple(generated), live=tuple(live), rng_key=next_key)
    new.prompt_mask[slots] = prompt_mask[:n]
    new.output_counts[slots] = 0
    _count_tokens(new, slots, tokens)
    return StepOutput(tokens=tokens, logits=logits, logprobs=logprobs, bucket=bucket, batch_size=bsz, finite=finite), new


def run_one_token(
    runtime: Runtime, state: State, phase: str, slots: list[int], input_ids: list[int], positions: list[int],
    sampling: Sequence[SamplingParams],
) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...], int, tuple[int, int]]:
    """Run the ``phase`` ("decode" or "draft") graph for one token per row at ``positions``
    (inputs already validated): rows padded to the batch bucket (padding writes the scratch
    slot), KV bucket >= max(positions) + 1. Returns (graph outputs, sampler inputs, next RNG key,
    (batch bucket, KV bucket)); the state's host counts are left to the caller."""
    plan, n = runtime.plan, len(slots)
    bsz = select_bucket(plan.batch_buckets, n, "batch rows")
    bucket = select_bucket(plan.decode_buckets, max(positions) + 1, "attended KV length")
    ids = torch.tensor(_pad(input_ids, bsz, 0), dtype=torch.int32)[:, None]
    pos = torch.tensor(_pad(positions, bsz, 0), dtype=torch.int32)[:, None]
    seq_ids = torch.tensor(_pad(slots, bsz, plan.kv.scratch_slot), dtype=torch.int32)
    counts = torch.zeros(bsz, plan.model.vocab_size, dtype=torch.int32)
    counts[:n] = state.output_counts[slots]
    prompt_mask = torch.zeros(bsz, plan.model.vocab_size, dtype=torch.bool)
    prompt_mask[:n] = state.prompt_mask[slots]
    generated = [state.generated[s] for s in slots]
    inputs, next_key = _sampler_inputs(runtime, state, sampling, generated, counts, prompt_mask)
    with torch.no_grad():
        out = runtime.graphs[(phase, bsz, bucket)](runtime.weights, list(state.kv), ids, pos, seq_ids, *inputs)
    return out, inputs, next_key, (bsz, bucket)


def decode_step(runtime: Runtime, state: State, batch: DecodeBatch) -> tuple[StepOutput, State]:
    """Decode one token for each live slot in ``batch.seq_ids``, feeding ``batch.input_ids``.

    Runs the (decode, batch bucket >= n rows, KV bucket >= longest cache_len + 1) graph; padding
    rows write only the scratch slot; a row whose logits were NaN/inf (e.g. a poisoned cache) has
    ``finite[r] == False`` and no other row is affected. Raises (before any change) InputError
    (not a DecodeBatch, empty batch, row counts differ, non-int ids), BatchTooLargeError, SlotError
    (out of range, duplicate or free), TokenOutOfVocabError, SequenceLengthExceededError (slot
    already holds sequence_length tokens), SamplingParamsError, StateConsumedError /
    StateMismatchError.
    """
    plan = runtime.plan
    check_usable(state, plan)
    check_batch(batch, DecodeBatch)
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
    _check_params(runtime, batch.sampling)

    slots = list(batch.seq_ids)
    positions = [state.cache_lens[s] for s in slots]
    out, inputs, next_key, (bsz, bucket) = run_one_token(runtime, state, "decode", slots, list(batch.input_ids), positions, batch.sampling)
    tokens, logits, logprobs = _outputs(runtime, out, batch.sampling, inputs)
    finite = row_finite(out, len(slots))
    new_lens, new_generated = list(state.cache_lens), list(state.generated)
    for s in slots:
        new_lens[s] += 1
        new_generated[s] += 1
    new = advance(state, cache_lens=tuple(new_lens), generated=tuple(new_generated), live=state.live, rng_key=next_key)
    _count_tokens(new, slots, tokens)  # after the lease is revoked (see prefill_step)
    return StepOutput(tokens=tokens, logits=logits, logprobs=logprobs, bucket=bucket, batch_size=bsz, finite=finite), new


def release(runtime: Runtime, state: State, seq_ids: Sequence[int]) -> State:
    """Free live slots ``seq_ids`` (their KV content becomes unreachable). Raises SlotError for
    ``seq_ids`` that is not a list, or a slot that is out of range, duplicated or already free."""
    check_usable(state, runtime.plan)
    if not isinstance(seq_ids, (list, tuple)):
        raise SlotError(f"seq_ids={seq_ids!r} must be a list of slot indices, e.g. [{seq_ids!r}].")
    _check_slots(state, seq_ids, live=True)
    cache_lens, generated, live = list(state.cache_lens), list(state.generated), list(state.live)
    for s in seq_ids:
        cache_lens[s], generated[s], live[s] = 0, 0, False
    return advance(state, cache_lens=tuple(cache_lens), generated=tuple(generated), live=tuple(live), rng_key=state.rng_key)
