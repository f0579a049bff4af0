"""Prefix caching end to end on a tiny llama (eager): greedy tokens identical with and without it
(prompts sharing no block, one, many, a partial block), eviction under a small bound, random
submit / step / abort sequences against solo runs, and no reuse across weights or plans.

Plan: chunks of 8 tokens (``prefill_chunk_size``), blocks of 4, prefill buckets (8,), decode
buckets (16, 32, 64), max_context_length 32, sequence_length 64, batch_size 4.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from helpers import GREEDY, hf_greedy, random_prompt, tiny_hf_model, tiny_runtime
from hypothesis import example, given, settings
from hypothesis import strategies as st

import neuronfx
from neuronfx import InferenceConfig, PrefillBatch, Request, SamplingParams
from neuronfx.errors import InputError
from neuronfx.runtime.prefix import load_prefix, prefill_cached, prefix_stats, store_prefix
from neuronfx.runtime.prefix_pool import identity_key, pool_nbytes
from neuronfx.runtime.scheduler import Queue, abort, step, submit

PC = dict(prefill_chunk_size=8, prefill_buckets=(8,), enable_prefix_caching=True, prefix_block_size=4)
BASE = random_prompt(32, seed=70)


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama")


@pytest.fixture(scope="module")
def rt_on(hf):
    return tiny_runtime(hf, **PC)


@pytest.fixture(scope="module")
def rt_off(hf):
    return tiny_runtime(hf, **(PC | {"enable_prefix_caching": False}))


def tail(n: int, seed: int) -> list[int]:
    return random_prompt(n, seed)


def run(rt, state, prompts, n=5):
    """Greedy tokens of ``prompts`` scheduled together on ``state``; returns (tokens, state)."""
    requests = [Request(prompt=tuple(p), sampling=SamplingParams(max_tokens=n)) for p in prompts]
    tokens = [[] for _ in prompts]
    for e in neuronfx.schedule(rt, state, requests, frozenset()):
        if isinstance(e, neuronfx.TokenEvent):
            tokens[e.index].append(e.token_id)
        else:
            state = e.state
    return tokens, state


_SOLO: dict = {}


def solo(rt_off, prompt, n=5):
    """Greedy tokens of ``prompt`` alone on a fresh state without prefix caching, by the steps
    themselves: chunks of 8 from position 0, then decode steps (memoised)."""
    key = (id(rt_off), tuple(prompt), n)
    if key not in _SOLO:
        state = neuronfx.init_state(rt_off)
        for start in range(0, len(prompt), 8):
            chunk = list(prompt[start:start + 8])
            out, state = neuronfx.chunk_step(rt_off, state, neuronfx.ChunkBatch(
                seq_ids=[0], chunks=[chunk], sampling=[GREEDY], final=[start + len(chunk) == len(prompt)]))
        tokens = [out.tokens[0]]
        while len(tokens) < n:
            out, state = neuronfx.decode_step(rt_off, state, neuronfx.DecodeBatch(seq_ids=[0], input_ids=[tokens[-1]],
                                                                                   sampling=[GREEDY]))
            tokens.append(out.tokens[0])
        _SOLO[key] = (rt_off, tokens)  # the runtime kept alive: its id is not reused
    return _SOLO[key][1]


def test_tokens_identical_for_shared_prefixes(hf, rt_on, rt_off) -> None:
    """One warm state, prompts one after another: each reuses the blocks the ones before cached,
    and gives the tokens of a solo run without prefix caching (and of transformers)."""
    prompts = [  # (prompt, tokens expected from the cache)
        (BASE[:13], 0),  # cold
        (BASE[:12] + tail(13, 1), 12),  # many blocks (3)
        (BASE[:4] + tail(6, 2), 4),  # one block
        (BASE[:6] + tail(5, 3), 4),  # a partial second block: only the first is reused
        (tail(20, 4), 0),  # nothing shared
        (BASE[:13], 12),  # the same prompt: all but its last (partial) block
        (BASE[:8], 4),  # exactly two blocks: the last is prefilled to sample the first token
        (BASE[:25] + tail(7, 5), 12),  # longer than one chunk past the hit: 3 chunks from 12
    ]
    state, hits = neuronfx.init_state(rt_on), 0
    for prompt, hit in prompts:
        tokens, state = run(rt_on, state, [prompt])
        hits += hit
        assert prefix_stats(state).hits == hits, prompt
        assert tokens[0] == solo(rt_off, prompt)
    assert hf_greedy(hf, prompts[1][0], 5) == solo(rt_off, prompts[1][0])
    stats = prefix_stats(state)
    assert stats.queries == sum(len(p) for p, _ in prompts) and stats.lookups == len(prompts) and stats.evictions == 0


def test_batch_of_prompts_sharing_blocks(rt_on, rt_off) -> None:
    """Requests admitted together: hit rows continue by chunks, miss rows take one prefill."""
    state = neuronfx.init_state(rt_on)
    _, state = run(rt_on, state, [BASE[:16]])
    prompts = [BASE[:9] + tail(3, 10), tail(6, 11), BASE[:16] + tail(10, 12), BASE[:2]]
    tokens, state = run(rt_on, state, prompts)
    assert tokens == [solo(rt_off, p) for p in prompts]
    assert prefix_stats(state).hits == 8 + 0 + 16 + 0


def test_logits_close_to_an_unreused_prefill(rt_on, rt_off) -> None:
    """The first token's logits after a hit are within 1e-5 of a prefill without prefix caching."""
    prompt = BASE[:12] + tail(5, 20)
    state = neuronfx.init_state(rt_on)
    _, state = run(rt_on, state, [BASE[:14]])
    batch = PrefillBatch(seq_ids=[1], prompts=[prompt], sampling=[GREEDY])
    out, state = prefill_cached(rt_on, state, batch)
    assert prefix_stats(state).hits == 12
    ref_state = neuronfx.init_state(rt_off)
    for start in range(0, len(prompt), 8):
        chunk = prompt[start:start + 8]
        want, ref_state = neuronfx.chunk_step(rt_off, ref_state, neuronfx.ChunkBatch(
            seq_ids=[1], chunks=[chunk], sampling=[GREEDY], final=[start + len(chunk) == len(prompt)]))
    torch.testing.assert_close(out.logits, want.logits, atol=1e-5, rtol=0)
    assert out.tokens == want.tokens


def test_eviction_under_a_small_bound_keeps_tokens_exact(hf, rt_off) -> None:
    rt = _bounded(hf, 3)
    assert pool_nbytes(rt.plan) == 2 * 2 * 3 * 2 * 4 * 16 * 4  # K and V, 2 layers, 3 blocks of (2 heads, 4 tokens, 16 dims) fp32
    state = neuronfx.init_state(rt)
    # (prompt, hit tokens, evictions so far): LRU evicts the tail of the least recent prefix first
    prompts = [(BASE[:13], 0, 0), (tail(9, 30), 0, 2), (BASE[:6] + tail(3, 31), 4, 3), (tail(9, 30), 4, 4), (BASE[:9], 4, 5)]
    hits = 0
    for p, hit, evictions in prompts:
        tokens, state = run(rt, state, [p], n=1)  # one token each: only prompt blocks are cached
        hits += hit
        assert tokens[0] == solo(rt_off, p, 1)
        assert state.prefix.store.num_cached == 3 and (prefix_stats(state).hits, prefix_stats(state).evictions) == (hits, evictions)


prompt_parts = st.lists(st.tuples(st.sampled_from([0, 4, 6, 9, 12, 17]), st.integers(0, 3), st.integers(1, 7)),
                        min_size=1, max_size=6)


@settings(max_examples=8, deadline=None)
@example(parts=[(12, 1, 4)], bound=None, aborts=[3, 4], max_tokens=4)  # aborts a chunked request once it decodes
@given(parts=prompt_parts, bound=st.sampled_from([3, None]), aborts=st.lists(st.integers(0, 5), max_size=2),
       max_tokens=st.integers(1, 4))
def test_random_submit_step_abort_against_solo_runs(rt_on, rt_off, hf, parts, bound, aborts, max_tokens) -> None:
    """Requests (a shared prefix of 0-17 tokens + a random tail) submitted one per scheduler
    iteration, some aborted while running, under a small cache bound: every finished request's
    tokens are its solo run's."""
    rt = rt_on if bound is None else _bounded(hf, bound)
    parts = [(17, 0, 3)] + parts  # a first request whose blocks the others may reuse
    prompts = [BASE[:n] + tail(k, 40 + seed) for n, seed, k in parts]
    state, queue, tokens, pending = neuronfx.init_state(rt), Queue(), {}, list(enumerate(prompts))
    finished = set()
    it = 0
    while pending or not queue.idle:
        if pending:
            i, p = pending.pop(0)
            queue = submit(queue, i, Request(prompt=tuple(p), sampling=SamplingParams(max_tokens=max_tokens)), rt)
        if it in aborts and queue.running:
            index = queue.running[0].index
            state, queue = abort(rt, state, queue, index)
            tokens.pop(index, None)
        events, state, queue = step(rt, state, queue, frozenset())
        for e in events:
            tokens.setdefault(e.index, []).append(e.token_id)
            if e.finish_reason is not None:
                finished.add(e.index)
        it += 1
    for i in finished & set(tokens):
        assert tokens[i] == solo(rt_off, prompts[i], max_tokens)
    if bound is None:  # nothing evicted: every later prompt sharing a whole block with the first reuses it
        assert prefix_stats(state).hits >= sum(4 * min(min(n, 17) // 4, (n + k - 1) // 4) for n, _, k in parts[1:])
    assert state.prefix.store.num_cached <= state.prefix.store.num_blocks
    assert all(e.refs == 0 for e in state.prefix.store.entries.values())


_BOUNDED: dict = {}


def _bounded(hf, bound):
    if bound not in _BOUNDED:
        _BOUNDED[bound] = tiny_runtime(hf, **(PC | {"max_prefix_blocks": bound}))
    return _BOUNDED[bound]


def test_no_reuse_across_weights_or_plans(hf, rt_on) -> None:
    """Same plan, other weights: a state carried over finds nothing (the hash chain starts from
    the weights' digest) and gives the other model's own tokens. Another plan: another key."""
    other_hf = tiny_hf_model("llama", seed=1)
    other = tiny_runtime(other_hf, **PC)
    assert other.prefix_key != rt_on.prefix_key and len(rt_on.prefix_key) == 32
    assert identity_key(attrs.evolve(rt_on.plan, inference=attrs.evolve(rt_on.plan.inference, max_logprobs=5)),
                        rt_on.weights) != rt_on.prefix_key
    assert attrs.evolve(rt_on).prefix_key == rt_on.prefix_key  # a copy on the same weights keeps it
    state = neuronfx.init_state(rt_on)
    _, state = run(rt_on, state, [BASE[:13]])
    tokens, state = run(other, state, [BASE[:13]])
    assert prefix_stats(state).hits == 0
    assert tokens[0] == hf_greedy(other_hf, BASE[:13], 5)


def test_load_and_store_check_their_inputs(rt_on, rt_off) -> None:
    with pytest.raises(InputError, match="does not cache prefixes"):
        load_prefix(rt_off, neuronfx.init_state(rt_off), [0], [[1, 2]])
    _, state = run(rt_on, neuronfx.init_state(rt_on), [BASE[:9]])
    matches, state = load_prefix(rt_on, state, [2], [BASE[:9]])
    assert state.live[2] and state.cache_lens[2] == 8 and state.generated[2] == 0
    assert state.prompt_mask[2].nonzero().flatten().tolist() == sorted(set(BASE[:8]))
    with pytest.raises(InputError, match="holds 8 tokens < its prompt's 9"):
        store_prefix(rt_on, state, [2], [BASE[:9]], matches)
    with pytest.raises(InputError, match="pass the Match load_prefix returned for this prompt"):
        store_prefix(rt_on, state, [2], [tail(8, 90)], matches)  # another prompt of 2 blocks
    with pytest.raises(InputError, match="does not cache prefixes"):
        prefill_cached(rt_off, neuronfx.init_state(rt_off), PrefillBatch(seq_ids=[0], prompts=[[1]], sampling=[GREEDY]))


def test_server_metrics_count_prefix_cache_tokens_and_evictions(hf) -> None:
    """The engine adds each step's growth of the state's counters to /metrics (vLLM-like names,
    and vLLM's own for queries and hits), and the hit rate since the start."""
    from neuronfx.server.engine import Engine
    from neuronfx.server.metrics import make_metrics

    rt = _bounded(hf, 3)
    metrics = make_metrics("tiny")
    engine = Engine(lambda: None, max_waiting=0, metrics=metrics)
    state = neuronfx.init_state(rt)
    for prompt in (BASE[:13], BASE[:13], tail(9, 30)):
        _, state = run(rt, state, [prompt], n=1)
        engine._gauges(state, Queue())
    text = metrics.render().decode()
    stats = prefix_stats(state)
    assert (stats.queries, stats.hits, stats.evictions) == (35, 12, 2)
    for name, value in (("queries", 35), ("hits", 12), ("evictions", 2)):
        assert f"neuronfx_prefix_cache_{name}_total {value:.1f}" in text
    for name, value in (("queries", 35), ("hits", 12)):
        assert f'vllm:prefix_cache_{name}_total{{model_name="tiny"}} {value:.1f}' in text
    assert f"neuronfx_prefix_cache_hit_rate {12 / 35!r}" in text


def test_cli_plan_options() -> None:
    import argparse

    from neuronfx.cli.options import add_plan_options, inference_from_args

    p = argparse.ArgumentParser()
    add_plan_options(p)
    args = p.parse_args(["--enable-prefix-caching", "--prefill-chunk-size", "32", "--prefix-block-size", "8",
                         "--max-prefix-blocks", "100"])
    inf = inference_from_args(args)
    assert (inf.enable_prefix_caching, inf.prefill_chunk_size, inf.prefix_block_size, inf.max_prefix_blocks) == (True, 32, 8, 100)
    assert not inference_from_args(p.parse_args([])).enable_prefix_caching
    alone = inference_from_args(p.parse_args(["--enable-prefix-caching"]))  # the chunk size is picked: 128 of 256 context tokens
    assert (alone.prefill_chunk_size, alone.prefix_block_size, alone.max_context_length) == (128, 16, 256)


@pytest.mark.parametrize(("context", "block", "chunk"), [(256, 16, 128), (4096, 16, 128), (64, 16, 64), (100, 16, 96),
                                                         (40, 32, 32), (128, 48, 96), (300, 7, 126)])
def test_prefix_caching_alone_picks_a_chunk_size(context, block, chunk) -> None:
    """enable_prefix_caching without prefill_chunk_size gets 128 tokens (fewer for shorter
    prompts), whole blocks; the config holds it, and equals the one that names it."""
    inf = InferenceConfig(enable_prefix_caching=True, max_context_length=context, sequence_length=4096, prefix_block_size=block)
    assert inf.prefill_chunk_size == chunk and chunk % block == 0 and block <= chunk <= min(context, 128)
    assert inf == InferenceConfig(enable_prefix_caching=True, max_context_length=context, sequence_length=4096,
                                  prefix_block_size=block, prefill_chunk_size=chunk)
    assert f"prefill_chunk_size={chunk}" in repr(inf)
    assert InferenceConfig(max_context_length=context, sequence_length=4096).prefill_chunk_size is None  # no caching: no chunks


def test_sliding_window_model_reuses_prefixes_exactly() -> None:
    """Gemma 3 (a 5-token sliding window on one layer, its own RoPE base): a slot continued after
    a copied prefix masks and rotates as one prefilled whole."""
    g = tiny_hf_model("gemma3_text")
    on, off = tiny_runtime(g, **PC), tiny_runtime(g, **(PC | {"enable_prefix_caching": False}))
    state = neuronfx.init_state(on)
    _, state = run(on, state, [BASE[:13]])
    prompts = [BASE[:12] + tail(9, 60), BASE[:7] + tail(2, 61)]
    tokens, state = run(on, state, prompts)
    assert prefix_stats(state).hits == 12 + 4
    assert tokens == [solo(off, p) for p in prompts]


def test_next_turn_reuses_the_answer(rt_on, rt_off) -> None:
    """A finished request's generated tokens are cached with its prompt: the next turn (prompt,
    answer, new message) reuses every full block its slot held, and its tokens are a solo run's."""
    prompt = BASE[:10]
    state = neuronfx.init_state(rt_on)
    (answer,), state = run(rt_on, state, [prompt], n=9)
    held = len(prompt) + len(answer) - 1  # the last token was sampled, never written
    turn = prompt + answer + tail(3, 80)
    before = prefix_stats(state).hits
    tokens, state = run(rt_on, state, [turn])
    assert prefix_stats(state).hits - before == held // 4 * 4 == 16
    assert tokens[0] == solo(rt_off, turn)


# --- the blocks KV layout: cached blocks are KV blocks, shared by reference ----------------------------

BLOCKS = dict(kv_layout="blocks", kv_block_size=4)


@pytest.fixture(scope="module")
def rt_blocks(hf):
    return tiny_runtime(hf, **PC, **BLOCKS)


def test_blocks_layout_hits_share_the_cached_blocks(rt_blocks, rt_off) -> None:
    """The shared-prefix sequence of the slots layout's test on the blocks layout: the same hits
    and solo tokens; a hit's slot holds the cached KV blocks themselves (one more reference
    each: the first request's slot, the cache, the hit), never a copy."""
    state, hits = neuronfx.init_state(rt_blocks), 0
    for prompt, hit in ((BASE[:13], 0), (BASE[:12] + tail(13, 1), 12), (BASE[:6] + tail(5, 3), 4), (BASE[:25] + tail(7, 5), 12)):
        tokens, state = run(rt_blocks, state, [prompt])
        hits += hit
        assert prefix_stats(state).hits == hits and tokens[0] == solo(rt_off, prompt)
    _, state = prefill_cached(rt_blocks, state, PrefillBatch(seq_ids=[0], prompts=[BASE[:14]], sampling=[GREEDY]))
    _, state = prefill_cached(rt_blocks, state, PrefillBatch(seq_ids=[1], prompts=[BASE[:12] + tail(3, 9)], sampling=[GREEDY]))
    first, second = state.blocks.tables[0, :3].tolist(), state.blocks.tables[1, :3].tolist()
    assert first == second and state.blocks.refs[first].tolist() == [3, 3, 3]
    assert state.prefix.pool == ()  # no pool of its own


def test_blocks_layout_evicts_cached_blocks_for_requests(hf, rt_off) -> None:
    """16 blocks of 4 (one request of 64 positions): cached prompts fill the KV blocks, later
    requests evict the least recently used ones no request holds, and every token stays exact."""
    rt = tiny_runtime(hf, num_kv_blocks=16, **PC, **BLOCKS)
    state = neuronfx.init_state(rt)
    for i, p in enumerate([BASE[:30], BASE[:13], tail(29, 31), tail(30, 32), tail(31, 33), BASE[:26]]):
        tokens, state = run(rt, state, [p], n=20)
        assert tokens[0] == solo(rt_off, p, 20), i
    stats = prefix_stats(state)
    assert stats.evictions > 0 and stats.hits >= 12  # BASE[:13] right after BASE[:30]
    assert int(state.blocks.refs.sum()) == state.prefix.store.num_cached  # only the cache holds blocks now
