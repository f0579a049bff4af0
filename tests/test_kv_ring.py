"""The blocks layout's window ring (``config.kv.KVLayout.ring_blocks``): sliding-window and
chunked-attention layers keep a fixed ring of blocks per slot, so their KV memory follows the
window, not the context. Its size is property-tested against a simulation of every step kind
(prefill, chunks, decode, verify passes that rewind); a tiny gemma3 (window 5, a sliding layer
beside a full one) at a context 8x its window gives transformers' tokens and the slots layout's
logits through prefill, chunks, speculation, forks and preemption (eager here; inductor in
``test_gemma3.py``, whose module runtime uses the ring, and tensor parallel in
``test_tensor_parallel.py``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import GEMMA3, hf_greedy, random_prompt, run_steps, tiny_hf_model, tiny_plan, tiny_runtime
from hypothesis import given
from hypothesis import strategies as st

import neuronfx
from neuronfx import SamplingParams
from neuronfx.config.kv import ring_table
from neuronfx.config.kv_blocks import ring_size
from neuronfx.runtime import blocks as manager
from neuronfx.runtime.requests import Queue, submit
from neuronfx.runtime.scheduler import step as scheduler_step

WINDOW = GEMMA3["sliding_window"]  # 5
RING = dict(kv_layout="blocks", kv_block_size=4)
NO_EOS: frozenset[int] = frozenset()
# 8x the window: prompts and outputs reach 40+ positions, the ring holds 12 (3 blocks of 4)
PROMPTS = [[t % 250 for t in random_prompt(n, seed)] for n, seed in ((10, 1), (3, 2), (21, 3))]
NEW = 40


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("gemma3_text", seed=21)


@pytest.fixture(scope="module")
def want(hf) -> list[list[int]]:
    return [hf_greedy(hf, p, NEW) for p in PROMPTS]


# --- sizes ----------------------------------------------------------------------------------------


@given(st.integers(1, 40), st.integers(1, 12), st.sampled_from([4, 8, 16]), st.integers(1, 100),
       st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12)), max_size=30))
def test_the_ring_holds_every_position_a_step_attends(reach: int, step: int, bs: int, prompt: int, moves: list) -> None:
    """A slot's ring of ``ring_size`` blocks (one fewer fails) through a prefill (which keeps the
    prompt's last ring positions) and steps writing up to ``step`` positions then accepting 1..t of them (a
    verify pass rewinds; a chunk or decode accepts all): after every step's writes, each of its
    queries finds every position it attends (the last ``reach``) in its ring block."""
    w = ring_size(reach, step, bs)
    table = ring_table(torch.tensor([1, 3]), 200, w, 3)
    assert table[1].tolist() == [3 * w] * 200  # the scratch slot's rows: one block
    table = table[0].tolist()
    held: dict[tuple[int, int], int] = {}

    def spot(j: int) -> tuple[int, int]:
        return table[j // bs], j % bs

    for j in range(max(0, prompt - w * bs), prompt):
        held[spot(j)] = j
    s = prompt
    for t, accepted in moves:
        t = min(t, step)
        for j in range(s, s + t):
            held[spot(j)] = j
        for p in range(s, s + t):
            assert all(held.get(spot(j)) == j for j in range(max(0, p - reach + 1), p + 1)), (p, s, t)
        s += min(accepted, t)
    assert all(w <= table[j] < 2 * w for j in range(200))  # slot 1's ring: blocks [w, 2w)


def test_ring_sizes(hf) -> None:
    plan = tiny_plan(hf, batch_size=4, **RING)
    kv = plan.kv
    assert kv.ring_layers == (True, False) and kv.ring_blocks == ring_size(WINDOW, 1, 4) + 1 == 3
    assert kv.layer_shape(0) == (4 * 3 + 1, 2, 4, 32) and kv.layer_shape(1) == kv.shape == (4 * 16 + 1, 2, 4, 32)
    layer_block = 2 * 2 * 4 * 32 * 4  # K and V, 2 heads, 4 positions, head_dim 32, fp32
    assert kv.block_nbytes == layer_block and kv.nbytes == 65 * layer_block + 13 * layer_block
    assert kv.nbytes < tiny_plan(hf, batch_size=4, enable_prefix_caching=True, prefix_block_size=4, **RING).kv.nbytes
    assert tiny_plan(hf, kv_cache_memory=13 * layer_block + 20 * layer_block, **RING).kv.total_blocks == 21  # ring first
    assert tiny_plan(hf, speculation_length=3, draft_layers=1, **RING).kv.ring_blocks == ring_size(WINDOW, 3, 4) + 1 == 3
    assert tiny_plan(hf, prefill_chunk_size=8, prefill_buckets=None, **RING).kv.ring_blocks == ring_size(WINDOW, 8, 4) + 1 == 4
    # no ring: prefix caching (cached blocks hold every layer), a model without windows, the slots layout
    assert tiny_plan(hf, enable_prefix_caching=True, prefix_block_size=4, **RING).kv.ring_blocks is None
    assert tiny_plan(tiny_hf_model("llama"), **RING).kv.ring_blocks is None and tiny_plan(hf).kv.ring_blocks is None


def test_gemma3_1b_shape_memory_follows_the_window() -> None:
    """gemma-3-1b's attention (26 layers, 22 sliding with window 512, 1 KV head of 256), bf16, one
    request of 8,192 positions: 208 MiB in a slot; 43.3 MiB with the ring (4 full layers x 8,192
    positions + 22 x 528: the window and a block of margin), past the scratch blocks. Sizes only:
    no weights are built."""
    from transformers import Gemma3TextConfig

    from neuronfx import InferenceConfig, ModelConfig, make_plan

    hf_config = Gemma3TextConfig(vocab_size=1024, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                                 num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                                 query_pre_attn_scalar=256, max_position_embeddings=32768)
    model = ModelConfig.from_hf(hf_config)
    plans = {layout: make_plan(model, InferenceConfig(batch_size=1, max_context_length=8192, sequence_length=8192, dtype="bfloat16",
                                                      kv_layout=layout, prefill_buckets=(8192,), decode_buckets=(8192,)))
             for layout in ("slots", "blocks")}
    per_position = 2 * 256 * 2  # one layer's K and V of one KV head, bf16
    slots, blocks = plans["slots"].kv, plans["blocks"].kv
    assert sum(blocks.ring_layers) == 22 and blocks.ring_blocks == 33 and blocks.block_size == 16
    assert slots.nbytes - slots.block_nbytes == 26 * 8192 * per_position == 208 * 2**20  # one slot (the other: scratch)
    scratch = blocks.block_nbytes + 22 * 16 * per_position  # the table's and the ring's scratch blocks
    assert blocks.nbytes - scratch == (4 * 8192 + 22 * 528) * per_position == 44384 * 2**10  # 43.3 MiB


# --- tiny gemma3 at 8x its window -----------------------------------------------------------------


def test_eager_ragged_batch_equals_transformers_and_the_slots_layout(hf, want) -> None:
    rt, slots = tiny_runtime(hf, **RING), tiny_runtime(hf)
    tokens, logits, _, state = run_steps(rt, neuronfx.init_state(rt), [0, 2, 3], PROMPTS, NEW)
    ref_tokens, ref_logits, _, _ = run_steps(slots, neuronfx.init_state(slots), [0, 2, 3], PROMPTS, NEW)
    assert tokens == want == ref_tokens
    assert max((a - b).abs().max().item() for ra, rb in zip(logits, ref_logits) for a, b in zip(ra, rb)) <= 1e-5
    assert max(len(p) for p in PROMPTS) + NEW >= 8 * WINDOW and rt.plan.kv.ring_blocks * 4 < 8 * WINDOW
    # the full layer's blocks follow the context; the window's memory is the ring, whatever the length
    assert [manager.owned(rt.plan, state.blocks, s) for s in (0, 2, 3)] == [-(-(len(p) + NEW - 1) // 4) for p in PROMPTS]


@pytest.mark.parametrize("options", [
    dict(prefill_chunk_size=8, prefill_buckets=None),  # chunks read the window from the ring
    dict(speculation_length=4, draft_layers=1),  # the draft is the sliding layer; verify passes rewind
    dict(speculation_length=3, speculative_method="ngram"),
], ids=["chunked", "self-speculation", "ngram"])
def test_eager_generate_equals_transformers(hf, want, options: dict) -> None:
    rt = tiny_runtime(hf, **options, **RING)
    result, state = neuronfx.generate(rt, neuronfx.init_state(rt), PROMPTS, max_new_tokens=NEW, eos_token_ids=NO_EOS)
    assert [list(t) for t in result.token_ids] == want and rt.plan.kv.ring_blocks
    assert manager.free_count(rt.plan, state.blocks) == rt.plan.kv.total_blocks - 1


def test_forks_copy_the_ring_and_preemption_recomputes_it(hf) -> None:
    """n = 3 sampled choices fork the prompt (full blocks shared, the ring copied per choice), or
    with a chunked prompt are prefilled each (a running parent's ring no longer holds the prompt's window);
    under one request's worth of blocks the scheduler preempts and recomputes rows whose ring
    it rewrites: every output equals the slots layout's."""
    sampling = SamplingParams(temperature=1.0, seed=7)
    outs = []
    for options in ({}, RING):
        rt = tiny_runtime(hf, **options)
        result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [PROMPTS[2]], max_new_tokens=30, sampling=sampling,
                                      n=3, eos_token_ids=NO_EOS)
        outs.append(result.token_ids)
    assert outs[0] == outs[1] and len(set(outs[1])) > 1
    chunked = []  # a prompt in chunks: its parent runs by the time a choice is admitted, which is then prefilled (in chunks)
    for options in ({}, RING):
        rt = tiny_runtime(hf, prefill_chunk_size=8, prefill_buckets=(8,), **options)
        result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [PROMPTS[2]], max_new_tokens=20, sampling=sampling,
                                      n=2, eos_token_ids=NO_EOS)
        chunked.append(result.token_ids)
    assert chunked[0] == chunked[1] and len(set(chunked[1])) > 1
    prompts = [random_prompt(6 + 3 * i, 10 + i) for i in range(4)]
    sampling = [SamplingParams(max_tokens=40), SamplingParams(max_tokens=33, temperature=0.8, seed=3),
                SamplingParams(max_tokens=36), SamplingParams(max_tokens=30)]
    slots = tiny_runtime(hf, batch_size=1)
    want, _ = neuronfx.generate(slots, neuronfx.init_state(slots), prompts, sampling=sampling, eos_token_ids=NO_EOS)
    rt = tiny_runtime(hf, num_kv_blocks=16, prefill_chunk_size=8, prefill_buckets=(8,), **RING)
    state, queue, outputs = neuronfx.init_state(rt), Queue(), {}
    for i, (p, sp) in enumerate(zip(prompts, sampling)):
        queue = submit(queue, i, neuronfx.Request(prompt=tuple(p), sampling=sp))
    while not queue.idle:
        events, state, queue = scheduler_step(rt, state, queue, NO_EOS)
        for e in events:
            outputs.setdefault(e.index, []).append(e.token_id)
    assert [tuple(outputs[i]) for i in range(4)] == list(want.token_ids) and queue.preemptions > 0


@pytest.mark.parametrize("fused", [False, True], ids=["draft-model", "fused"])
def test_a_draft_models_ring_holds_a_speculate_step(hf, want, fused: bool) -> None:
    """A draft model writes k - 1 drafts a verify pass may reject: a ring planned for decode steps
    holds them up to k = block_size + 2 (its block of margin); at k = 10 over blocks of 4 it is a
    block short and refused; compiled with speculation_length=k the draft (another seed: verify
    passes reject) drafts exactly as a slots-layout draft does (the same drafted and accepted
    counts), the target's tokens being transformers'."""
    from neuronfx.errors import ConfigError

    drafter = tiny_hf_model("gemma3_text", seed=22)
    neuronfx.with_draft(tiny_runtime(hf, speculation_length=6, **RING), tiny_runtime(drafter, output_logits=True, **RING))
    with pytest.raises(ConfigError, match=r"draft's window ring holds 3 blocks of 4 positions; drafting for speculation_length=10 "
                                          r"needs 4 .* compile the draft with speculation_length=10"):
        neuronfx.with_draft(tiny_runtime(hf, speculation_length=10, **RING), tiny_runtime(drafter, output_logits=True, **RING))
    runs = []
    for layout in ({}, RING):
        rt = neuronfx.with_draft(tiny_runtime(hf, speculation_length=10, fused_speculation=fused, **layout),
                                 tiny_runtime(drafter, output_logits=True, speculation_length=10, **layout))
        result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), PROMPTS, max_new_tokens=NEW, eos_token_ids=NO_EOS)
        assert [list(t) for t in result.token_ids] == want
        runs.append(result.speculation)
    assert runs[0] == runs[1] and sum(s.drafted for s in runs[1]) > 0
