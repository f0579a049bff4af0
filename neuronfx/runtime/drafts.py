"""Who proposes the draft tokens of a speculate step (:class:`Drafter`, chosen once by
:func:`drafter_of`; :func:`propose`): self-speculation (the runtime's own "draft" graphs: its
first ``draft_layers`` layers, final norm and LM head, sharing its weights and KV cache), a draft
runtime attached with ``neuronfx.with_draft`` (its own KV cache in ``State.draft``, slot for
slot), or prompt lookup (``speculative_method="ngram"``, vLLM's: :func:`ngram_proposal`, no
graph; the batch carries each row's ``history``). Each draft is sampled with the row's
parameters and the same penalty counts, bias and token bitmask the target applies at its
position (:class:`DraftWalk` walks a row's grammar through its drafts). ``speculate.py`` runs the
step; ``fused.py`` drafts inside one call instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from neuronfx.config.sampling import SamplingParams
from neuronfx.graphs.phases.sampling import sample
from neuronfx.runtime.acceptance import Proposal, RowFacts, Uniforms, position_sampler, raw_argmax
from neuronfx.runtime.batch import sampler_inputs
from neuronfx.runtime.ngram import ngram_propose
from neuronfx.runtime.pipeline import plan_rows, run_rows
from neuronfx.runtime.runtime import Runtime
from neuronfx.runtime.state import State
from neuronfx.runtime.structured import Constraints, token_bitmask

Tensor = torch.Tensor
GREEDY = SamplingParams()



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

    def state(self, state: State) -> State:
        """The state whose KV cache (and blocks) this drafter writes: ``state.draft`` or ``state``."""
        return state.draft if self.own_cache else state


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
    out = run_rows(drt, drafter.state(state), step, sampler)
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
    all the same, its filler accepted only where the target agrees). When every row is
    ``acceptance.raw_argmax`` and none has a grammar, the proposal is ``raw_greedy`` and carries
    no draft logits or sampler inputs (acceptance reads none)."""
    inf = runtime.plan.inference
    k, n, vocab = inf.speculation_length, len(rows.slots), runtime.plan.model.vocab_size
    found = [list(ngram_propose(h, k - 1, inf.prompt_lookup_min, inf.prompt_lookup_max)) for h in history]
    if constraints is not None:  # a matcher must never consume a token its grammar refuses
        found = [f[: m.validate(f)] if m is not None and f else f for f, m in zip(found, constraints)]
    raw = all(map(raw_argmax, rows.params, rows.generated)) and all(m is None for m in constraints or ())
    if not raw:
        zeros = torch.zeros(n, vocab)
        greedy = sampler_inputs(runtime, [GREEDY] * n, zeros.int(), zeros.bool(), zeros, torch.zeros(n), n)
    proposal = Proposal(tokens=[[] for _ in range(n)], logits=[], samplers=[], targets=[], masks=[],
                        drafted=tuple(len(f) for f in found), raw_greedy=raw)
    walk = DraftWalk(constraints)
    try:  # the matchers are net unchanged even when a mask is refused
        for i in range(k - 1):
            mask = walk.mask(runtime, rows, i)
            for r, row in enumerate(proposal.tokens):
                allowed = mask[r] if mask is not None and walk.walking(r) else None
                row.append(found[r][i] if i < len(found[r]) else _filler(row, x0[r], allowed))
            proposal.masks.append(mask)
            if not raw:  # what sampled acceptance reads (q, p and their samplers); raw greedy rows need none of it
                drafts = torch.tensor([[row[i]] for row in proposal.tokens])
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
