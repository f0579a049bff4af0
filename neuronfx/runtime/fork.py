"""Fork: a request starts from another slot's prompt instead of a prefill (one prompt's n > 1
choices, OpenAI's ``n``).

The prompt is prefilled once, in its first choice's slot. Every other choice copies that slot's
KV cache of the prompt's first L - 1 positions into its own slot (every layer, K and V; the
draft's cache too) and then runs the decode pipeline on the prompt's last token at position
L - 1: the decode step writes that position and samples the choice's first token with its own
sampling stream. So n choices cost one prefill plus one decode row each, where n prefills cost
n times the prompt (vLLM gets the same from prefix caching: its child requests share the
prompt's cached blocks and recompute the last token).

In the slots layout a copy: slots hold contiguous caches (``State.kv``), and a copy of L - 1
positions per layer is one strided memory copy, far cheaper than the prompt's prefill. In the
blocks layout the choices share the prompt's blocks by reference (``blocks.share``); the first
write into a shared block copies it (``blocks.reserve``).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from neuronfx.config.sampling import MAX_SEED, SamplingParams
from neuronfx.errors import InputError
from neuronfx.graphs.phases.inputs import KVCache
from neuronfx.runtime.blocks import copy_ring, share
from neuronfx.runtime.pipeline import StepOutput, commit
from neuronfx.runtime.requests import Progress, Queue, Request
from neuronfx.runtime.runtime import Runtime
from neuronfx.runtime.speculate import follow_draft
from neuronfx.runtime.state import State
from neuronfx.runtime.steps import DecodeBatch, decode_target
from neuronfx.runtime.structured import Constraints

MAX_CHOICES = 128
"""Largest ``n`` (choices per prompt) accepted: OpenAI's limit for ``n``."""


def check_n(n: object) -> None:
    """InputError unless ``n`` is an int in [1, MAX_CHOICES]."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise InputError(f"n={n!r} must be an int in [1, {MAX_CHOICES}] (choices per prompt); lower it, or send the prompt "
                         "again for more.")


def choices(requests: Sequence[Request], n: int, start: int = 0) -> list[Request]:
    """Each of ``requests`` as its ``n`` choices in a row (indices from ``start``): choice c > 0
    names the first as its ``parent`` and, when seeded, draws with seed + c (vLLM's rule for
    n > 1 child requests; modulo 2**63), so choice c equals the same prompt run alone with that seed
    (with a float KV cache: under a rounded one, ``kv_cache_dtype`` int8 or fp8, a forked choice
    reads the prompt's stored K/V where a lone run attends its fresh ones)."""
    out: list[Request] = []
    for request in requests:
        first, seed = start + len(out), request.sampling.seed
        for c in range(n):
            sampling = request.sampling if c == 0 or seed is None else attrs.evolve(request.sampling, seed=(seed + c) % (MAX_SEED + 1))
            out.append(attrs.evolve(request, sampling=sampling, parent=None if c == 0 else first))
    return out


@attrs.frozen(kw_only=True)
class ForkBatch:
    """Rows that start their requests from another live slot's prompt: row b's request has
    prompt ``prompts[b]``, which slot ``sources[b]`` holds at positions 0 .. L - 1; it goes to the
    free slot ``seq_ids[b]``."""

    seq_ids: Sequence[int]  # [n] free slots the rows start in
    sources: Sequence[int]  # [n] live slots holding each row's prompt (its first choice)
    prompts: Sequence[Sequence[int]]  # [n][L_b] each row's prompt, L_b >= 1
    sampling: Sequence[SamplingParams]  # [n] each row's sampling
    constraints: Constraints = None  # [n] structured rows' matchers (read, not consumed), or None


def copy_prompt_kv(kv: KVCache, sources: Sequence[int], seq_ids: Sequence[int], lengths: Sequence[int]) -> None:
    """Copy positions [0, lengths[b]) of slot ``sources[b]`` into slot ``seq_ids[b]``, every
    layer, K and V (in place; one strided copy per row and tensor)."""
    for layer in kv:
        for t in (layer.k, layer.v):  # (slots, n_kv_heads, S, head_dim)
            for src, dst, n in zip(sources, seq_ids, lengths):
                t[dst, :, :n].copy_(t[src, :, :n])


def _fork(runtime: Runtime, state: State, batch: ForkBatch) -> tuple[StepOutput, State]:
    """The target's fork: copy, start the rows' requests holding L - 1 prompt tokens (prompt
    masks, zero counts), then decode their last prompt token."""
    lengths = [len(p) - 1 for p in batch.prompts]
    if state.blocks is None:
        copy_prompt_kv(state.kv, batch.sources, batch.seq_ids, lengths)
    for src, dst, n in zip(batch.sources, batch.seq_ids, lengths):  # the blocks layout shares them (copy on write)
        share(runtime.plan, state.blocks, src, dst, n)
    copy_ring(runtime.plan, state.kv, batch.sources, batch.seq_ids)
    mask = torch.zeros(len(batch.seq_ids), runtime.plan.model.vocab_size, dtype=torch.bool)
    for b, prompt in enumerate(batch.prompts):
        mask[b, list(prompt)] = True
    state = commit(state, batch.seq_ids, lengths, [()] * len(lengths), state.rng_key, fresh_mask=mask)
    last = DecodeBatch(seq_ids=batch.seq_ids, input_ids=[p[-1] for p in batch.prompts], sampling=batch.sampling,
                       constraints=batch.constraints)
    return decode_target(runtime, state, last)


def fork(runtime: Runtime, state: State, batch: ForkBatch) -> tuple[StepOutput, State]:
    """Start ``batch``'s rows from their sources' prompts (the module doc): (StepOutput with one
    token per row, the new state; ``state`` is consumed). Trusts its batch: the scheduler forks
    only rows whose source is live and holds the same prompt, into free slots."""
    return follow_draft(_fork, runtime, state, batch)


def has_ring(runtime: Runtime) -> bool:
    """Whether the target's or its draft model's cache has a window ring (forks then copy a ring
    that must still hold the prompt's last window: ``fork.split_forks``)."""
    return bool(runtime.plan.kv.ring_blocks or (runtime.draft is not None and runtime.draft.plan.kv.ring_blocks))


def forks_from(parent: Request | None, request: Request) -> bool:
    """Whether ``request`` starts as a fork of live ``parent`` (its choice of the same prompt):
    not when it asks for prompt logprobs, which its own prefill computes."""
    return parent is not None and parent.prompt == request.prompt and request.sampling.prompt_logprobs is None


def split_forks(queue: Queue, admitted: tuple[Progress, ...], ring: bool = False,
                ) -> tuple[tuple[Progress, ...], tuple[Progress, ...], tuple[int, ...]]:
    """(prefill rows, fork rows, their source slots) of ``admitted``: a request forks when its
    ``parent`` is running or prefilled in this iteration with the same prompt (n > 1 choices
    of one prompt); else it is prefilled (its parent finished, or it has none, or it asks for
    prompt logprobs). With a window ring (``ring``) only a parent prefilled in this iteration:
    a running one's ring may no longer hold its prompt's last window."""
    holders = {} if ring else {r.index: r for r in queue.running}
    prefilled, forks, sources = [], [], []
    for run in admitted:
        parent = holders.get(run.request.parent)
        if forks_from(None if parent is None else parent.request, run.request):
            forks.append(run)
            sources.append(parent.slot)
        else:
            prefilled.append(run)
            holders[run.index] = run
    return tuple(prefilled), tuple(forks), tuple(sources)


def fork_batch(rows: Sequence[Progress], sources: Sequence[int]) -> ForkBatch:
    """The fork step of admitted ``rows`` (:func:`split_forks`), each copying from ``sources``."""
    constraints = None if all(r.matcher is None for r in rows) else [r.matcher for r in rows]
    return ForkBatch(seq_ids=[r.slot for r in rows], sources=sources, prompts=[r.request.prompt for r in rows],
                     sampling=[r.request.sampling for r in rows], constraints=constraints)
