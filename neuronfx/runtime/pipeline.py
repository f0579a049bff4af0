"""The one step pipeline. Every step is "T new tokens per row at these positions against these
slots": plan the rows (:func:`plan_rows`: which graph, padded how), build the phase's input record
(:func:`step_inputs`, the one builder), call the graph (``batch.call_graph``, where its input
tensors are checked), commit (:func:`commit`: the new state). prefill, refill and decode
(``steps.py``), chunk (``chunked.py``) and speculate (``speculate.py``) are this pipeline with
their T and their commit; overlapped decode launches the same steps (``overlap.py``).

Nothing here checks a request: the public step functions check their batch once
(``checks.py``) and the scheduler its requests at submit, before a pipeline runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from neuronfx.config.buckets import select_bucket
from neuronfx.config.inputs import PHASE_INPUTS, SamplerInputs
from neuronfx.config.kv import chunk_positions
from neuronfx.config.sampling import SamplingParams
from neuronfx.graphs.phases.sampling import sample
from neuronfx.runtime.batch import call_graph, draws, logits_bias, pad, sampler_inputs
from neuronfx.runtime.blocks import reserve, table_rows
from neuronfx.runtime.runtime import Runtime
from neuronfx.runtime.state import State, advance
from neuronfx.runtime.structured import Constraints, token_bitmask

Tensor = torch.Tensor

NO_TOKEN = -1
"""``StepOutput.tokens`` of a row that produced no token (a chunk that is not its prompt's last):
an id no vocabulary has, so feeding it to a decode step fails loudly."""


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
    """What one step produced, row-aligned with its batch. Prefill and decode produce one token
    per row; speculate 1 to k; a chunk that is not its prompt's last none."""

    tokens: tuple[int, ...]  # [n] the last token each row produced (the next step's input_ids), or NO_TOKEN
    new_tokens: tuple[tuple[int, ...], ...]  # [n][m_b] every token row b produced, in order
    logits: torch.Tensor | None  # [n, vocab] float32 of the last position, when output_logits (prefill, decode, chunk)
    logprobs: tuple[tuple[Logprobs, ...] | None, ...]  # [n][m_b], one per new token; None for rows that did not ask
    bucket: int  # tokens: prompt bucket (prefill) or attended KV length (decode, speculate, chunk)
    batch_size: int  # rows of the graph that ran (the batch bucket; rows past n were padding)
    finite: tuple[bool, ...]  # [n] False where the row's logits held NaN/inf: its tokens are garbage
    num_drafted: tuple[int, ...]  # [n] draft tokens proposed for the row (speculate: k - 1, prompt lookup its match's; else 0)
    # [n][scored_b] prompt logprobs of rows whose SamplingParams.prompt_logprobs asked (prefill, chunk;
    # ``runtime/prompt_logprobs.py``), None for the others; () for steps that score no prompt
    prompt_logprobs: tuple[tuple[Logprobs | None, ...] | None, ...] = ()


@attrs.frozen(kw_only=True)
class Rows:
    """One graph call: row b writes ``tokens[b]`` into slot ``slots[b]`` at positions
    ``starts[b]`` .. ``starts[b] + len(tokens[b]) - 1`` through the (``phase``, ``bsz``,
    ``bucket``) graph, whose rows hold T = ``width`` tokens (right-padded; rows past n are
    padding in the scratch slot)."""

    phase: str  # the graph's phase: "prefill", "decode", "greedy", "draft", "speculate" or "chunk"
    slots: Sequence[int]  # [n] slot of each row
    tokens: Sequence[Sequence[int]]  # [n][len_b] new tokens, 1 <= len_b <= width
    starts: Sequence[int]  # [n] position of each row's first new token
    width: int  # T, new tokens per row of the graph
    bsz: int  # the batch bucket, >= n
    bucket: int  # prefill: prompt tokens; the others: attended KV positions, >= start + len of every row
    seq_lens: Sequence[int] | None = None  # [n] each row's whole prompt length (chunk; None: start + len)


def plan_rows(runtime: Runtime, phase: str, buckets: Sequence[int], slots: Sequence[int], tokens: Sequence[Sequence[int]],
              starts: Sequence[int], width: int | None = None, seq_lens: Sequence[int] | None = None) -> Rows:
    """The Rows of one ``phase`` graph call: the smallest batch bucket >= n rows and the smallest
    of ``buckets`` >= the longest row's end (start + new tokens); ``width`` None means T = that
    bucket (prefill). Raises BucketOverflowError when nothing fits (the public steps check room
    first, so only a caller that skipped them sees it)."""
    end = max(s + len(t) for s, t in zip(starts, tokens))
    bsz = select_bucket(runtime.plan.batch_buckets, len(slots), "batch rows")
    bucket = select_bucket(buckets, end, "prompt length" if width is None else "attended KV length")
    return Rows(phase=phase, slots=slots, tokens=tokens, starts=starts, width=bucket if width is None else width, bsz=bsz,
                bucket=bucket, seq_lens=seq_lens)


def step_inputs(runtime: Runtime, rows: Rows, sampler: SamplerInputs | None, block_table: Tensor) -> tuple:
    """The phase's step-input record (``config.inputs.PHASE_INPUTS``) for ``rows``, every field
    filled by name: ``input_ids`` (B, T) int32 right-padded with 0; ``position_ids`` (B, T)
    int32, start + t, pads repeating the row's last real position (``config.kv.chunk_positions``);
    ``seq_ids`` (B,) int32, padding rows in the scratch slot; ``prompt_lens`` / ``chunk_lens``
    (B,) int32 real tokens per row (padding rows: 1); ``seq_lens`` (B,) int32 whole prompt
    lengths; ``block_table`` (B, N) int32 as given (``blocks.table_rows``); ``sampler`` as given
    (None for phases without one)."""
    record, n, bsz, width = PHASE_INPUTS[rows.phase], len(rows.slots), rows.bsz, rows.width
    lens, starts = pad([len(t) for t in rows.tokens], bsz, 1), pad(rows.starts, bsz, 0)

    def positions() -> Tensor:
        # One position rule for every phase: a pad's position feeds only its own RoPE and its write
        # (chunk: to the scratch slot; prefill writes by index and masks by prompt_lens). One token
        # a row (decode): its start, chunk_positions' value without its five tensor ops.
        if width == 1:
            return torch.tensor([[s] for s in starts], dtype=torch.int32)
        return chunk_positions(torch.tensor(starts, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), width)

    # Built lazily: each record takes only some of these fields (decode four).
    make = {
        "input_ids": lambda: torch.tensor([[*t, *[0] * (width - len(t))] for t in rows.tokens] + [[0] * width] * (bsz - n),
                                          dtype=torch.int32),
        "position_ids": positions,
        "seq_ids": lambda: torch.tensor(pad(rows.slots, bsz, runtime.plan.kv.scratch_slot), dtype=torch.int32),
        "prompt_lens": lambda: torch.tensor(lens, dtype=torch.int32),
        "chunk_lens": lambda: torch.tensor(lens, dtype=torch.int32),
        "seq_lens": lambda: torch.tensor(pad(rows.seq_lens or [s + len(t) for s, t in zip(rows.starts, rows.tokens)], bsz, 1),
                                         dtype=torch.int32),
        "block_table": lambda: block_table,
        "sampler": lambda: sampler,
    }
    return record(*(make[name]() for name in record._fields))


def run_rows(runtime: Runtime, state: State, rows: Rows, sampler: SamplerInputs | None = None) -> dict[str, Tensor]:
    """Give ``rows`` the KV blocks their writes need (``blocks.reserve``; the blocks layout),
    build their inputs and run their graph on ``state``'s KV cache (updated in place); the
    graph's outputs on the host (``batch.call_graph``)."""
    plan = runtime.plan
    reserve(plan, state.kv, state.blocks, rows.slots, rows.starts, [s + len(t) for s, t in zip(rows.starts, rows.tokens)])
    table = table_rows(plan, state.blocks, rows.slots, rows.bsz)
    return call_graph(runtime, state.kv, rows.phase, rows.bsz, rows.bucket, step_inputs(runtime, rows, sampler, table))


def row_sampler(runtime: Runtime, state: State, rows: Rows, params: Sequence[SamplingParams], generated: Sequence[int],
                fresh_mask: Tensor | None = None, constraints: Constraints = None) -> tuple[SamplerInputs, int]:
    """(the sampler's inputs for ``rows``, padded to ``rows.bsz``; the state's next RNG key).
    Draws come from the state's key (a seeded row's from its seed and ``generated``, tokens it
    sampled before), the min_tokens bias is at ``generated``; output counts and prompt masks are
    the state's, or zero counts and ``fresh_mask`` (bsz, V) bool for rows starting a request.
    The token bitmask is built here, the one place for every step: each row's matcher in
    ``constraints`` fills its row (``structured.token_bitmask``; SamplingParamsError when a row
    would allow nothing), the others allow every token."""
    bsz = rows.bsz
    bitmask = token_bitmask(constraints, params, generated, runtime.plan.model.eos_token_ids, runtime.plan.model.vocab_size)
    rand, key = draws(state.rng_key, params, generated, bsz)
    bias = logits_bias(runtime, params, generated, bsz)
    if fresh_mask is None:
        counts, mask = slot_rows(state.output_counts, rows.slots), slot_rows(state.prompt_mask, rows.slots)
    else:
        counts, mask = torch.zeros(bsz, runtime.plan.model.vocab_size, dtype=torch.int32), fresh_mask
    return sampler_inputs(runtime, params, counts, mask, bias, rand, bsz, bitmask), key


def slot_rows(t: Tensor, slots: Sequence[int]) -> Tensor:
    """``t[slots]`` of a per-slot state tensor (num_slots, V): a view when the slots are
    consecutive (a full batch in slot order: the graph reads the state's rows where they are,
    where a gather copied 1.5 MB of SmolLM2's int32 counts per batch-8 step, about 130 us), else
    a gathered copy. The step only reads it; the state is updated after the graph returns."""
    first = slots[0]
    if list(slots) == list(range(first, first + len(slots))):
        return t[first:first + len(slots)]
    return t[list(slots)]


def row_logprobs(out: dict[str, Tensor], r: int, token: int, k: int) -> Logprobs:
    """Row ``r``'s Logprobs (top ``k``) from the sampler's logprob outputs."""
    return Logprobs(token_id=token, logprob=float(out["sampled_logprobs"][r]),
                    top_ids=tuple(out["top_ids"][r, :k].tolist()), top_logprobs=tuple(out["top_logprobs"][r, :k].tolist()))


def sampled(runtime: Runtime, out: dict[str, Tensor], params: Sequence[SamplingParams], sampler: SamplerInputs | None,
            ) -> tuple[tuple[int, ...], Tensor | None, tuple[tuple[Logprobs, ...] | None, ...]]:
    """(token [n], logits (n, V) or None, logprobs [n]) the graph sampled for the n =
    ``len(params)`` rows; without on-device sampling the same sampler runs here on its logits
    (``sampler`` is None only for a greedy graph, which plans with on-device sampling have)."""
    plan, n = runtime.plan, len(params)
    if not plan.inference.on_device_sampling:
        out = out | sample(out["logits"], sampler, plan.topk_width, plan.logprobs_width)
    tokens = tuple(out["tokens"][:n].tolist())
    logits = out["logits"][:n] if plan.inference.output_logits else None
    logprobs = tuple(None if sp.logprobs is None else (row_logprobs(out, r, tokens[r], sp.logprobs),)
                     for r, sp in enumerate(params))
    return tokens, logits, logprobs


def count_tokens(state: State, slots: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
    """Add each row's new tokens to its slot's output counts (in place; one scatter for all rows)."""
    vocab = state.output_counts.shape[1]
    # (slot, token) in the counts' row-major order; the tokens are the graphs' own, each < vocab
    flat = [s * vocab + t for s, row in zip(slots, tokens) for t in row]
    if flat:
        # view, never reshape: a copy would take the counts silently; index_add_ adds repeats
        state.output_counts.view(-1).index_add_(0, torch.tensor(flat), torch.ones(len(flat), dtype=torch.int32))


def commit(state: State, slots: Sequence[int], ends: Sequence[int], produced: Sequence[Sequence[int]], rng_key: int,
           fresh_mask: Tensor | None = None) -> State:
    """The state after a step: slot ``slots[b]`` live holding ``ends[b]`` tokens, its generated
    count and output counts grown by ``produced[b]``, RNG key ``rng_key``. With ``fresh_mask``
    ((>= n, V) bool) the rows start their requests: counts from zero, prompt masks its rows.
    ``state`` is consumed first: an interrupt while the shared host tensors change leaves it
    clearly consumed, never silently half-updated."""
    cache_lens, generated, live = list(state.cache_lens), list(state.generated), list(state.live)
    for s, end, row in zip(slots, ends, produced):
        cache_lens[s], live[s] = end, True
        generated[s] = len(row) + (0 if fresh_mask is not None else generated[s])
    new = advance(state, cache_lens=tuple(cache_lens), generated=tuple(generated), live=tuple(live), rng_key=rng_key)
    if fresh_mask is not None:
        new.prompt_mask[list(slots)] = fresh_mask[: len(slots)]
        new.output_counts[list(slots)] = 0
    count_tokens(new, slots, produced)
    return new


def token_step(runtime: Runtime, state: State, rows: Rows, params: Sequence[SamplingParams], out: dict[str, Tensor],
               sampler: SamplerInputs | None, rng_key: int, ends: Sequence[int], fresh_mask: Tensor | None = None,
               keep: Sequence[bool] | None = None, prompt_logprobs: tuple = ()) -> tuple[StepOutput, State]:
    """Commit a step whose graph sampled one token per row (prefill, refill, decode, chunk):
    (its StepOutput, the new state, :func:`commit`). ``keep[b]`` False: row b's token is not
    the request's (a chunk before the prompt's last): no new token, ``NO_TOKEN``, no logprobs.
    ``prompt_logprobs``: the rows' StepOutput.prompt_logprobs, as given."""
    tokens, logits, logprobs = sampled(runtime, out, params, sampler)
    n = len(tokens)
    keep = (True,) * n if keep is None else keep
    produced = tuple((t,) if k else () for t, k in zip(tokens, keep))
    new = commit(state, rows.slots, ends, produced, rng_key, fresh_mask)
    return StepOutput(tokens=tuple(t if k else NO_TOKEN for t, k in zip(tokens, keep)), new_tokens=produced, logits=logits,
                      logprobs=tuple(lp if k else None for lp, k in zip(logprobs, keep)), bucket=rows.bucket, batch_size=rows.bsz,
                      finite=tuple(bool(f) for f in out["finite"][:n].tolist()), num_drafted=(0,) * n,
                      prompt_logprobs=prompt_logprobs), new
