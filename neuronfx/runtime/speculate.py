"""Speculative decoding as a step: ``speculate_step`` drafts k - 1 tokens per row, verifies them
(plus the row's last token) in one "speculate" pass of T = k tokens per row, and accepts 1 to k
tokens (``acceptance.py``); and :func:`follow_draft`, which keeps a draft runtime's cache in
step with the target's through any other step.

Drafts: ``drafts.py`` (self-speculation, a draft runtime, prompt lookup). A runtime compiled
with ``fused_speculation`` drafts, verifies and accepts in one call (``fused.py``) unless a row
has a grammar.

Acceptance applies every SamplingParams field at every verified position exactly as a decode
step would: the logit bias of min_tokens, the penalties over the counts including the tokens
accepted before that position, temperature, top-k, min_p, top-p. A seeded row draws every
uniform from (seed, token index, stream), so a seeded speculative request is reproducible
whatever shares its batch.

KV consistency without copies: a verify pass writes k positions; the slot's cache_len is then
set to the accepted length, and positions past it are never attended (masks are
``j <= position``) and are overwritten by the next write.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from neuronfx.config.buckets import select_bucket
from neuronfx.config.sampling import SamplingParams
from neuronfx.errors import ConfigError, InputError
from neuronfx.runtime.acceptance import (
    RowFacts,
    Uniforms,
    accept,
    emitted_logprobs,
    raw_argmax,
    speculation_uniforms,
)
from neuronfx.runtime.batch import sampler_inputs
from neuronfx.runtime.blocks import reserve
from neuronfx.runtime.checks import check_decode, check_kv_blocks, check_room, check_token_ids, row_values, token_rows
from neuronfx.runtime.drafts import GREEDY, Drafter, drafter_of, propose
from neuronfx.runtime.fused import batch_rows, fused_inputs, fused_step
from neuronfx.runtime.pipeline import Rows, StepOutput, commit, plan_rows, run_rows
from neuronfx.runtime.runtime import Runtime, check_runtime
from neuronfx.runtime.state import State, advance, with_draft_state
from neuronfx.runtime.structured import Constraints, constraint_rows

Tensor = torch.Tensor


@attrs.frozen(kw_only=True)
class SpeculateBatch:
    """Up to k = ``speculation_length`` tokens for each of the live slots ``seq_ids``.

    ``constraints`` (structured outputs): None, or per row a
    :class:`~neuronfx.runtime.structured.Matcher` (or None). The step advances a matcher through
    the row's own drafts to mask every drafted and verified position, then rolls it back: its
    net state is unchanged, and the caller consumes the accepted tokens (``new_tokens``).

    ``history``: None, or per row its prompt and generated tokens up to and including its
    ``input_ids`` token: the sequence prompt lookup searches (needed by a runtime with
    ``speculative_method="ngram"``, ignored by the others)."""

    seq_ids: tuple[int, ...] = attrs.field(converter=row_values("seq_ids"))  # [n] live slots, distinct
    input_ids: tuple[int, ...] = attrs.field(converter=row_values("input_ids"))  # [n] last token of each row, not yet cached
    sampling: tuple[SamplingParams, ...] = attrs.field(converter=row_values("sampling"))  # [n]
    constraints: Constraints = attrs.field(default=None, converter=constraint_rows)  # [n] Matcher or None, or None
    history: tuple[tuple[int, ...], ...] | None = attrs.field(default=None, converter=lambda v: _history_rows(v))  # [n][len_r]


def _history_rows(value: object) -> tuple[tuple[int, ...], ...] | None:
    """attrs converter of ``SpeculateBatch.history``: None, or per-row lists of token ids -> tuples."""
    return None if value is None else token_rows("history", "history")(value)


@attrs.frozen(kw_only=True)
class SpeculationStats:
    """Per-request acceptance statistics."""

    target_passes: int  # target passes after the prefill: speculate steps and plain decode steps
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens the verifier accepted (vLLM's count): some may fall after a stop and be dropped
    emitted: int  # tokens the request kept after the prefill

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target pass (1 = no gain; k at most)."""
        return self.emitted / self.target_passes if self.target_passes else 0.0


# --- the draft runtime follows every other step -------------------------------------------------


def follow_draft(step: Callable[[Runtime, State, Any], tuple[StepOutput, State]], runtime: Runtime, state: State,
                 batch: Any) -> tuple[StepOutput, State]:
    """``step(runtime, state, batch)`` (a pipeline of the target alone: prefill, refill, decode);
    with a draft runtime, then the same step of the draft runtime on ``state.draft`` with greedy
    sampling (its tokens are not used), so the draft's cache holds what the target's holds,
    slot for slot. ``batch`` is an attrs record with a ``sampling`` field."""
    out, new = step(runtime, state, batch)
    if runtime.draft is None:
        return out, new
    greedy = attrs.evolve(batch, sampling=(GREEDY,) * len(batch.seq_ids), constraints=None)  # its tokens are not used
    return out, with_draft_state(new, step(runtime.draft, state.draft, greedy)[1])


def catch_up(drafter: Drafter, state: State, rows: RowFacts, drafts: list[list[int]], ends: list[int], k: int) -> None:
    """A drafter with its own cache, after the target accepted up to ``ends``: each row that
    accepted every draft feeds the last one into the draft cache (the draft never consumed it).
    Nothing for a drafter sharing the target's cache."""
    if not drafter.own_cache:
        return
    draft, dstate = drafter.runtime, state.draft
    full = [r for r, s in enumerate(rows.slots) if ends[r] == state.cache_lens[s] + k]
    if full:
        slots = [rows.slots[r] for r in full]
        step = plan_rows(draft, "decode", draft.plan.decode_buckets, slots, [(drafts[r][-1],) for r in full],
                         [dstate.cache_lens[s] + k - 1 for s in slots], width=1)
        zeros = torch.zeros(len(full), draft.plan.model.vocab_size)
        run_rows(draft, dstate, step, sampler_inputs(draft, [GREEDY] * len(full), zeros.int(), zeros.bool(), zeros,
                                                        torch.zeros(len(full)), step.bsz))


def sync_draft(drafter: Drafter, state: State, slots: Sequence[int], ends: Sequence[int]) -> State | None:
    """A drafter with its own cache, once its cache holds every accepted token: its new state,
    each row's cache_len the target's ``ends`` (positions past it are stale and never read).
    None for a drafter sharing the target's cache."""
    if not drafter.own_cache:
        return None
    dstate = state.draft
    lens = list(dstate.cache_lens)
    for s, end in zip(slots, ends):
        lens[s] = end
    return advance(dstate, cache_lens=tuple(lens), generated=dstate.generated, live=dstate.live, rng_key=dstate.rng_key)


# --- the step -----------------------------------------------------------------------------------


def check_speculate(runtime: Runtime) -> None:
    """Raise ConfigError unless ``runtime`` can speculate (``Runtime.can_speculate``)."""
    inf = runtime.plan.inference
    if inf.speculation_length < 2:
        raise ConfigError("this runtime has no speculate graphs: compile with InferenceConfig(speculation_length=k >= 2).")
    if not runtime.can_speculate:
        # fused_speculation refuses prompt lookup (its drafts come from the host): offer only a model there
        lookup = "" if inf.fused_speculation else " or speculative_method='ngram' (prompt lookup)"
        raise ConfigError(f"this runtime has no draft: compile with draft_layers=N (self-speculation){lookup}, or attach a "
                          "draft runtime with neuronfx.with_draft(runtime, draft_runtime).")


def check_history(runtime: Runtime, batch: SpeculateBatch) -> None:
    """Raise InputError when a prompt-lookup runtime gets no ``batch.history``, or a history
    that is not one sequence per row ending with the row's input token; TokenOutOfVocabError
    for a history token outside the vocabulary (it could become a draft)."""
    if batch.history is None:
        if runtime.plan.inference.speculative_method == "ngram":
            raise InputError("this runtime drafts by prompt lookup (speculative_method='ngram'): pass SpeculateBatch("
                             "history=...), each row's prompt and generated tokens with its input_ids token last.")
        return
    if len(batch.history) != len(batch.seq_ids):
        raise InputError(f"history has {len(batch.history)} rows but seq_ids has {len(batch.seq_ids)}; give one per row.")
    for r, (h, x) in enumerate(zip(batch.history, batch.input_ids)):
        if not h or h[-1] != x:
            raise InputError(f"history of row {r} ends with {list(h[-1:])} but its input_ids token is {x}; pass the row's "
                             "prompt and generated tokens up to and including its input_ids token.")
        check_token_ids(h, runtime.plan.model.vocab_size)


def speculate_step(runtime: Runtime, state: State, batch: SpeculateBatch) -> tuple[StepOutput, State]:
    """Up to k = ``speculation_length`` tokens for each live slot in ``batch.seq_ids``, feeding
    ``batch.input_ids``: k - 1 drafted tokens (:func:`propose`) and the last token are verified
    in one (speculate, batch bucket >= n rows, KV bucket >= longest cache_len + k) pass, and
    every row accepts 1 to k tokens (``StepOutput.new_tokens``; ``tokens`` holds each row's last,
    the next step's input). Every SamplingParams field applies as in ``decode_step``;
    logprobs come one per new token. The slot's cache_len grows by the accepted count.

    Raises (before any change) ConfigError (no speculate graphs or no draft), the errors of
    ``decode_step``, InputError for a missing or wrong ``history`` on a prompt-lookup runtime
    (:func:`check_history`), and SequenceLengthExceededError when a slot has no room for k more
    tokens (decode that row with ``decode_step``).
    """
    check_runtime(runtime)
    check_speculate(runtime)
    check_decode(runtime, state, batch, SpeculateBatch)
    check_history(runtime, batch)
    k = runtime.plan.inference.speculation_length
    check_room(state, batch.seq_ids, k, runtime.plan.inference.sequence_length,
               f"speculation writes k={k} positions: decode that row with decode_step instead.")
    starts = [state.cache_lens[s] for s in batch.seq_ids]
    check_kv_blocks(runtime, state, batch.seq_ids, starts, [n + k for n in starts])
    return speculate(runtime, state, batch)


def verify(runtime: Runtime, state: State, slots: Sequence[int], x0: Sequence[int], drafts: list[list[int]]) -> tuple[Rows, dict[str, Tensor]]:
    """The verify pass: T = k tokens per row (its last token, then its drafts) from its slot's
    cache_len; (its Rows, the speculate graph's outputs for the n rows: "logits" (n, k, V)
    float32, "argmax" (n, k) int32, "finite" (n, k) bool)."""
    k = runtime.plan.inference.speculation_length
    rows = plan_rows(runtime, "speculate", runtime.plan.decode_buckets, slots, [[x, *d] for x, d in zip(x0, drafts)],
                     [state.cache_lens[s] for s in slots], width=k)
    out = run_rows(runtime, state, rows)
    return rows, {name: out[name][: len(slots)] for name in ("logits", "argmax", "finite")}


@attrs.frozen
class Verified:
    """What a speculate step's passes left for its commit: each row's emitted tokens, the verify
    pass's logits (n, k, V) float32 and their finiteness (n, k) bool, each row's real drafts
    (None: k - 1 each), and the verify graph's batch bucket and KV bucket."""

    emitted: list[list[int]]
    logits: Tensor
    finite: Tensor
    drafted: tuple[int, ...] | None
    bsz: int
    bucket: int


def unfused(runtime: Runtime, drafter: Drafter, state: State, batch: SpeculateBatch, facts: RowFacts, u: Uniforms) -> Verified:
    """Propose (one host step per draft), verify, accept on the host, then catch the draft cache up."""
    proposal = propose(runtime, drafter, state, facts, batch.input_ids, u, batch.constraints, batch.history)
    rows, out = verify(runtime, state, facts.slots, batch.input_ids, proposal.tokens)
    emitted = accept(runtime, drafter.runtime.plan.topk_width, facts, proposal, out["logits"], u, out["argmax"].tolist())
    catch_up(drafter, state, facts, proposal.tokens, [s + len(e) for s, e in zip(rows.starts, emitted)],
             runtime.plan.inference.speculation_length)
    return Verified(emitted=emitted, logits=out["logits"], finite=out["finite"], drafted=proposal.drafted, bsz=rows.bsz,
                    bucket=rows.bucket)


def fused(runtime: Runtime, drafter: Drafter, state: State, batch: SpeculateBatch, facts: RowFacts, u: Uniforms) -> Verified:
    """The whole step in one call (``runtime/fused.py``)."""
    n, starts = len(facts.slots), [state.cache_lens[s] for s in facts.slots]
    k, dstate = runtime.plan.inference.speculation_length, drafter.state(state)
    for rt, st in ((runtime, state), (drafter.runtime, dstate)):  # blocks for every position the call may write
        reserve(rt.plan, st.kv, st.blocks, facts.slots, starts, [s + k for s in starts])
    inputs = fused_inputs(runtime, drafter.runtime, facts, batch.input_ids, starts, u, state.blocks, dstate.blocks)
    out = fused_step(runtime, drafter.runtime, drafter.phase, state.kv, drafter.state(state).kv, inputs, n, starts,
                     any(not sp.greedy for sp in facts.params), all(map(raw_argmax, facts.params, facts.generated)))
    emitted = [out["tokens"][r, :m].tolist() for r, m in enumerate(out["emitted"].tolist())]
    bucket = select_bucket(runtime.plan.decode_buckets, max(starts) + runtime.plan.inference.speculation_length)
    return Verified(emitted=emitted, logits=out["logits"], finite=out["finite"], drafted=None, bsz=batch_rows(runtime, drafter.runtime, n)[0],
                    bucket=bucket)


def fuses(runtime: Runtime, drafter: Drafter, batch: SpeculateBatch) -> bool:
    """Whether this step runs fused: the plan asks for it, a model drafts and no row has a
    grammar (its matcher masks each draft on the host)."""
    constrained = batch.constraints is not None and any(m is not None for m in batch.constraints)
    return runtime.plan.inference.fused_speculation and drafter.phase != "ngram" and not constrained


def speculate(runtime: Runtime, state: State, batch: SpeculateBatch) -> tuple[StepOutput, State]:
    """:func:`speculate_step` without its checks (``batch`` must be valid for ``state``)."""
    k, slots = runtime.plan.inference.speculation_length, list(batch.seq_ids)
    facts = RowFacts(slots=slots, params=list(batch.sampling), generated=[state.generated[s] for s in slots],
                     counts=state.output_counts[slots], prompt_mask=state.prompt_mask[slots])
    u, key = speculation_uniforms(state.rng_key, facts.params, facts.generated, k)
    drafter = drafter_of(runtime)
    v = (fused if fuses(runtime, drafter, batch) else unfused)(runtime, drafter, state, batch, facts, u)
    ends = [state.cache_lens[s] + len(e) for s, e in zip(slots, v.emitted)]
    draft = sync_draft(drafter, state, slots, ends)
    new = commit(state, slots, ends, v.emitted, key)
    # Finiteness of the positions the row's tokens came from (a NaN past them is a rejected draft's).
    finite = tuple(all(f[: len(e)]) for f, e in zip(v.finite.tolist(), v.emitted))
    out = StepOutput(tokens=tuple(e[-1] for e in v.emitted), new_tokens=tuple(tuple(e) for e in v.emitted), logits=None,
                     logprobs=emitted_logprobs(facts, v.logits, v.emitted), bucket=v.bucket, batch_size=v.bsz, finite=finite,
                     num_drafted=(k - 1,) * len(slots) if v.drafted is None else v.drafted)
    return out, new if draft is None else with_draft_state(new, draft)
