"""Speculative decoding as a step: ``speculate_step`` drafts k - 1 tokens per row, verifies them
(plus the row's last token) in one "speculate" pass of T = k tokens per row, and accepts 1 to k
tokens (``acceptance.py``); and :func:`follow_draft`, which keeps a draft runtime's cache in
step with the target's through any other step.

Drafts, behind one small interface (:class:`Drafter`, chosen once by :func:`drafter_of`;
:func:`propose`): self-speculation (the runtime's own "draft" graphs: its first
``draft_layers`` layers, final norm and LM head, sharing its weights and KV cache), a draft
runtime attached with ``neuronfx.with_draft`` (its own KV cache in ``State.draft``, slot for
slot), or prompt lookup (``speculative_method="ngram"``, vLLM's: :func:`ngram_proposal`, no
graph; the batch carries each row's ``history``).

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

from neuronfx.config.sampling import SamplingParams
from neuronfx.errors import ConfigError, InputError
from neuronfx.graphs.phases.inputs import KVCache
from neuronfx.graphs.phases.sampling import sample
from neuronfx.runtime.acceptance import (
    Proposal,
    RowFacts,
    Uniforms,
    accept,
    emitted_logprobs,
    position_sampler,
    speculation_uniforms,
)
from neuronfx.runtime.batch import sampler_inputs
from neuronfx.runtime.checks import check_decode, check_room, check_token_ids, row_values, token_rows
from neuronfx.runtime.ngram import ngram_propose
from neuronfx.runtime.pipeline import Rows, StepOutput, commit, plan_rows, run_rows
from neuronfx.runtime.runtime import Runtime, check_runtime
from neuronfx.runtime.state import State, advance, with_draft_state
from neuronfx.runtime.structured import Constraints, constraint_rows, token_bitmask

Tensor = torch.Tensor
GREEDY = SamplingParams()


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


# --- drafts -------------------------------------------------------------------------------------


@attrs.frozen
class Drafter:
    """Who proposes the draft tokens of a runtime, decided once (:func:`drafter_of`):

    - ``runtime``: the runtime whose graphs draft (the target itself, or its draft runtime);
    - ``phase``: the graphs it runs ("draft": the target's first ``draft_layers`` layers;
      "decode": the draft runtime's own; "ngram": none, prompt lookup);
    - ``own_cache``: whether it drafts into a KV cache of its own (``State.draft``), which must
      then follow the target's accepted length; else it shares the target's cache.
    """

    runtime: Runtime
    phase: str
    own_cache: bool

    def kv(self, state: State) -> KVCache:
        """The KV cache this drafter writes in ``state``."""
        return state.draft.kv if self.own_cache else state.kv


def drafter_of(runtime: Runtime) -> Drafter:
    """The drafter of a runtime that can speculate: its draft runtime when one is attached
    (``with_draft``), prompt lookup for ``speculative_method="ngram"``, else self-speculation
    through its "draft" graphs."""
    if runtime.draft is not None:
        return Drafter(runtime=runtime.draft, phase="decode", own_cache=True)
    if runtime.plan.inference.speculative_method == "ngram":
        return Drafter(runtime=runtime, phase="ngram", own_cache=False)
    return Drafter(runtime=runtime, phase="draft", own_cache=False)


def propose(runtime: Runtime, drafter: Drafter, state: State, rows: RowFacts, x0: Sequence[int], u: Uniforms,
            constraints: Constraints = None, history: Sequence[Sequence[int]] | None = None) -> Proposal:
    """k - 1 draft tokens per row after ``x0`` at positions cache_len .. cache_len + k - 2, from
    ``drafter``'s graphs on its KV cache (one token per row per pass). Each draft token is
    sampled with the row's parameters and the same penalty counts, bias and token bitmask the
    target applies at that position (``top_k`` packed for the drafter's static width). A row's
    matcher in ``constraints`` is advanced through the row's drafts (each mask is the one after
    the drafts before it; the k-th, for the bonus token, after all of them) and rolled back.
    A "ngram" drafter proposes by prompt lookup over ``history`` instead (:func:`ngram_proposal`)."""
    if drafter.phase == "ngram":
        return ngram_proposal(runtime, rows, x0, history, u, constraints)
    k = runtime.plan.inference.speculation_length
    proposal = Proposal(tokens=[[] for _ in rows.slots], logits=[], samplers=[], targets=[], masks=[])
    walk = DraftWalk(constraints)
    try:  # the matchers are net unchanged even when a mask is refused
        for i in range(k - 1):
            draft_position(runtime, drafter, state, rows, x0, u.draft[:, i], proposal, walk.mask(runtime, rows, i))
            walk.advance([row[-1] for row in proposal.tokens])
        proposal.masks.append(walk.mask(runtime, rows, k - 1))
    finally:
        walk.rollback()
    return proposal


def draft_position(runtime: Runtime, drafter: Drafter, state: State, rows: RowFacts, x0: Sequence[int], rand: Tensor,
                   proposal: Proposal, mask: Tensor | None) -> None:
    """Draft the token at position i = len(proposal.masks) of every row (one pass of the
    drafter's graph) under ``mask`` ((n, W) int32 or None) and append it, its logits, its
    sampler and the target's sampler at that position to ``proposal``."""
    i, n, drt = len(proposal.masks), len(rows.slots), drafter.runtime
    proposal.masks.append(mask)
    last = [(x if i == 0 else row[-1],) for x, row in zip(x0, proposal.tokens)]
    step = plan_rows(drt, drafter.phase, drt.plan.decode_buckets, rows.slots, last,
                     [state.cache_lens[s] + i for s in rows.slots], width=1)
    target = position_sampler(runtime, rows, proposal.tokens, i, rand, mask)
    sampler = sampler_inputs(drt, rows.params, target.output_counts, target.prompt_mask, target.logits_bias, target.rand,
                             step.bsz, mask)
    out = run_rows(drt, drafter.kv(state), step, sampler)
    if not drt.plan.inference.on_device_sampling:  # the draft's tokens from its logits, on the host
        out = out | sample(out["logits"], sampler, drt.plan.topk_width, 0)
    for row, t in zip(proposal.tokens, out["tokens"][:n].tolist()):
        row.append(t)
    proposal.logits.append(out["logits"][:n])
    proposal.samplers.append(type(sampler)(*(t[:n] for t in sampler)))
    proposal.targets.append(target)


def ngram_proposal(runtime: Runtime, rows: RowFacts, x0: Sequence[int], history: Sequence[Sequence[int]], u: Uniforms,
                   constraints: Constraints = None) -> Proposal:
    """k - 1 drafts per row by prompt lookup (``ngram.ngram_propose`` over the row's
    ``history`` with ``prompt_lookup_min`` / ``prompt_lookup_max``; a structured row's lookup is
    cut where its grammar refuses it), padded to k - 1 with filler (:func:`_filler`). Each
    draft's logits (n, V) are one-hot at the draft and drawn "greedy" with zero counts and bias,
    so acceptance's q is one-hot there: greedy rows stay token-identical to plain decoding and
    sampled rows keep the target's distribution (rejection sampling with a deterministic draft).
    The target's sampler and mask at each position are as for any drafter (:class:`DraftWalk`).
    ``Proposal.drafted``: each row's lookup length (0 when nothing matched: the row is verified
    all the same, its filler accepted only where the target agrees)."""
    inf = runtime.plan.inference
    k, n, vocab = inf.speculation_length, len(rows.slots), runtime.plan.model.vocab_size
    found = [list(ngram_propose(h, k - 1, inf.prompt_lookup_min, inf.prompt_lookup_max)) for h in history]
    if constraints is not None:  # a matcher must never consume a token its grammar refuses
        found = [f[: m.validate(f)] if m is not None and f else f for f, m in zip(found, constraints)]
    zeros = torch.zeros(n, vocab)
    greedy = sampler_inputs(runtime, [GREEDY] * n, zeros.int(), zeros.bool(), zeros, torch.zeros(n), n)
    proposal = Proposal(tokens=[[] for _ in range(n)], logits=[], samplers=[], targets=[], masks=[],
                        drafted=tuple(len(f) for f in found))
    walk = DraftWalk(constraints)
    try:  # the matchers are net unchanged even when a mask is refused
        for i in range(k - 1):
            mask = walk.mask(runtime, rows, i)
            for r, row in enumerate(proposal.tokens):
                allowed = mask[r] if mask is not None and walk.walking(r) else None
                row.append(found[r][i] if i < len(found[r]) else _filler(row, x0[r], allowed))
            drafts = torch.tensor([[row[i]] for row in proposal.tokens])
            proposal.masks.append(mask)
            proposal.targets.append(position_sampler(runtime, rows, proposal.tokens, i, u.draft[:, i], mask))
            proposal.logits.append(zeros.scatter(1, drafts, 1.0))
            proposal.samplers.append(greedy)
            walk.advance([row[i] for row in proposal.tokens])
        proposal.masks.append(walk.mask(runtime, rows, k - 1))
    finally:
        walk.rollback()
    return proposal


def _filler(row: Sequence[int], x0: int, allowed: Tensor | None) -> int:
    """A padding draft: with ``allowed`` (the (W,) int32 bitmask of a row whose grammar is
    walking) the first token it allows (its matcher must accept every draft), else the row's
    last token (``x0`` before any draft). Filler is verified like any draft."""
    if allowed is not None:
        words = torch.nonzero(allowed).flatten()
        if len(words):
            w = int(words[0])
            word = int(allowed[w]) & 0xFFFFFFFF
            return w * 32 + (word & -word).bit_length() - 1
    return row[-1] if row else x0


class DraftWalk:
    """The row matchers of a speculate step walked through its drafts: :meth:`mask` at each
    position, :meth:`advance` over the drafts just sampled, :meth:`rollback` at the end (net
    unchanged). A row whose matcher stopped (its grammar complete) masks nothing after: its
    request ends at that token and the later ones are dropped."""

    def __init__(self, constraints: Constraints) -> None:
        self.constraints = constraints
        self.consumed = [0] * (0 if constraints is None else len(constraints))
        self.live = [m is not None for m in constraints or ()]

    def mask(self, runtime: Runtime, rows: RowFacts, i: int) -> Tensor | None:
        """(n, W) int32 bitmask of speculated position ``i`` (None: no row constrained)."""
        if self.constraints is None:
            return None
        walking = tuple(m if live else None for m, live in zip(self.constraints, self.live))
        model = runtime.plan.model
        return token_bitmask(walking, rows.params, [g + i for g in rows.generated], model.eos_token_ids, model.vocab_size)

    def walking(self, r: int) -> bool:
        """Whether row ``r`` has a matcher that still masks (not stopped, not in error)."""
        return self.constraints is not None and self.constraints[r] is not None and self.live[r]

    def advance(self, tokens: Sequence[int]) -> None:
        """Each live row's matcher consumes its new draft; one that stops is no longer masked."""
        for r, (m, t) in enumerate(zip(self.constraints or (), tokens)):
            if self.live[r] and m is not None:
                if not m.consume([t]):  # a draft is always drawn under the mask; an error leaves it unmasked
                    self.live[r] = False
                    continue
                self.consumed[r] += 1
                self.live[r] = not m.is_stopped()

    def rollback(self) -> None:
        """Undo every draft consumed."""
        for m, n in zip(self.constraints or (), self.consumed):
            if m is not None:
                m.rollback(n)


def sync_draft(drafter: Drafter, state: State, rows: RowFacts, drafts: list[list[int]], ends: list[int], k: int) -> State | None:
    """A drafter with its own cache, after the target accepted up to ``ends``: a row that
    accepted every draft feeds the last one (the draft never consumed it), then every row's
    draft cache_len is set to the target's (positions past it are stale and never read).
    Returns the draft's new state, or None for a drafter sharing the target's cache."""
    if not drafter.own_cache:
        return None
    draft, dstate = drafter.runtime, state.draft
    full = [r for r, s in enumerate(rows.slots) if ends[r] == state.cache_lens[s] + k]
    if full:
        slots = [rows.slots[r] for r in full]
        step = plan_rows(draft, "decode", draft.plan.decode_buckets, slots, [(drafts[r][-1],) for r in full],
                         [dstate.cache_lens[s] + k - 1 for s in slots], width=1)
        zeros = torch.zeros(len(full), draft.plan.model.vocab_size)
        run_rows(draft, dstate.kv, step, sampler_inputs(draft, [GREEDY] * len(full), zeros.int(), zeros.bool(), zeros,
                                                        torch.zeros(len(full)), step.bsz))
    lens = list(dstate.cache_lens)
    for s, end in zip(rows.slots, ends):
        lens[s] = end
    return advance(dstate, cache_lens=tuple(lens), generated=dstate.generated, live=dstate.live, rng_key=dstate.rng_key)


# --- the step -----------------------------------------------------------------------------------


def check_speculate(runtime: Runtime) -> None:
    """Raise ConfigError unless ``runtime`` can speculate (``Runtime.can_speculate``)."""
    inf = runtime.plan.inference
    if inf.speculation_length < 2:
        raise ConfigError("this runtime has no speculate graphs: compile with InferenceConfig(speculation_length=k >= 2).")
    if not runtime.can_speculate:
        raise ConfigError("this runtime has no draft: compile with draft_layers=N (self-speculation) or "
                          "speculative_method='ngram' (prompt lookup), or attach a draft runtime with "
                          "neuronfx.with_draft(runtime, draft_runtime).")


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
    return speculate(runtime, state, batch)


def verify(runtime: Runtime, state: State, slots: Sequence[int], x0: Sequence[int], drafts: list[list[int]]) -> tuple[Rows, Tensor]:
    """The verify pass: T = k tokens per row (its last token, then its drafts) from its slot's
    cache_len; (its Rows, the target's logits (n, k, V) float32)."""
    k = runtime.plan.inference.speculation_length
    rows = plan_rows(runtime, "speculate", runtime.plan.decode_buckets, slots, [[x, *d] for x, d in zip(x0, drafts)],
                     [state.cache_lens[s] for s in slots], width=k)
    return rows, run_rows(runtime, state.kv, rows)["logits"][: len(slots)]


def speculate(runtime: Runtime, state: State, batch: SpeculateBatch) -> tuple[StepOutput, State]:
    """:func:`speculate_step` without its checks (``batch`` must be valid for ``state``)."""
    k, slots = runtime.plan.inference.speculation_length, list(batch.seq_ids)
    facts = RowFacts(slots=slots, params=list(batch.sampling), generated=[state.generated[s] for s in slots],
                     counts=state.output_counts[slots], prompt_mask=state.prompt_mask[slots])
    u, key = speculation_uniforms(state.rng_key, facts.params, facts.generated, k)
    drafter = drafter_of(runtime)
    proposal = propose(runtime, drafter, state, facts, batch.input_ids, u, batch.constraints, batch.history)
    rows, logits = verify(runtime, state, slots, batch.input_ids, proposal.tokens)
    emitted = accept(runtime, drafter.runtime.plan.topk_width, facts, proposal, logits, u)
    ends = [start + len(e) for start, e in zip(rows.starts, emitted)]
    draft = sync_draft(drafter, state, facts, proposal.tokens, ends, k)
    new = commit(state, slots, ends, emitted, key)
    n = len(slots)
    # Finiteness of the positions the row's tokens came from (a NaN past them is a rejected draft's).
    finite = tuple(bool(torch.isfinite(logits[r, : len(e)]).all()) for r, e in enumerate(emitted))
    out = StepOutput(tokens=tuple(e[-1] for e in emitted), new_tokens=tuple(tuple(e) for e in emitted), logits=None,
                     logprobs=emitted_logprobs(facts, logits, emitted), bucket=rows.bucket, batch_size=rows.bsz, finite=finite,
                     num_drafted=(k - 1,) * n if proposal.drafted is None else proposal.drafted)
    return out, new if draft is None else with_draft_state(new, draft)
