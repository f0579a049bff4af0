"""Chunked prefill (prefill at an offset): the chunk mask, KV spec and bucket planner against
naive references, ``chunk_step`` against an unchunked prefill (tokens and logits) on ragged
batches, its errors, and the scheduler's interleaving (eager tiny models)."""

from __future__ import annotations

import functools

import attrs
import pytest
import torch
from helpers import GREEDY, chunked_prefill, hf_greedy, random_prompt, tiny_hf_model, tiny_runtime
from hypothesis import example, given, settings
from hypothesis import strategies as st

import neuronfx
from neuronfx import ChunkBatch, InferenceConfig, PrefillBatch, SamplingParams, chunk_step, prefill_step
from neuronfx.config.buckets import chunk_buckets, select_bucket
from neuronfx.config.kv import chunk_access, chunk_positions, pad_writes
from neuronfx.config.masks import chunk_mask
from neuronfx.errors import (
    BucketOverflowError,
    ConfigError,
    EmptyPromptError,
    InputError,
    PromptTooLongError,
    SlotError,
    TokenOutOfVocabError,
)

# --- pure functions -------------------------------------------------------------------------------


@st.composite
def chunk_case(draw):
    """(starts, chunk_lens, chunk size T, attended bucket S, scratch slot) of a ragged chunk batch."""
    size = draw(st.integers(min_value=1, max_value=9))
    rows = draw(st.integers(min_value=1, max_value=4))
    lens = draw(st.lists(st.integers(min_value=1, max_value=size), min_size=rows, max_size=rows))
    starts = [draw(st.integers(min_value=0, max_value=20)) for _ in range(rows)]
    bucket = max(s + n for s, n in zip(starts, lens)) + draw(st.integers(min_value=0, max_value=5))
    return starts, lens, size, bucket


def naive_chunk(starts, lens, size, bucket):
    """Per row and token t: (position, slot-is-the-row's, mask row) written out by hand: real
    tokens sit at start + t and see [0, start + t]; pads sit at the last real position, see what
    it sees, and write to the scratch slot."""
    out = []
    for p, n in zip(starts, lens):
        row = []
        for t in range(size):
            pos = p + min(t, n - 1)
            row.append((pos, t < n, [j <= pos for j in range(bucket)]))
        out.append(row)
    return out


@settings(max_examples=30)
@given(chunk_case())
@example(([0], [1], 1, 1))
@example(([5, 0], [1, 3], 3, 8))  # a one-token chunk next to a full one
def test_chunk_positions_mask_and_writes_match_naive(case):
    starts, lens, size, bucket = case
    scratch = 9
    lens_t = torch.tensor(lens, dtype=torch.int32)
    positions = chunk_positions(torch.tensor(starts, dtype=torch.int32), lens_t, size)
    mask = chunk_mask(positions, bucket)
    # the slots layout: a row's table is [slot], so each real token's block is its slot
    slots = pad_writes(torch.arange(len(lens))[:, None].expand(len(lens), size), lens_t, scratch)
    assert positions.dtype == torch.int32 and mask.shape == (len(lens), 1, size, bucket)
    for b, row in enumerate(naive_chunk(starts, lens, size, bucket)):
        for t, (pos, real, mask_row) in enumerate(row):
            assert positions[b, t] == pos < bucket
            assert mask[b, 0, t].tolist() == mask_row and any(mask_row)
            assert slots[b, t] == (b if real else scratch)
        written = {int(positions[b, t]) for t in range(size) if slots[b, t] == b}
        access = chunk_access(starts[b], lens[b], size, bucket)
        assert written == set(access.write) and access.cache_len_after == starts[b] + lens[b]
        assert access.attend == range(starts[b] + lens[b])  # the last real token's mask row
        assert mask[b, 0, lens[b] - 1].nonzero().flatten().tolist() == list(access.attend)


def test_chunk_mask_windowed_matches_naive():
    positions = chunk_positions(torch.tensor([6], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 4)  # 6, 7, 8, 8
    mask = chunk_mask(positions, 12, "sliding", 4)
    for t, pos in enumerate([6, 7, 8, 8]):
        assert mask[0, 0, t].tolist() == [pos - 4 < j <= pos for j in range(12)]


@pytest.mark.parametrize(("cache_len", "n", "size", "bucket"), [(0, 0, 4, 8), (0, 5, 4, 8), (6, 3, 4, 8), (-1, 1, 4, 8)])
def test_chunk_access_rejects_what_does_not_fit(cache_len, n, size, bucket):
    with pytest.raises(BucketOverflowError):
        chunk_access(cache_len, n, size, bucket)


@settings(max_examples=30)
@given(st.integers(min_value=1, max_value=300), st.lists(st.integers(min_value=1, max_value=512), min_size=1, max_size=6, unique=True))
def test_chunk_buckets_are_the_decode_buckets_the_chunk_fits(size, decode):
    decode = tuple(sorted(decode))
    if size > decode[-1]:
        with pytest.raises(ConfigError):
            chunk_buckets(size, decode)
        return
    got = chunk_buckets(size, decode)
    assert got == tuple(b for b in decode if b >= size) and got[-1] == decode[-1]
    for end in range(1, decode[-1] + 1):  # every chunk end finds the same bucket as decode would, or the first >= size
        assert select_bucket(got, end) == select_bucket(decode, max(end, size))


def test_plan_graph_count_and_prefill_ladder():
    """SmolLM2-sized plan: max_context_length 2048, chunks of 128: one prefill bucket (128), chunk
    graphs over the decode buckets (128 .. 2048) per batch bucket; no 2048-token prefill graph."""
    plan = _plan(InferenceConfig(batch_size=5, max_context_length=2048, sequence_length=2048, prefill_chunk_size=128,
                                 backend="eager"))
    assert plan.prefill_buckets == (128,)
    assert plan.chunk_buckets == (128, 256, 512, 1024, 2048) == plan.decode_buckets
    chunk = [g for g in plan.graphs if g.phase == "chunk"]
    assert len(chunk) == len(plan.batch_buckets) * 5 == 20
    assert max(g.bucket for g in plan.graphs if g.phase == "prefill") == 128
    assert {t.name: t.shape for t in chunk[0].inputs}["input_ids"] == (1, 128)


def _plan(inference):
    hf = _hf()
    return neuronfx.make_plan(neuronfx.ModelConfig.from_hf(hf.config, hf.generation_config), inference)


@functools.cache
def _hf():
    return tiny_hf_model("llama", seed=3, max_position_embeddings=4096)


# --- chunk_step against an unchunked prefill ------------------------------------------------------


@functools.cache
def reference():
    """The unchunked eager runtime of the tiny llama, logits out (compiled once: a compile's heap
    trim costs about a second in a test process)."""
    return tiny_runtime(_hf())


@functools.cache
def chunked(size: int):
    return tiny_runtime(_hf(), prefill_chunk_size=size, prefill_buckets=None)


def runtimes(size: int):
    """(unchunked reference, chunked) eager runtimes of one tiny llama, logits out."""
    return reference(), chunked(size)


@pytest.mark.parametrize("size", [1, 7, 32])
def test_chunked_prefill_equals_unchunked(size):
    """Ragged prompts (1 to 32 tokens) in slots 2, 0, 3: the same first tokens, logits within
    1e-5, cache lengths, prompt masks and output counts as one unchunked prefill; decode then
    continues with the same tokens."""
    ref, rt = runtimes(size)
    prompts = [random_prompt(n, seed=n) for n in (32, 1, 19)]
    slots = [2, 0, 3]
    sampling = SamplingParams(repetition_penalty=1.3)  # greedy, and the prompt mask counts
    out, want = prefill_step(ref, neuronfx.init_state(ref), PrefillBatch(seq_ids=slots, prompts=prompts, sampling=[sampling] * 3))
    tokens, logits, state = chunked_prefill(rt, neuronfx.init_state(rt), slots, prompts, size, sampling)
    assert tokens == list(out.tokens)
    for r in range(3):
        assert torch.allclose(logits[r], out.logits[r], atol=1e-5, rtol=0), (r, (logits[r] - out.logits[r]).abs().max())
    assert state.cache_lens == want.cache_lens and state.generated == want.generated and state.live == want.live
    assert torch.equal(state.prompt_mask, want.prompt_mask) and torch.equal(state.output_counts, want.output_counts)
    for _ in range(3):
        batch = neuronfx.DecodeBatch(seq_ids=slots, input_ids=list(out.tokens), sampling=[sampling] * 3)
        out, want = neuronfx.decode_step(ref, want, batch)
        mine, state = neuronfx.decode_step(rt, state, attrs.evolve(batch, input_ids=tokens))
        tokens = list(mine.tokens)
        assert tokens == list(out.tokens) and torch.allclose(mine.logits, out.logits, atol=1e-5, rtol=0)


def test_chunk_continues_a_slot_filled_by_something_else():
    """A live slot whose cache [0, p) another step filled (as a prefix cache would), generated
    0: chunks continue at p and give the unchunked prefill's token."""
    ref, rt = runtimes(7)
    prompt = random_prompt(20, seed=11)
    want, _ = prefill_step(ref, neuronfx.init_state(ref), PrefillBatch(seq_ids=[1], prompts=[prompt], sampling=[GREEDY]))
    _, _, state = chunked_prefill(rt, neuronfx.init_state(rt), [1], [prompt[:7]], 7)  # slot 1 holds 7 tokens, generated 1
    # the state a prefix cache would make: slot 1 live with the prefix, no token generated
    state = neuronfx.runtime.state.advance(state, cache_lens=state.cache_lens, generated=(0,) * 4, live=state.live,
                                           rng_key=state.rng_key)
    out, state = chunk_step(rt, state, ChunkBatch(seq_ids=[1], chunks=[prompt[7:14]], sampling=[GREEDY], final=[False]))
    out, state = chunk_step(rt, state, ChunkBatch(seq_ids=[1], chunks=[prompt[14:]], sampling=[GREEDY], final=[True]))
    assert out.tokens == want.tokens and torch.allclose(out.logits, want.logits, atol=1e-5, rtol=0)
    assert state.cache_lens[1] == 20 and state.generated[1] == 1


def test_chunk_pads_write_no_slot_a_request_sees():
    """A 3-token chunk in a 7-token graph next to other slots: every slot but the row's (and the
    scratch slot) keeps its bytes, and the row's slot changes only at its 3 positions."""
    _, rt = runtimes(7)
    state = neuronfx.init_state(rt)
    for layer in state.kv:
        for t in layer:
            t.normal_()
    before = [t.clone() for layer in state.kv for t in layer]
    _, state = chunk_step(rt, state, ChunkBatch(seq_ids=[2], chunks=[[5, 6, 7]], sampling=[GREEDY], final=[False]))
    scratch = rt.plan.kv.scratch_slot
    for old, new in zip(before, (t for layer in state.kv for t in layer)):
        changed = (old != new).any(-1).any(1)  # (slots, positions)
        assert changed[2].nonzero().flatten().tolist() == [0, 1, 2]
        assert not changed[[s for s in range(scratch) if s != 2]].any()


def test_chunk_step_errors_before_any_change():
    _, rt = runtimes(7)
    state = neuronfx.init_state(rt)
    state = chunked_prefill(rt, state, [0], [[1, 2, 3]], 7)[2]  # slot 0 decodes
    cases = [
        (ChunkBatch(seq_ids=[0], chunks=[[1]], sampling=[GREEDY], final=[True]), SlotError),  # slot 0 decodes
        (ChunkBatch(seq_ids=[1], chunks=[[]], sampling=[GREEDY], final=[True]), EmptyPromptError),
        (ChunkBatch(seq_ids=[1], chunks=[[1] * 8], sampling=[GREEDY], final=[True]), PromptTooLongError),
        (ChunkBatch(seq_ids=[1], chunks=[[999]], sampling=[GREEDY], final=[True]), TokenOutOfVocabError),
        (ChunkBatch(seq_ids=[1], chunks=[[1]], sampling=[GREEDY], final=[1]), InputError),
        (ChunkBatch(seq_ids=[1, 1], chunks=[[1], [2]], sampling=[GREEDY] * 2, final=[True] * 2), SlotError),
        (ChunkBatch(seq_ids=[1], chunks=[[1], [2]], sampling=[GREEDY], final=[True]), InputError),
        (ChunkBatch(seq_ids=[1], chunks=[[1]], sampling=[GREEDY], final=[True], prompt_lens=[3]), InputError),
        (PrefillBatch(seq_ids=[1], prompts=[[1]], sampling=[GREEDY]), InputError),
    ]
    for batch, error in cases:
        with pytest.raises(error):
            chunk_step(rt, state, batch)
    assert not state.consumed and state.cache_lens == (3, 0, 0, 0)
    ref, _ = runtimes(7)
    with pytest.raises(InputError, match="no chunk graphs"):
        chunk_step(ref, neuronfx.init_state(ref), ChunkBatch(seq_ids=[0], chunks=[[1]], sampling=[GREEDY], final=[True]))
    with pytest.raises(PromptTooLongError, match="chunk_step"):  # a prompt longer than the prefill buckets
        prefill_step(rt, state, PrefillBatch(seq_ids=[1], prompts=[[1] * 8], sampling=[GREEDY]))


def test_long_prompt_fills_max_context_length():
    """max_context_length 32 with chunks of 7 and no prefill graph over 7: a prompt of 32 tokens
    hits the limit exactly; one more token is PromptTooLongError."""
    _, rt = runtimes(7)
    assert rt.plan.prefill_buckets == (7,) and rt.plan.inference.max_context_length == 32
    prompt = random_prompt(32, seed=1)
    _, _, state = chunked_prefill(rt, neuronfx.init_state(rt), [0], [prompt], 7)
    assert state.cache_lens[0] == 32
    state = neuronfx.release(rt, state, [0])
    _, _, state = chunked_prefill(rt, state, [0], [prompt[:28]], 7)
    state = neuronfx.runtime.state.advance(state, cache_lens=state.cache_lens, generated=(0,) * 4, live=state.live,
                                           rng_key=state.rng_key)
    with pytest.raises(PromptTooLongError, match="max_context_length=32"):
        chunk_step(rt, state, ChunkBatch(seq_ids=[0], chunks=[[1] * 5], sampling=[GREEDY], final=[True]))


def test_2000_token_prompt_with_max_context_length_2048_matches_transformers():
    """max_context_length 2048 and chunks of 128: no prefill graph over 128 tokens, and a
    2000-token prompt (16 chunks, the last partial) gives transformers' greedy tokens (the
    SmolLM2 case, shorter, is in test_e2e_smollm2.py)."""
    hf = tiny_hf_model("llama", seed=5, max_position_embeddings=2048)
    rt = tiny_runtime(hf, batch_size=1, max_context_length=2048, sequence_length=2048, prefill_chunk_size=128,
                      prefill_buckets=None, decode_buckets=None)
    assert max(rt.plan.prefill_buckets) == 128
    assert sorted({g.bucket for g in rt.plan.graphs if g.phase == "chunk"}) == [128, 256, 512, 1024, 2048]
    prompt = random_prompt(2000, seed=11)
    got, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [prompt], max_new_tokens=4)
    assert list(got.token_ids[0]) == hf_greedy(hf, prompt, 4)


# --- the scheduler ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 7, 32])
def test_generate_with_chunks_equals_unchunked(size):
    """generate() chunks the prompts longer than the chunk size (prefills the others): the same
    greedy tokens as whole-prompt prefill, for more prompts than slots."""
    ref, rt = runtimes(size)
    prompts = [random_prompt(n, seed=n) for n in (30, 3, 17, 9, 25, 32)]
    want, _ = neuronfx.generate(ref, neuronfx.init_state(ref), prompts, max_new_tokens=5)
    got, state = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=5)
    assert got.token_ids == want.token_ids and not any(state.live)


def test_choices_asking_for_prompt_logprobs_of_a_chunked_prompt():
    """n = 2 seeded choices of a 21-token prompt in chunks of 8, each asking for prompt logprobs:
    a choice does not fork (its own prefill computes them), so admission counts its whole prompt
    and chunks it (it was counted as one forked token and prefilled whole: BucketOverflowError).
    The same tokens and prompt logprobs as whole-prompt prefill."""
    hf = tiny_hf_model("llama", seed=4)
    sampling = SamplingParams(temperature=1.0, seed=3, prompt_logprobs=1)
    results = []
    for options in (dict(prefill_chunk_size=8, prefill_buckets=(8,)), {}):
        rt = tiny_runtime(hf, enable_prompt_logprobs=True, **options)
        result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [random_prompt(21, 3)], max_new_tokens=5, sampling=sampling,
                                      n=2, eos_token_ids=[])
        results.append(result)
    chunked, whole = results
    assert chunked.token_ids == whole.token_ids and len(set(chunked.token_ids)) == 2
    for got, want in zip(chunked.prompt_logprobs, whole.prompt_logprobs):
        assert len(got) == len(want) == 21 and got[0] is None
        assert [g.token_id for g in got[1:]] == [w.token_id for w in want[1:]] == random_prompt(21, 3)[1:]
        assert max(abs(g.logprob - w.logprob) for g, w in zip(got[1:], want[1:])) < 1e-4


@pytest.mark.parametrize(("budget", "chunk_lens"), [(None, [7, 7, 7, 7, 2]), (5, [3] * 10)])
def test_long_prompt_admitted_while_others_decode(budget, chunk_lens):
    """Two requests decode; a 30-token prompt arrives. Each iteration both running requests get
    a token and the prompt advances one chunk (budget 11 = chunk 7 + 4 slots: chunks of 7; budget
    5 with 2 decoding: chunks of 3); its last chunk gives its first token and it decodes from the
    next iteration; everyone's tokens equal a solo run."""
    ref, rt = runtimes(7)
    from neuronfx.runtime.scheduler import Queue, Request, step, submit

    short = [random_prompt(5, seed=1), random_prompt(6, seed=2)]  # both fit the prefill bucket (7)
    long = random_prompt(30, seed=3)
    solo = [neuronfx.generate(ref, neuronfx.init_state(ref), [p], max_new_tokens=16)[0].token_ids[0] for p in short + [long]]
    state, queue, eos, tokens = neuronfx.init_state(rt), Queue(), frozenset(), {0: [], 1: [], 2: []}
    for i, p in enumerate(short):
        queue = submit(queue, i, Request(prompt=tuple(p), sampling=SamplingParams(max_tokens=16)))
    events, state, queue = step(rt, state, queue, eos, max_num_batched_tokens=budget)
    queue = submit(queue, 2, Request(prompt=tuple(long), sampling=SamplingParams(max_tokens=16)))
    seen = []
    while not queue.idle:
        for e in events:
            tokens[e.index].append(e.token_id)
        computed = queue.prefilling[0].computed if queue.prefilling else None
        events, state, queue = step(rt, state, queue, eos, max_num_batched_tokens=budget)
        if queue.prefilling or (computed is not None and not tokens[2]):
            seen.append((queue.prefilling[0].computed if queue.prefilling else 30) - (computed or 0))
            assert sorted(e.index for e in events if e.index != 2) == [0, 1]  # the running ones decode every iteration
            assert len([e for e in events if e.index == 2]) == (0 if queue.prefilling else 1)  # its first token
    for e in events:
        tokens[e.index].append(e.token_id)
    assert seen == chunk_lens
    assert [tuple(tokens[i]) for i in range(3)] == list(solo)


def test_budget_and_config_errors():
    _, rt = runtimes(7)
    from neuronfx.runtime.scheduler import Queue, step

    for bad in (0, 1.5, True):
        with pytest.raises(InputError, match="max_num_batched_tokens"):
            step(rt, neuronfx.init_state(rt), Queue(), frozenset(), max_num_batched_tokens=bad)
    from neuronfx.server.engine import Engine
    from neuronfx.server.metrics import make_metrics

    with pytest.raises(InputError, match="max_num_batched_tokens=0"):
        Engine(lambda: None, max_waiting=1, metrics=make_metrics(), max_num_batched_tokens=0)
    for bad, match in (({"prefill_chunk_size": 0}, ">= 1"), ({"prefill_chunk_size": 33}, "> max_context_length"),
                       ({"prefill_chunk_size": 8, "speculation_length": 3}, "speculation"),
                       ({"prefill_chunk_size": 8, "prefill_buckets": (8, 16)}, "prefill_chunk_size")):
        with pytest.raises(ConfigError, match=match):
            InferenceConfig(max_context_length=32, sequence_length=64, **bad)


@pytest.mark.parametrize("model_type", ["phi3", "gemma3_text"])
def test_chunks_of_longrope_and_sliding_models_equal_unchunked(model_type):
    """phi3 (longrope, switch at 20 tokens): a 30-token prompt rotates with the long factors in
    every chunk when each chunk carries the whole prompt length (without it the first chunks, 7
    and 14 tokens long, would rotate with the short ones); gemma3 (sliding window 5 < chunk 7,
    soft-capped logits). Logits within 1e-5 of one unchunked prefill."""
    hf = tiny_hf_model(model_type, seed=2)
    ref, rt = tiny_runtime(hf), tiny_runtime(hf, prefill_chunk_size=7, prefill_buckets=None)
    prompt = [t % 250 for t in random_prompt(30, seed=4)]
    want, _ = prefill_step(ref, neuronfx.init_state(ref), PrefillBatch(seq_ids=[0], prompts=[prompt], sampling=[GREEDY]))

    def chunked_logits(prompt_lens):
        state = neuronfx.init_state(rt)
        for start in range(0, 30, 7):
            final = start + 7 >= 30
            batch = ChunkBatch(seq_ids=[0], chunks=[prompt[start:start + 7]], sampling=[GREEDY], final=[final],
                               prompt_lens=prompt_lens)
            out, state = chunk_step(rt, state, batch)
        return out

    out = chunked_logits([30])
    assert out.tokens == want.tokens and torch.allclose(out.logits, want.logits, atol=1e-5, rtol=0)
    if model_type == "phi3":
        assert not torch.allclose(chunked_logits(None).logits, want.logits, atol=1e-3, rtol=0)
