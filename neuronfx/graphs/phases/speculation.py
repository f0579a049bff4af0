"""Speculation as tensor code, for fused speculation (``runtime/fused.py``): the sampler inputs
at each speculated position (:func:`position_sampler`, :func:`with_drafts`) and the acceptance of
a speculate step for every row at once (:func:`accept_rows`). Static shapes, no host sync, no
per-row Python: what ``runtime/acceptance.py`` computes row by row on the host, with the same
functions of ``sampling.py`` in the same order, so both give the same tokens from the same
uniforms.

Acceptance (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
Algorithm 1; Chen et al. 2023): a greedy row keeps the longest prefix of drafts equal to the
target's argmax and then the target's own token; a sampled row accepts draft x with probability
min(1, p(x) / q(x)) and at the first rejection draws from normalise(max(p - q, 0)) (from p
where p == q), or after k - 1 acceptances the bonus token from p.
"""

from __future__ import annotations

import torch

from neuronfx.config.inputs import FusedSpeculateInputs, SamplerInputs
from neuronfx.config.sampling import GREEDY_TEMPERATURE
from neuronfx.graphs.phases.sampling import NEG_INF, column, distribution, inverse_cdf, penalized_logits

Tensor = torch.Tensor


def with_drafts(counts: Tensor, drafts: Tensor) -> Tensor:
    """``counts`` (B, V) int32 plus one at each row's draft ``drafts`` (B,) int (the output
    counts at the next position if the draft is accepted)."""
    return counts.scatter_add(1, drafts.long()[:, None], torch.ones_like(counts[:, :1]))


def position_sampler(inputs: FusedSpeculateInputs, params: Tensor, counts: Tensor, i: int, rand: Tensor,
                     words: int) -> SamplerInputs:
    """The sampler inputs of speculated position ``i`` (0: the step's first new token): the rows'
    ``params`` (B, P), ``counts`` (B, V) int32 (the step's counts plus the drafts before
    position i), the request's logit_bias with -inf on the stop ids while i < min_tokens_left
    (``runtime/batch.logits_bias`` at generated + i), ``rand`` (B,) and every token allowed
    (``words`` = ceil(V / 32) bitmask words of -1)."""
    held = inputs.stop_mask & (inputs.min_tokens_left > i)[:, None]  # (B, V)
    bias = inputs.logits_bias.masked_fill(held, NEG_INF)
    allowed = torch.full((params.shape[0], words), -1, dtype=torch.int32, device=params.device)
    return SamplerInputs(sampling_params=params, output_counts=counts, prompt_mask=inputs.prompt_mask, logits_bias=bias,
                         rand=rand, token_bitmask=allowed)


def stack_positions(samplers: list[SamplerInputs]) -> SamplerInputs:
    """Row r, position i -> row r * k + i of one record (k = len(samplers)): the target's
    sampler inputs of every speculated position as one record (fused and unfused acceptance)."""
    return SamplerInputs(*(torch.stack(column, 1).flatten(0, 1) for column in zip(*samplers)))


def accept_rows(drafts: Tensor, target_logits: Tensor, draft_logits: Tensor | None, targets: SamplerInputs,
                drafted: SamplerInputs | None, accept_rand: Tensor, final_rand: Tensor, target_width: int,
                draft_width: int, argmax: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Acceptance of one speculate step for n rows.

    drafts (n, D) int64 the proposed tokens; target_logits (n, T) x V float32 the verify pass's
    logits (T = D + 1); ``targets`` the target's sampler inputs at every position stacked
    (:func:`stack_positions`, n * T rows); for sampled rows ``draft_logits`` (n, D, V) float32 and
    ``drafted`` the sampler inputs the drafts were drawn with (n * D rows), both None when every
    row is greedy; accept_rand (n, D), final_rand (n, T) float32 uniforms; the two top-k widths;
    ``argmax`` (n, T) int the verify graph's argmax of the raw logits, given only when every row's
    penalized logits are its raw logits (``runtime/acceptance.raw_argmax``, as unfused acceptance
    reads it): the (n * T, V) penalty pass is skipped (2.9 ms of a 75 ms fused step of SmolLM2 fp32
    at batch 1, k = 4).

    Returns (tokens (n, T) int64, emitted (n,) int64): row r emits tokens[r, :emitted[r]]
    (1 <= emitted <= T; the tokens past it are unused)."""
    n, t = target_logits.shape[:2]
    flat = target_logits.reshape(n * t, -1)
    argmax = penalized_logits(flat, targets).argmax(-1).reshape(n, t) if argmax is None else argmax.long()  # (n, T)
    kept = (drafts == argmax[:, :-1]).long().cumprod(-1).sum(-1)  # (n,) leading drafts equal to the argmax
    params = targets.sampling_params.reshape(n, t, -1)[:, 0]  # (n, P)
    greedy = ((column(params, "temperature") <= GREEDY_TEMPERATURE) | (column(params, "top_k") == 1))[:, 0]  # SamplingParams.greedy
    if draft_logits is None or drafted is None:
        return argmax, kept + 1
    tokens, accepted = _sampled(drafts, distribution(flat, targets, target_width).reshape(n, t, -1),
                                distribution(draft_logits.reshape(n * (t - 1), -1), drafted, draft_width).reshape(n, t - 1, -1),
                                accept_rand, final_rand)
    return torch.where(greedy[:, None], argmax, tokens), torch.where(greedy, kept, accepted) + 1


def _sampled(drafts: Tensor, p: Tensor, q: Tensor, accept_rand: Tensor, final_rand: Tensor) -> tuple[Tensor, Tensor]:
    """Rejection sampling for every row: p (n, T, V), q (n, D, V) the target's and the draft's
    distributions -> (tokens (n, T): the drafts up to the first rejection, then the token drawn
    there; accepted drafts (n,)). ``runtime/acceptance.accept_sampled``, vectorised."""
    n, t, _ = p.shape
    at = drafts[..., None]  # (n, D, 1)
    ok = accept_rand * q.gather(2, at)[..., 0] < p[:, :-1].gather(2, at)[..., 0]  # (n, D) accept with min(1, p / q)
    accepted = ok.long().cumprod(-1).sum(-1)  # (n,)
    residual = (p[:, :-1] - q).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:, :-1])  # p == q: rejection had probability 0
    drawn = inverse_cdf(torch.cat([residual, p[:, -1:]], 1).reshape(n * t, -1), final_rand.reshape(n * t)).reshape(n, t)
    last = drawn.gather(1, accepted[:, None])  # (n, 1) the token at the first rejection (or the bonus)
    j = torch.arange(t, device=p.device)[None, :]
    padded = torch.cat([drafts, last], 1)
    return torch.where(j < accepted[:, None], padded, last), accepted
