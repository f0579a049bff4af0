"""Acceptance of speculated tokens, pure of any graph: which of a row's k - 1 drafts the target
keeps (:func:`accept`), the random numbers a speculate step draws (:func:`speculation_uniforms`),
the sampler inputs at each speculated position (:func:`position_sampler`) and the logprobs of
the emitted tokens (:func:`emitted_logprobs`). ``speculate.py`` drives them.

Greedy rows accept the longest prefix of drafts equal to the target's argmax, plus the target's
next token: token-identical to plain greedy decoding. Sampled rows use rejection sampling
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", Algorithm
1; Chen et al. 2023): accept draft x with probability min(1, p(x) / q(x)), else resample from
normalise(max(p - q, 0)); the output distribution is the target's.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from neuronfx.config.inputs import SamplerInputs
from neuronfx.config.sampling import SamplingParams
from neuronfx.graphs.phases.sampling import distribution, inverse_cdf, penalized_logits, raw_logprobs
from neuronfx.graphs.phases.speculation import stack_positions
from neuronfx.runtime.batch import logits_bias, sampler_inputs, seeded_uniform
from neuronfx.runtime.pipeline import Logprobs, row_logprobs
from neuronfx.runtime.runtime import Runtime

Tensor = torch.Tensor


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


def raw_argmax(sp: SamplingParams, generated: int) -> bool:
    """Whether a row takes the argmax of its raw logits at every position of a speculate step:
    greedy, no penalties, no ``logit_bias`` and ``min_tokens`` reached (``generated`` tokens so
    far), so its penalized logits (``sampling.penalized_logits``) are its raw logits, bit for bit.
    (Acceptance then skips the (n, k, V) penalty pass: 5 ms of a 37 ms fp32 SmolLM2 prompt-lookup
    speculate step, measured.)"""
    return (sp.greedy and sp.repetition_penalty == 1.0 and sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0
            and not sp.logit_bias and generated >= sp.min_tokens)


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


@attrs.frozen
class RowFacts:
    """Host facts of the n rows of one speculate step."""

    slots: list[int]
    params: list[SamplingParams]
    generated: list[int]  # tokens each row's request generated before this step
    counts: Tensor  # (n, V) int32 their output counts before this step
    prompt_mask: Tensor  # (n, V) bool


def position_sampler(runtime: Runtime, rows: RowFacts, drafts: Sequence[Sequence[int]], i: int, rand: Tensor,
                     bitmask: Tensor | None = None) -> SamplerInputs:
    """The sampler inputs (n rows) for the token at speculated position ``i``: output counts
    including drafts d_1..d_i (the tokens emitted before it when they are accepted), the
    min_tokens bias at index generated + i and the position's token bitmask ((n, W) int32 or
    None: every token allowed)."""
    counts = rows.counts.clone()
    for r, row in enumerate(drafts):
        for t in row[:i]:
            counts[r, t] += 1
    bias = logits_bias(runtime, rows.params, [g + i for g in rows.generated])
    return sampler_inputs(runtime, rows.params, counts, rows.prompt_mask, bias, rand, len(rows.params), bitmask)


@attrs.frozen
class Proposal:
    """What the drafter proposed: ``tokens`` [n][k-1], and for each draft position the draft's
    logits (n, V), the sampler inputs (n rows) it drew with, from which q is computed, and the
    target's sampler inputs at that position (the same counts, bias and bitmask, ``top_k``
    packed for the target's width), which acceptance reuses; ``masks``: the token bitmask
    ((n, W) int32, or None) of each of the k positions, the last for the bonus token;
    ``drafted``: how many of each row's k - 1 tokens were proposed (prompt lookup pads its
    shorter proposals with filler, verified like the rest; None: all of them); ``raw_greedy``:
    every row :func:`raw_argmax` without a grammar, so the drafter may leave ``logits``,
    ``samplers`` and ``targets`` empty (acceptance takes the raw argmax)."""

    tokens: list[list[int]]
    logits: list[Tensor]
    samplers: list[SamplerInputs]
    targets: list[SamplerInputs]
    masks: list[Tensor | None]
    drafted: tuple[int, ...] | None = None  # [n] drafts each row's drafter really proposed, filler excluded (None: k - 1 each)
    raw_greedy: bool = False  # every row raw_argmax and none with a grammar: logits, samplers and targets may be empty


def accept(runtime: Runtime, draft_width: int, rows: RowFacts, proposal: Proposal, logits: Tensor, u: Uniforms,
           argmax: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """Each row's emitted tokens: greedy rows by :func:`accept_greedy` on the argmax of the
    penalized logits (n, k, V) at every position (of the raw logits when the proposal is
    ``raw_greedy`` or every row is :func:`raw_argmax` without a grammar mask: the same argmax,
    without the penalty pass; ``argmax``, the raw logits' argmax [n][k] when the verify graph
    gave it, else computed here), sampled rows by :func:`accept_sampled` with the
    target's p and the draft's q (top-k packed for the drafter's ``draft_width``) computed with
    the sampler inputs of each position."""
    n, k = logits.shape[:2]
    drafts = proposal.tokens
    if proposal.raw_greedy or (all(m is None for m in proposal.masks) and all(map(raw_argmax, rows.params, rows.generated))):
        return [accept_greedy(d, a) for d, a in zip(drafts, logits.argmax(-1).tolist() if argmax is None else argmax)]
    last = position_sampler(runtime, rows, drafts, k - 1, torch.zeros(n), proposal.masks[k - 1])
    stacked = stack_positions([*proposal.targets, last])
    flat_logits = logits.reshape(n * k, -1)
    argmax = penalized_logits(flat_logits, stacked).argmax(-1).reshape(n, k).tolist()
    p = q = None
    if any(not sp.greedy for sp in rows.params):
        p = distribution(flat_logits, stacked, runtime.plan.topk_width).reshape(n, k, -1)
        q = torch.stack([distribution(lg, s, draft_width) for lg, s in zip(proposal.logits, proposal.samplers)], 1)  # (n, k-1, V)
    out = []
    for r, sp in enumerate(rows.params):
        if sp.greedy:
            out.append(accept_greedy(drafts[r], argmax[r]))
        else:
            out.append(accept_sampled(drafts[r], q[r], p[r], u.accept[r], u.final[r]))
    return out


def emitted_logprobs(rows: RowFacts, logits: Tensor, emitted: list[list[int]]) -> tuple[tuple[Logprobs, ...] | None, ...]:
    """Raw logprobs of every emitted token at its position (``logits`` (n, k, V)), for rows that asked."""
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
