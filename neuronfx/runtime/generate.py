"""generate: prompts in, generated tokens and a new state out, through the step functions."""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from neuronfx.config.sampling import SamplingParams, check_sampling
from neuronfx.errors import BatchTooLargeError, InputError, SequenceLengthExceededError
from neuronfx.runtime.runtime import Runtime
from neuronfx.runtime.state import State, check_usable
from neuronfx.runtime.steps import DecodeBatch, PrefillBatch, check_prompts, decode_step, prefill_step, release

Prompts = Sequence[int] | Sequence[Sequence[int]] | torch.Tensor | np.ndarray


@attrs.frozen(kw_only=True, eq=False)
class GenerateResult:
    """Output of :func:`generate`, one entry per prompt in input order."""

    token_ids: tuple[tuple[int, ...], ...]  # [n][generated_b] generated ids only (a hit eos id included)
    finish_reasons: tuple[str, ...]  # [n] "stop" (eos id produced) or "length" (max_new_tokens reached)
    prefill_s: float  # seconds in the prefill step
    decode_s: float  # seconds in decode steps

    @property
    def num_generated(self) -> int:
        """Generated tokens over all rows."""
        return sum(len(t) for t in self.token_ids)


def normalize_prompts(ids: Prompts) -> list[list[int]]:
    """Accept one prompt (list of ints or 1-D tensor) or many (list of lists or 2-D tensor without
    padding); returns a list of int lists. Raises InputError for other shapes or dtypes."""
    if isinstance(ids, np.ndarray):
        ids = torch.from_numpy(ids)
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise InputError(f"token ids tensor has dtype {ids.dtype}; give an integer tensor (int32/int64).")
        if ids.dim() not in (1, 2):
            raise InputError(f"token ids tensor has shape {tuple(ids.shape)}; give [T] or [B, T].")
        ids = ids.tolist()
    rows = [_as_row(r) if isinstance(r, (np.ndarray, torch.Tensor)) else r for r in ids]
    if rows and all(_is_id(r) for r in rows):
        return [[int(t) for t in rows]]
    for b, r in enumerate(rows):
        if not isinstance(r, (list, tuple)) or not all(_is_id(t) for t in r):
            raise InputError(
                f"prompt {b} is {r!r:.60}; ids must be a list of int token ids, a list of such lists, "
                "or an integer tensor/array of shape [T] or [B, T]."
            )
    return [[int(t) for t in r] for r in rows]


def _is_id(t: object) -> bool:
    # numpy integer scalars count as ids; bools do not.
    return isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))


def _as_row(r: np.ndarray | torch.Tensor) -> list:
    return r.tolist() if r.ndim == 1 else [r.tolist()]


def eos_set(eos_token_ids: int | Sequence[int]) -> set[int]:
    """One id or a sequence of ids (as transformers' ``eos_token_id`` accepts); raises InputError otherwise."""
    ids = [eos_token_ids] if _is_id(eos_token_ids) else eos_token_ids
    if not isinstance(ids, (list, tuple, set, frozenset)) or not all(_is_id(t) for t in ids):
        raise InputError(f"eos_token_ids={eos_token_ids!r} must be a token id or a sequence of token ids.")
    return {int(t) for t in ids}


def generate(
    runtime: Runtime,
    state: State,
    ids: Prompts,
    *,
    max_new_tokens: int = 32,
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    eos_token_ids: Sequence[int] | None = None,
) -> tuple[GenerateResult, State]:
    """Generate up to ``max_new_tokens`` tokens for each prompt; prompts may differ in length.

    Prompts take free slots of ``state``, are prefilled together, decoded together (finished rows
    leave the batch), and their slots are released before returning. ``eos_token_ids`` defaults
    to the model's (generation_config); a row stops after producing one (it is included, as in
    transformers ``generate``). Greedy unless ``sampling`` says otherwise (one SamplingParams for
    all rows or one per row; seeded through the state's RNG key).

    Raises, before any state change: BatchTooLargeError (more prompts than free slots),
    SequenceLengthExceededError (prompt + max_new_tokens > sequence_length), InputError
    (max_new_tokens < 1), plus every error of :func:`prefill_step`.
    """
    plan = runtime.plan
    check_usable(state, plan)
    prompts = normalize_prompts(ids)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1.")
    check_prompts(runtime, prompts)
    free = state.free_slots
    if len(prompts) > len(free):
        raise BatchTooLargeError(
            f"{len(prompts)} prompts > {len(free)} free slots (batch_size={plan.inference.batch_size}); "
            "send fewer prompts or compile with a larger batch_size."
        )
    seq_len = plan.inference.sequence_length
    for b, p in enumerate(prompts):
        if len(p) + max_new_tokens > seq_len:
            raise SequenceLengthExceededError(
                f"prompt {b} has {len(p)} tokens + max_new_tokens={max_new_tokens} = {len(p) + max_new_tokens} "
                f"> sequence_length={seq_len}; lower max_new_tokens or compile with a larger sequence_length."
            )
    params = (sampling,) * len(prompts) if isinstance(sampling, SamplingParams) else tuple(sampling)
    if len(params) != len(prompts) or not all(isinstance(sp, SamplingParams) for sp in params):
        raise InputError(
            f"sampling={sampling!r:.80} must be one SamplingParams, or one per prompt ({len(prompts)})."
        )
    for sp in params:
        check_sampling(sp, plan.topk_width)
    eos = eos_set(plan.model.eos_token_ids if eos_token_ids is None else eos_token_ids)

    slots = free[: len(prompts)]
    t0 = time.perf_counter()
    out, state = prefill_step(runtime, state, PrefillBatch(seq_ids=slots, prompts=prompts, sampling=params))
    prefill_s = time.perf_counter() - t0
    generated = [[t] for t in out.tokens]
    reasons: list[str | None] = [None] * len(prompts)

    def retire(rows: Sequence[int]) -> list[int]:
        done = []
        for r in rows:
            if generated[r][-1] in eos:
                reasons[r] = "stop"
            elif len(generated[r]) >= max_new_tokens:
                reasons[r] = "length"
            if reasons[r] is not None:
                done.append(r)
        return done

    active = list(range(len(prompts)))
    t0 = time.perf_counter()
    while True:
        done = retire(active)
        if done:
            state = release(runtime, state, [slots[r] for r in done])
            active = [r for r in active if r not in done]
        if not active:
            break
        batch = DecodeBatch(
            seq_ids=[slots[r] for r in active],
            input_ids=[generated[r][-1] for r in active],
            sampling=[params[r] for r in active],
        )
        out, state = decode_step(runtime, state, batch)
        for r, tok in zip(active, out.tokens):
            generated[r].append(tok)
    decode_s = time.perf_counter() - t0
    result = GenerateResult(
        token_ids=tuple(tuple(g) for g in generated),
        finish_reasons=tuple(r or "length" for r in reasons),
        prefill_s=prefill_s,
        decode_s=decode_s,
    )
    return result, state
