"""Speculative decoding as a step: ``speculate_step`` drafts k - 1 tokens per row, verifies them
(plus the row's last token) in one "speculate" pass of k query tokens, and accepts 1 to k tokens.

Drafts, behind one small interface (:class:`Drafter`, chosen once by :func:`drafter_of`;
:func:`propose`): self-speculation (the runtime's own
"draft" graphs: its first ``draft_layers`` layers, final norm and LM head, sharing its weights
and KV cache) or a draft runtime attached with ``neuronfx.with_draft`` (its own KV cache in
``State.draft``, slot for slot).

Acceptance applies every SamplingParams field at every verified position exactly as a decode
step would: the logit bias of min_tokens, the penalties over the counts including the tokens
accepted before that position, temperature, top-k, min_p, top-p. Greedy rows accept the longest
prefix of drafts equal to the target's argmax, plus the target's next token: token-identical to
plain greedy decoding. Sampled rows use rejection sampling (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023): accept
draft x with probability min(1, p(x) / q(x)), else resample from normalise(max(p - q, 0)); the
output distribution is the target's. A seeded row draws every uniform from (seed, token index,
stream), so a seeded speculative request is reproducible whatever shares its batch.

KV consistency without copies: a verify pass writes k positions; the slot's cache_len is then
set to the accepted length, and positions past it are never attended (masks are
``j <= position``) and are overwritten by the next write.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from neuronfx.config.buckets import select_bucket
from neuronfx.config.inputs import SamplerInputs, SpeculateInputs
from neuronfx.config.sampling import SamplingParams
from neuronfx.errors import ConfigError
from neuronfx.graphs.inputs import KVCache
from neuronfx.graphs.sampling import distribution, inverse_cdf, penalized_logits, raw_logprobs, sample
from neuronfx.runtime.batch import call_graph, min_tokens_bias, sampler_inputs, seeded_uniform, token_inputs
from neuronfx.runtime.runtime import Runtime, check_runtime
from neuronfx.runtime.state import State, advance
from neuronfx.runtime.steps import (
    Logprobs,
    StepOutput,
    check_decode,
    check_params,
    check_room,
    count_tokens,
    one_token,
    row_logprobs,
    row_values,
)

Tensor = torch.Tensor


@attrs.frozen(kw_only=True)
class SpeculateBatch:
    """Up to k = ``speculation_length`` tokens for each of the live slots ``seq_ids``."""

    seq_ids: tuple[int, ...] = attrs.field(converter=row_values("seq_ids"))  # [n] live slots, distinct
    input_ids: tuple[int, ...] = attrs.field(converter=row_values("input_ids"))  # [n] last token of each row, not yet cached
    sampling: tuple[SamplingParams, ...] = attrs.field(converter=row_values("sampling"))  # [n]


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


# --- acceptance (pure) -------------------------------------------------------------------------


def accept_greedy(drafts: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """Emitted tokens: drafts d_1..d_{k-1} accepted while d_i == argmax after position i - 1,
    then the target's own next token. ``target_argmax``: k ids (after x0, d_1, ..., d_{k-1})."""
    out = []
    for d, t in zip(drafts, target_argmax):
        if d != t:
            break
        out.append(d)
    out.append(target_argmax[len(out)])
    return out


def accept_sampled(drafts: Sequence[int], q: Tensor, p: Tensor, accept_u: Tensor, final_u: Tensor) -> list[int]:
    """Rejection sampling. q: (k-1, V) draft distributions the drafts were drawn from; p: (k, V)
    target distributions; accept_u: (k-1,) and final_u: (k,) uniforms in [0, 1), the latter
    drawing the resampled (or bonus) token at its position by inverse CDF. Returns the emitted
    tokens (1..k)."""
    out = []
    for i, d in enumerate(drafts):
        if accept_u[i] * q[i, d] < p[i, d]:  # accept with min(1, p/q); q[i, d] > 0 (d was drawn from q)
            out.append(d)
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        target = residual if residual.sum() > 0 else p[i]  # p == q everywhere: rejection had probability 0
        out.append(int(inverse_cdf(target[None], final_u[i : i + 1])[0]))
        return out
    k = len(drafts)
    out.append(int(inverse_cdf(p[k][None], final_u[k : k + 1])[0]))
    return out


# --- random numbers -----------------------------------------------------------------------------


@attrs.frozen
class Uniforms:
    """The uniforms of one speculate step: ``draft`` (n, k-1) for drafting, ``accept`` (n, k-1)
    for acceptance tests, ``final`` (n, k) for the resampled or bonus token at each position."""

    draft: Tensor
    accept: Tensor
    final: Tensor


def speculation_uniforms(key: int, params: Sequence[SamplingParams], generated: Sequence[int], k: int) -> tuple[Uniforms, int]:
    """(the step's uniforms, next RNG key). Unseeded rows draw from the state's key; a seeded
    row's uniform for position i comes from (seed, generated + i, stream) (streams 1, 2, 3)."""
    n = len(params)
    g = torch.Generator().manual_seed(key)
    u = Uniforms(draft=torch.rand(n, k - 1, generator=g), accept=torch.rand(n, k - 1, generator=g), final=torch.rand(n, k, generator=g))
    for r, (sp, done) in enumerate(zip(params, generated)):
        if sp.seed is None:
            continue
        for i in range(k):
            if i < k - 1:
                u.draft[r, i] = seeded_uniform(sp.seed, done + i, 1)
                u.accept[r, i] = seeded_uniform(sp.seed, done + i, 2)
            u.final[r, i] = seeded_uniform(sp.seed, done + i, 3)
    return u, int(torch.randint(0, 2**62, (1,), generator=g))


# --- the sampler at each speculated position ----------------------------------------------------


@attrs.frozen
class Rows:
    """Host facts of the n rows of one speculate step."""

    slots: list[int]
    params: list[SamplingParams]
    generated: list[int]  # tokens each row's request generated before this step
    counts: Tensor  # (n, V) int32 their output counts before this step
    prompt_mask: Tensor  # (n, V) bool


def position_sampler(runtime: Runtime, rows: Rows, drafts: Sequence[Sequence[int]], i: int, rand: Tensor) -> SamplerInputs:
    """The sampler inputs (n rows) for the token at speculated position ``i``: output counts
    including drafts d_1..d_i (the tokens emitted before it when they are accepted) and the
    min_tokens bias at index generated + i."""
    counts = rows.counts.clone()
    for r, row in enumerate(drafts):
        for t in row[:i]:
            counts[r, t] += 1
    bias = min_tokens_bias(runtime, rows.params, [g + i for g in rows.generated])
    return sampler_inputs(runtime, rows.params, counts, rows.prompt_mask, bias, rand, len(rows.params))


def _stack(samplers: Sequence[SamplerInputs]) -> SamplerInputs:
    """Row r, position i -> row r * k + i of one record (k = len(samplers))."""
    return SamplerInputs(*(torch.stack(column, 1).flatten(0, 1) for column in zip(*samplers)))


# --- drafts -------------------------------------------------------------------------------------


@attrs.frozen
class Drafter:
    """Who proposes the draft tokens of a runtime, decided once (:func:`drafter_of`):

    - ``runtime``: the runtime whose graphs draft (the target itself, or its draft runtime);
    - ``phase``: the graphs it runs ("draft": the target's first ``draft_layers`` layers;
      "decode": the draft runtime's own);
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
    (``with_draft``), else self-speculation through its "draft" graphs."""
    if runtime.draft is not None:
        return Drafter(runtime=runtime.draft, phase="decode", own_cache=True)
    return Drafter(runtime=runtime, phase="draft", own_cache=False)


@attrs.frozen
class Proposal:
    """What the drafter proposed: ``tokens`` [n][k-1], and for each draft position the draft's
    logits (n, V), the sampler inputs (n rows) it drew with, from which q is computed, and the
    target's sampler inputs at that position (the same counts and bias, ``top_k`` packed for the
    target's width), which acceptance reuses."""

    tokens: list[list[int]]
    logits: list[Tensor]
    samplers: list[SamplerInputs]
    targets: list[SamplerInputs]


def propose(runtime: Runtime, drafter: Drafter, state: State, rows: Rows, x0: Sequence[int], u: Uniforms) -> Proposal:
    """k - 1 draft tokens per row after ``x0`` at positions cache_len .. cache_len + k - 2, from
    ``drafter``'s graphs on its KV cache. Each draft token is sampled with the row's parameters
    and the same penalty counts and bias the target applies at that position (``top_k`` packed
    for the drafter's static width)."""
    k, n = runtime.plan.inference.speculation_length, len(rows.slots)
    kv, phase, drafter_rt = drafter.kv(state), drafter.phase, drafter.runtime
    bsz = select_bucket(drafter_rt.plan.batch_buckets, n, "batch rows")
    proposal = Proposal(tokens=[[] for _ in rows.slots], logits=[], samplers=[], targets=[])
    for i in range(k - 1):
        last = [x if i == 0 else row[-1] for x, row in zip(x0, proposal.tokens)]
        positions = [state.cache_lens[s] + i for s in rows.slots]
        target = position_sampler(runtime, rows, proposal.tokens, i, u.draft[:, i])
        sampler = sampler_inputs(drafter_rt, rows.params, target.output_counts, target.prompt_mask, target.logits_bias,
                                 target.rand, bsz)
        out, _, _ = one_token(drafter_rt, kv, phase, rows.slots, last, positions, sampler, n)
        if not drafter_rt.plan.inference.on_device_sampling:  # the draft's tokens from its logits, on the host
            out = out | sample(out["logits"], sampler, drafter_rt.plan.topk_width, 0)
        for row, t in zip(proposal.tokens, out["tokens"][:n].tolist()):
            row.append(t)
        proposal.logits.append(out["logits"][:n])
        proposal.samplers.append(SamplerInputs(*(t[:n] for t in sampler)))
        proposal.targets.append(target)
    return proposal


def _sync_draft(runtime: Runtime, drafter: Drafter, state: State, rows: Rows, drafts: list[list[int]], new_lens: list[int],
                ) -> State | None:
    """A drafter with its own cache, after the target accepted ``new_lens``: a row that
    accepted every draft feeds the last one (the draft never consumed it), then every row's
    draft cache_len is set to the target's (positions past it are stale and never read).
    Returns the draft's new state, or None for a drafter sharing the target's cache."""
    if not drafter.own_cache:
        return None
    draft, dstate, k = drafter.runtime, state.draft, runtime.plan.inference.speculation_length
    full = [r for r, s in enumerate(rows.slots) if new_lens[r] == state.cache_lens[s] + k]
    if full:
        slots = [rows.slots[r] for r in full]
        n = len(full)
        bsz = select_bucket(draft.plan.batch_buckets, n, "batch rows")
        greedy = [SamplingParams()] * n
        zeros = torch.zeros(n, draft.plan.model.vocab_size)
        sampler = sampler_inputs(draft, greedy, zeros.int(), zeros.bool(), zeros, torch.zeros(n), bsz)
        one_token(draft, dstate.kv, "decode", slots, [drafts[r][-1] for r in full], [dstate.cache_lens[s] + k - 1 for s in slots],
                  sampler, n)
    lens = list(dstate.cache_lens)
    for s, new in zip(rows.slots, new_lens):
        lens[s] = new
    return advance(dstate, cache_lens=tuple(lens), generated=dstate.generated, live=dstate.live, rng_key=dstate.rng_key)


# --- the step -----------------------------------------------------------------------------------


def check_speculate(runtime: Runtime) -> None:
    """Raise ConfigError unless ``runtime`` can speculate (``Runtime.can_speculate``)."""
    inf = runtime.plan.inference
    if inf.speculation_length < 2:
        raise ConfigError("this runtime has no speculate graphs: compile with InferenceConfig(speculation_length=k >= 2).")
    if not runtime.can_speculate:
        raise ConfigError("this runtime has no draft: compile with draft_layers=N (self-speculation) or attach a draft "
                          "runtime with neuronfx.with_draft(runtime, draft_runtime).")


def speculate_step(runtime: Runtime, state: State, batch: SpeculateBatch) -> tuple[StepOutput, State]:
    """Up to k = ``speculation_length`` tokens for each live slot in ``batch.seq_ids``, feeding
    ``batch.input_ids``: k - 1 drafted tokens (:func:`propose`) and the last token are verified
    in one (speculate, batch bucket >= n rows, KV bucket >= longest cache_len + k) pass, and
    every row accepts 1 to k tokens (``StepOutput.new_tokens``; ``tokens`` holds each row's last,
    the next step's input). Every SamplingParams field applies as in :func:`decode_step`;
    logprobs come one per new token. The slot's cache_len grows by the accepted count.

    Raises (before any change) ConfigError (no speculate graphs or no draft), the errors of
    :func:`decode_step`, and SequenceLengthExceededError when a slot has no room for k more
    tokens (decode that row with ``decode_step``).
    """
    check_runtime(runtime)
    check_speculate(runtime)
    plan = runtime.plan
    check_decode(runtime, state, batch, SpeculateBatch)
    k = plan.inference.speculation_length
    check_room(state, batch.seq_ids, k, plan.inference.sequence_length,
               f"speculation writes k={k} positions: decode that row with decode_step instead.")
    check_params(runtime, batch.sampling)

    slots, n = list(batch.seq_ids), len(batch.seq_ids)
    rows = Rows(slots=slots, params=list(batch.sampling), generated=[state.generated[s] for s in slots],
                counts=state.output_counts[slots], prompt_mask=state.prompt_mask[slots])
    u, next_key = speculation_uniforms(state.rng_key, rows.params, rows.generated, k)
    drafter = drafter_of(runtime)
    proposal = propose(runtime, drafter, state, rows, batch.input_ids, u)
    drafts = proposal.tokens

    start = [state.cache_lens[s] for s in slots]
    bsz = select_bucket(plan.batch_buckets, n, "batch rows")
    bucket = select_bucket(plan.decode_buckets, max(start) + k, "attended KV length")
    seqs = [[x, *row] for x, row in zip(batch.input_ids, drafts)]
    ids, pos, seq_ids = token_inputs(runtime, bsz, k, slots, seqs, start)
    logits = call_graph(runtime, state.kv, "speculate", bsz, bucket, SpeculateInputs(input_ids=ids, position_ids=pos, seq_ids=seq_ids))
    logits = logits["logits"][:n]  # (n, k, V)

    emitted = _accept(runtime, drafter, rows, proposal, logits, u)
    logprobs = _logprobs(rows, logits, emitted)
    new_lens = [c + len(e) for c, e in zip(start, emitted)]
    draft = _sync_draft(runtime, drafter, state, rows, drafts, new_lens)
    cache_lens, generated = list(state.cache_lens), list(state.generated)
    for s, e in zip(slots, emitted):
        cache_lens[s] += len(e)
        generated[s] += len(e)
    # Finiteness of the positions the row's tokens came from (a NaN past them is a rejected draft's).
    finite = tuple(bool(torch.isfinite(logits[r, : len(e)]).all()) for r, e in enumerate(emitted))
    new = advance(state, cache_lens=tuple(cache_lens), generated=tuple(generated), live=state.live, rng_key=next_key, draft=draft)
    count_tokens(new, slots, emitted)
    new_tokens = tuple(tuple(e) for e in emitted)
    return StepOutput(tokens=tuple(e[-1] for e in emitted), new_tokens=new_tokens, logits=None, logprobs=logprobs,
                      bucket=bucket, batch_size=bsz, finite=finite, num_drafted=(k - 1,) * n), new


def _accept(runtime: Runtime, drafter: Drafter, rows: Rows, proposal: Proposal, logits: Tensor, u: Uniforms) -> list[list[int]]:
    """Each row's emitted tokens: greedy rows by :func:`accept_greedy` on the argmax of the
    penalized logits at every position, sampled rows by :func:`accept_sampled` with the target's
    p and the draft's q computed with the sampler inputs of each position."""
    n, k = logits.shape[:2]
    drafts = proposal.tokens
    samplers = [*proposal.targets, position_sampler(runtime, rows, drafts, k - 1, torch.zeros(n))]
    stacked = _stack(samplers)
    flat_logits = logits.reshape(n * k, -1)
    argmax = penalized_logits(flat_logits, stacked).argmax(-1).reshape(n, k).tolist()
    sampled = [r for r, sp in enumerate(rows.params) if not sp.greedy]
    p = q = None
    if sampled:
        p = distribution(flat_logits, stacked, runtime.plan.topk_width).reshape(n, k, -1)
        width = drafter.runtime.plan.topk_width
        q = torch.stack([distribution(lg, s, width) for lg, s in zip(proposal.logits, proposal.samplers)], 1)  # (n, k-1, V)
    out = []
    for r, sp in enumerate(rows.params):
        if sp.greedy:
            out.append(accept_greedy(drafts[r], argmax[r]))
        else:
            out.append(accept_sampled(drafts[r], q[r], p[r], u.accept[r], u.final[r]))
    return out


def _logprobs(rows: Rows, logits: Tensor, emitted: list[list[int]]) -> tuple[tuple[Logprobs, ...] | None, ...]:
    """Raw logprobs of every emitted token at its position, for rows that asked."""
    out: list[tuple[Logprobs, ...] | None] = []
    for r, (sp, tokens) in enumerate(zip(rows.params, emitted)):
        if sp.logprobs is None:
            out.append(None)
            continue
        m = len(tokens)
        raw = torch.log_softmax(logits[r, :m], dim=-1)  # (m, V)
        lp = raw_logprobs(raw, torch.tensor(tokens, dtype=torch.int32), max(sp.logprobs, 1))
        out.append(tuple(row_logprobs(lp, i, t, sp.logprobs) for i, t in enumerate(tokens)))
    return tuple(out)
