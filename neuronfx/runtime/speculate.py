"""Speculative decoding: a draft proposes k - 1 tokens per row, the target verifies them (plus
the last accepted token) in one "speculate" pass of k query tokens, and the host accepts.

Drafts: self-speculation (the target's own "draft" graphs: its first ``draft_layers`` layers,
final norm and LM head, sharing its weights and KV cache) or any compatible draft runtime with
its own state. Acceptance: greedy = the longest prefix of drafts equal to the target's argmax,
plus the target's next token; sampled = rejection sampling (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023): accept
draft x with probability min(1, p(x) / q(x)), else resample from normalise(max(p - q, 0)); the
output distribution equals the target's.

KV consistency without copies: a verify pass writes k positions; the slot's cache_len is then
set to the accepted length, and positions past it are never attended (masks are ``j <= position``)
and are overwritten by the next write.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs
import torch

from neuronfx.config.buckets import select_bucket
from neuronfx.config.sampling import SamplingParams, pack_sampling
from neuronfx.errors import BatchTooLargeError, ConfigError, SamplingParamsError
from neuronfx.graphs.sampling import filtered_distribution
from neuronfx.runtime.generate import GenerateResult, Prompts, make_requests
from neuronfx.runtime.runtime import Runtime
from neuronfx.runtime.state import State, advance, check_usable
from neuronfx.runtime.steps import DecodeBatch, PrefillBatch, _pad, decode_step, prefill_step, release, run_one_token


@attrs.frozen(kw_only=True)
class SpeculationStats:
    """Per-request acceptance statistics."""

    target_passes: int  # verify passes (plain decode steps near the end of the cache count too)
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens accepted
    emitted: int  # tokens produced after the prefill

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target pass (1 = no gain; k at most)."""
        return self.emitted / self.target_passes if self.target_passes else 0.0


@attrs.frozen(kw_only=True, eq=False)
class Draft:
    """A draft runtime with its own state (draft-model speculation); same vocabulary as the target."""

    runtime: Runtime
    state: State


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


def accept_sampled(drafts: Sequence[int], q: torch.Tensor, p: torch.Tensor, uniforms: torch.Tensor, generator: torch.Generator) -> list[int]:
    """Rejection sampling. q: (k-1, V) draft distributions the drafts were drawn from; p: (k, V)
    target distributions; uniforms: (k-1,) in [0, 1). Returns emitted tokens (1..k)."""
    out = []
    for i, d in enumerate(drafts):
        if uniforms[i] * q[i, d] < p[i, d]:  # accept with min(1, p/q); q[i, d] > 0 (d was drawn from q)
            out.append(d)
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
    return out


def truncate_at_stop(emitted: list[int], budget: int, stops: frozenset[int]) -> tuple[list[int], bool]:
    """Cut ``emitted`` to ``budget`` tokens and after the first stop id (kept). Returns
    (tokens, stopped)."""
    out = []
    for t in emitted[:budget]:
        out.append(t)
        if t in stops:
            return out, True
    return out, False


# --- validation -------------------------------------------------------------------------------


def check_speculation_params(sp: SamplingParams) -> None:
    """Raise SamplingParamsError for a parameter speculative decoding does not support."""
    unsupported = {
        "min_p": sp.min_p != 0.0, "repetition_penalty": sp.repetition_penalty != 1.0,
        "presence_penalty": sp.presence_penalty != 0.0, "frequency_penalty": sp.frequency_penalty != 0.0,
        "logprobs": sp.logprobs is not None, "stop": bool(sp.stop), "min_tokens": sp.min_tokens != 0,
        "seed": sp.seed is not None,
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise SamplingParamsError(
            f"SamplingParams.{bad[0]} is not supported with speculative decoding (temperature, top_k, top_p, "
            "max_tokens, stop_token_ids and ignore_eos are); drop it or generate without speculation."
        )


def check_speculation(runtime: Runtime, params: Sequence[SamplingParams], draft: Draft | None, n: int) -> None:
    """Raise ConfigError / SamplingParamsError / BatchTooLargeError before anything runs."""
    inf = runtime.plan.inference
    if inf.speculation_length < 2:
        raise ConfigError("this runtime has no speculate graphs: compile with InferenceConfig(speculation_length=k >= 2).")
    if draft is None and not inf.draft_layers:
        raise ConfigError("no draft: compile with draft_layers=N (self-speculation) or pass draft=Draft(runtime, state).")
    for sp in params:
        check_speculation_params(sp)
    if draft is not None:
        check_usable(draft.state, draft.runtime.plan)
        if draft.runtime.plan.model.vocab_size != runtime.plan.model.vocab_size:
            raise ConfigError(
                f"draft vocab_size={draft.runtime.plan.model.vocab_size} != target vocab_size="
                f"{runtime.plan.model.vocab_size}; the draft must share the target's tokenizer."
            )
        if any(not sp.greedy for sp in params) and not draft.runtime.plan.inference.output_logits:
            raise ConfigError("sampled speculation needs the draft's logits: compile the draft with output_logits=True.")
        if len(draft.state.free_slots) < n:
            raise BatchTooLargeError(f"{n} prompts > {len(draft.state.free_slots)} free draft slots; use a larger draft batch_size.")
        if draft.runtime.plan.inference.sequence_length < runtime.plan.inference.sequence_length:
            raise ConfigError(
                f"draft sequence_length={draft.runtime.plan.inference.sequence_length} < target's "
                f"{runtime.plan.inference.sequence_length}; compile the draft with at least the target's."
            )


# --- graph calls (host ints in, tensors out) ---------------------------------------------------


def _set_lens(state: State, lens: dict[int, int]) -> State:
    """New state with ``cache_lens`` (and ``generated``, by the same delta) of some slots set."""
    cache_lens, generated = list(state.cache_lens), list(state.generated)
    for s, n in lens.items():
        generated[s] += n - cache_lens[s]
        cache_lens[s] = n
    return advance(state, cache_lens=tuple(cache_lens), generated=tuple(generated), live=state.live, rng_key=state.rng_key)


def _verify(runtime: Runtime, state: State, slots: list[int], rows: list[list[int]]) -> torch.Tensor:
    """Target logits (n, k, V) for k tokens per row at positions cache_len..cache_len + k - 1
    (writes their K/V; cache_lens unchanged: the caller sets the accepted length)."""
    plan, k, n = runtime.plan, runtime.plan.inference.speculation_length, len(slots)
    bsz = select_bucket(plan.batch_buckets, n, "batch rows")
    start = [state.cache_lens[s] for s in slots]
    bucket = select_bucket(plan.decode_buckets, max(start) + k, "attended KV length")
    ids = torch.tensor(_pad(rows, bsz, [0] * k), dtype=torch.int32)
    positions = torch.tensor(_pad([list(range(p, p + k)) for p in start], bsz, list(range(k))), dtype=torch.int32)
    seq_ids = torch.tensor(_pad(slots, bsz, plan.kv.scratch_slot), dtype=torch.int32)
    with torch.no_grad():
        out = runtime.graphs[("speculate", bsz, bucket)](runtime.weights, list(state.kv), ids, positions, seq_ids)
    return out["logits"][:n]


def _self_draft(runtime: Runtime, state: State, slots: list[int], tokens: list[int], offset: int,
                params: Sequence[SamplingParams]) -> tuple[list[int], torch.Tensor, State]:
    """One self-speculative draft token per row at position cache_len + offset, from the target's
    first ``draft_layers`` layers (their K/V written there; the verify pass rewrites them).
    Returns (tokens, logits (n, V), state with the next RNG key)."""
    n = len(slots)
    positions = [state.cache_lens[s] + offset for s in slots]
    out, _, next_key, _ = run_one_token(runtime, state, "draft", slots, tokens, positions, params)
    new = advance(state, cache_lens=state.cache_lens, generated=state.generated, live=state.live, rng_key=next_key)
    return out["tokens"][:n].tolist(), out["logits"][:n], new


# --- the loop ----------------------------------------------------------------------------------


@attrs.define
class _Row:
    """Host progress of one request (loop-private)."""

    slot: int
    draft_slot: int | None
    params: SamplingParams
    budget: int
    stops: frozenset[int]
    tokens: list[int]
    reason: str | None = None
    stop_reason: int | None = None
    passes: int = 0
    drafted: int = 0
    accepted: int = 0


def _record(row: _Row, emitted: list[int]) -> int:
    """Append ``emitted`` (cut at budget/stop ids); returns how many were kept."""
    kept, stopped = truncate_at_stop(emitted, row.budget - len(row.tokens), row.stops)
    row.tokens += kept
    if stopped:
        row.reason, row.stop_reason = "stop", (kept[-1] if kept[-1] in row.params.stop_token_ids else None)
    elif len(row.tokens) >= row.budget:
        row.reason = "length"
    return len(kept)


def generate_speculative(
    runtime: Runtime, state: State, ids: Prompts, *, max_new_tokens: int = 32,
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    eos_token_ids: int | Sequence[int] | None = None, draft: Draft | None = None,
) -> tuple[GenerateResult, State, Draft | None]:
    """Generate like :func:`neuronfx.generate` (one static batch of prompts, all in free slots)
    with speculative decoding: k = ``speculation_length`` tokens verified per target pass.

    Draft: ``draft`` (a Draft runtime and its state) or, when None, self-speculation through
    the runtime's "draft" graphs (``draft_layers``). Greedy rows give exactly the target's greedy
    tokens; sampled rows keep the target's distribution (rejection sampling). Near the end of
    the KV cache (cache_len + k > sequence_length) a step falls back to plain decode.

    Returns (result with per-request ``speculation`` stats, new target state, new Draft or
    None). Raises, before any change: ConfigError (no speculate/draft graphs, draft mismatch),
    SamplingParamsError (parameters speculation does not support), BatchTooLargeError (more
    prompts than free slots), and every error of :func:`make_requests`.
    """
    requests, eos = make_requests(runtime, state, ids, max_new_tokens=max_new_tokens, sampling=sampling, eos_token_ids=eos_token_ids)
    params = [r.sampling for r in requests]
    check_speculation(runtime, params, draft, len(requests))
    if len(requests) > len(state.free_slots):
        raise BatchTooLargeError(
            f"{len(requests)} prompts > {len(state.free_slots)} free slots; speculative generate runs one static batch."
        )
    draft_slots = draft.state.free_slots[: len(requests)] if draft is not None else [None] * len(requests)
    rows = [
        _Row(slot=s, draft_slot=d, params=r.sampling, budget=r.max_tokens, tokens=[],
             stops=(frozenset() if r.sampling.ignore_eos else eos) | frozenset(r.sampling.stop_token_ids))
        for s, d, r in zip(state.free_slots, draft_slots, requests)
    ]
    prompts = [list(r.prompt) for r in requests]
    t0 = time.perf_counter()
    out, state = prefill_step(runtime, state, PrefillBatch(seq_ids=[r.slot for r in rows], prompts=prompts, sampling=params))
    dstate = None
    if draft is not None:
        greedy = [SamplingParams()] * len(rows)
        _, dstate = prefill_step(draft.runtime, draft.state, PrefillBatch(seq_ids=list(draft_slots), prompts=prompts, sampling=greedy))
    prefill_s = time.perf_counter() - t0
    for row, t in zip(rows, out.tokens):
        _record(row, [t])
    gen = torch.Generator().manual_seed(state.rng_key)
    t0 = time.perf_counter()
    state, dstate = _release_done(runtime, state, draft, dstate, rows)
    while active := [r for r in rows if r.reason is None]:
        state, dstate = _iteration(runtime, state, draft, dstate, active, gen)
        state, dstate = _release_done(runtime, state, draft, dstate, active)
    decode_s = time.perf_counter() - t0
    result = GenerateResult(
        token_ids=tuple(tuple(r.tokens) for r in rows), finish_reasons=tuple(r.reason for r in rows),
        stop_reasons=tuple(r.stop_reason for r in rows), texts=None, logprobs=(None,) * len(rows),
        prefill_s=prefill_s, decode_s=decode_s,
        speculation=tuple(SpeculationStats(target_passes=r.passes, drafted=r.drafted, accepted=r.accepted,
                                           emitted=len(r.tokens) - 1) for r in rows),
    )
    return result, state, (Draft(runtime=draft.runtime, state=dstate) if draft is not None else None)


def _release_done(runtime: Runtime, state: State, draft: Draft | None, dstate: State | None, rows: list[_Row]) -> tuple[State, State | None]:
    """Release the slots of finished rows (target and draft)."""
    done = [r for r in rows if r.reason is not None and state.live[r.slot]]
    if done:
        state = release(runtime, state, [r.slot for r in done])
        if draft is not None:
            dstate = release(draft.runtime, dstate, [r.draft_slot for r in done])
    return state, dstate


def _iteration(runtime: Runtime, state: State, draft: Draft | None, dstate: State | None, active: list[_Row],
               gen: torch.Generator) -> tuple[State, State | None]:
    """One target pass for every active row: draft k - 1, verify k, accept, set cache_lens."""
    plan = runtime.plan
    k, slots = plan.inference.speculation_length, [r.slot for r in active]
    params = [r.params for r in active]
    start = {r.slot: state.cache_lens[r.slot] for r in active}
    if max(start.values()) + k > plan.inference.sequence_length:  # no room to verify k: plain decode
        batch = DecodeBatch(seq_ids=slots, input_ids=[r.tokens[-1] for r in active], sampling=params)
        out, state = decode_step(runtime, state, batch)
        if draft is not None:
            dbatch = attrs.evolve(batch, seq_ids=[r.draft_slot for r in active])
            _, dstate = decode_step(draft.runtime, dstate, dbatch)
        for r, t in zip(active, out.tokens):
            r.passes += 1
            _record(r, [t])
        return state, dstate

    seqs = [[r.tokens[-1]] for r in active]  # x0, then the drafts
    qs = []
    for i in range(k - 1):
        last = [s[-1] for s in seqs]
        if draft is None:
            toks, logits, state = _self_draft(runtime, state, slots, last, i, params)
        else:
            dout, dstate = decode_step(draft.runtime, dstate, DecodeBatch(seq_ids=[r.draft_slot for r in active], input_ids=last, sampling=params))
            toks, logits = list(dout.tokens), dout.logits
        for s, t in zip(seqs, toks):
            s.append(t)
        qs.append(logits)
    target = _verify(runtime, state, slots, seqs)  # (n, k, V)
    new_lens, resync = {}, []
    for j, r in enumerate(active):
        emitted = _accept(r.params, seqs[j][1:], target[j], qs, j, plan.topk_width, draft, gen)
        r.passes, r.drafted, r.accepted = r.passes + 1, r.drafted + k - 1, r.accepted + len(emitted) - 1
        m = _record(r, emitted)
        new_lens[r.slot] = start[r.slot] + m
        if draft is not None and m == k:  # the draft never consumed its last token: feed it
            resync.append((r, seqs[j][-1]))
    state = _set_lens(state, new_lens)
    if draft is not None:
        dstate = _sync_draft(draft, dstate, active, start, new_lens, resync)
    return state, dstate


def _accept(sp: SamplingParams, drafts: list[int], logits: torch.Tensor, qs: list, j: int, topk_width: int,
            draft: Draft | None, gen: torch.Generator) -> list[int]:
    if sp.greedy:
        return accept_greedy(drafts, logits.argmax(-1).tolist())
    k = logits.shape[0]
    rows = torch.tensor(pack_sampling([sp] * k, topk_width), dtype=torch.float32)
    p = filtered_distribution(logits, rows, topk_width)
    q_width = topk_width if draft is None else draft.runtime.plan.topk_width
    q = filtered_distribution(torch.stack([q[j] for q in qs]), rows[: k - 1], q_width)
    return accept_sampled(drafts, q, p, torch.rand(k - 1, generator=gen), gen)


def _sync_draft(draft: Draft, dstate: State, active: list[_Row], start: dict[int, int], new_lens: dict[int, int],
                resync: list[tuple[_Row, int]]) -> State:
    """Give the draft state the target's accepted length: feed a fully accepted run's last draft
    token, then set cache_lens (positions past them are stale and never read)."""
    if resync:
        batch = DecodeBatch(seq_ids=[r.draft_slot for r, _ in resync], input_ids=[t for _, t in resync],
                            sampling=[SamplingParams()] * len(resync))
        _, dstate = decode_step(draft.runtime, dstate, batch)
    return _set_lens(dstate, {r.draft_slot: new_lens[r.slot] for r in active})
