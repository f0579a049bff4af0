"""neuronfx against transformers on the same random weights, per model file and backend.

Eager runtimes are built here (nothing to compile); the compiled ones are the session's shared
runtimes (conftest.py): llama (with speculate and draft graphs) and qwen3 (a sliding layer)
exported, qwen2 (Llama's math plus biases, a sliding layer) with the tiny ladders and llama4
(MoE, chunked and NoPE layers) with one bucket per phase (and speculate/draft graphs) under
inductor. On runtimes that can speculate, ``generate`` speculates:
its greedy tokens must still be transformers' own.
Expected buckets come from each runtime's own plan: the smallest that holds the length.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import (
    GREEDY,
    byte_tokenizer,
    hf_greedy,
    hf_last_logits,
    kv_tensors,
    random_prompt,
    run_steps,
    tiny_hf_model,
    tiny_plan,
    tiny_runtime,
)

import neuronfx
from neuronfx import PrefillBatch
from neuronfx.config.buckets import select_bucket
from neuronfx.errors import ArtifactError

ATOL = 1e-4
# Eager cases: name -> (model_type, config overrides). Windows shorter than the buckets: the
# sliding masks are exercised (prompts up to 32, decode to 64).
EAGER = {
    "llama": ("llama", {}), "mistral": ("mistral", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {}),
    "granite": ("granite", {}),
    "mistral-window": ("mistral", {"sliding_window": 5}),  # every layer slides
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),  # layer 1 slides
    "smollm3": ("smollm3", {}),  # layer 1 NoPE
    "smollm3-window": ("smollm3", {"use_sliding_window": True, "sliding_window": 6}),  # layer 1 NoPE and sliding
    "gemma3": ("gemma3_text", {}),  # layer 0 slides over 5 (local RoPE base), layer 1 global; helpers.GEMMA3
    "llama4": ("llama4_text", {}),  # layer 0 chunked RoPE, layer 1 NoPE; MoE
    "llama4-dense": ("llama4_text", {"interleave_moe_layer_step": 2, "intermediate_size_mlp": 96}),  # layer 0 dense MLP
    "mixtral": ("mixtral", {}), "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-window": ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 5}),  # every layer slides
}
SHARED = {"llama-export": "export_llama", "qwen3-export": "export_qwen3",
          "qwen2-inductor": "inductor_qwen2", "llama4-inductor": "inductor_speculative"}


@pytest.fixture(scope="module", params=[f"{m}-eager" for m in EAGER] + list(SHARED))
def case(request):
    if request.param in SHARED:
        return request.getfixturevalue(SHARED[request.param])
    name = request.param.removesuffix("-eager")
    model_type, overrides = EAGER[name]
    hf = tiny_hf_model(model_type, seed=list(EAGER).index(name), **overrides)
    return hf, tiny_runtime(hf, "eager")


@pytest.mark.parametrize("length", [1, 7, 8, 9, 15, 16, 17, 31, 32])
def test_prefill_logits_match_transformers(case, length):
    hf, rt = case
    prompt = random_prompt(length, seed=length)
    state = neuronfx.init_state(rt)
    out, _ = neuronfx.prefill_step(rt, state, PrefillBatch(seq_ids=[0], prompts=[prompt], sampling=[GREEDY]))
    assert out.bucket == select_bucket(rt.plan.prefill_buckets, length) == min(b for b in rt.plan.prefill_buckets if b >= length)
    ref = hf_last_logits(hf, prompt)
    assert out.logits.shape == (1, ref.shape[0])
    torch.testing.assert_close(out.logits[0], ref, atol=ATOL, rtol=0)
    assert out.tokens[0] == int(ref.argmax())


@pytest.mark.parametrize("length", [14, 30])  # 14: decode buckets 16 -> 32; 30: 32 -> 64
def test_decode_logits_match_transformers_on_full_prefix(case, length):
    hf, rt = case
    prompt = random_prompt(length, seed=100 + length)
    tokens, logits, buckets, _ = run_steps(rt, neuronfx.init_state(rt), [0], [prompt], 16)
    if len(rt.plan.decode_buckets) > 1:
        assert len(set(buckets[1:])) == 2  # the decode steps cross a bucket boundary
    for step, (tok, lg) in enumerate(zip(tokens[0], logits[0])):
        prefix = prompt + tokens[0][:step]
        ref = hf_last_logits(hf, prefix)
        torch.testing.assert_close(lg, ref, atol=ATOL, rtol=0, msg=lambda m, s=step: f"step {s}: {m}")
        assert tok == int(ref.argmax()), f"step {step}"


@pytest.mark.parametrize("length", [5, 16, 23])
def test_greedy_generate_matches_transformers(case, length):
    hf, rt = case
    prompt = random_prompt(length, seed=200 + length)
    result, state = neuronfx.generate(rt, neuronfx.init_state(rt), prompt, max_new_tokens=16, eos_token_ids=[])
    assert list(result.token_ids[0]) == hf_greedy(hf, prompt, 16)
    assert result.finish_reasons == ("length",)
    assert state.free_slots == (0, 1, 2, 3)


def test_nan_filled_cache_generates_like_transformers(case):
    """Unwritten cache positions may hold anything; the graphs must never let them through."""
    hf, rt = case
    prompt = random_prompt(6, seed=300)
    state = neuronfx.init_state(rt)
    for t in kv_tensors(state):
        t.fill_(float("nan"))
    result, _ = neuronfx.generate(rt, state, prompt, max_new_tokens=16, eos_token_ids=[])
    assert list(result.token_ids[0]) == hf_greedy(hf, prompt, 16)


def test_batched_generate_matches_transformers_per_prompt(case):
    """Four prompts of different lengths in one batch (padding in prefill, mixed decode buckets)."""
    hf, rt = case
    prompts = [random_prompt(n, seed=400 + n) for n in (3, 9, 16, 30)]
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=12, eos_token_ids=[])
    for prompt, tokens in zip(prompts, result.token_ids, strict=True):
        assert list(tokens) == hf_greedy(hf, prompt, 12), f"prompt length {len(prompt)}"


@pytest.mark.parametrize("shared", ["export_llama", "inductor_speculative"])
def test_compiled_speculate_and_draft_graphs(request, shared):
    hf, rt = request.getfixturevalue(shared)
    assert rt.can_speculate
    prompts = [random_prompt(n, seed=50 + n) for n in (6, 11, 2)]
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=15, eos_token_ids=[])
    for p, tokens in zip(prompts, result.token_ids, strict=True):
        assert list(tokens) == hf_greedy(hf, p, 15)
    assert all(s.drafted == 3 * s.target_passes and s.emitted == 14 for s in result.speculation)


@pytest.mark.parametrize("name, plain", [
    ("mistral-window", {"sliding_window": None}),
    ("qwen2-window", {"use_sliding_window": False}),
    ("smollm3", {"no_rope_layer_interval": 99}),
    ("smollm3-window", {"use_sliding_window": False, "no_rope_layer_interval": 99}),
    ("llama4", {"attention_chunk_size": None, "attn_temperature_tuning": False, "use_qk_norm": False}),
    ("llama4", {"no_rope_layer_interval": 99}),
    ("qwen3_moe-window", {"use_sliding_window": False}),
])
def test_windowed_and_nope_cases_are_not_plain_attention(name, plain):
    """The cases above exercise their layer types: with every layer full and with RoPE, the same
    weights give other logits for a prompt past the window (so matching transformers needs them)."""
    model_type, overrides = EAGER[name]
    seed = list(EAGER).index(name)
    prompt = random_prompt(20, seed=7)
    ours = hf_last_logits(tiny_hf_model(model_type, seed=seed, **overrides), prompt)
    other = hf_last_logits(tiny_hf_model(model_type, seed=seed, **(overrides | plain)), prompt)
    assert (ours - other).abs().max() > 1e-3


def test_llama4_experts_move_the_logits():
    """The tiny llama4's routed experts matter: zeroing them changes transformers' logits."""
    hf = tiny_hf_model("llama4_text", seed=list(EAGER).index("llama4"))
    prompt = random_prompt(12, seed=3)
    ours = hf_last_logits(hf, prompt)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.feed_forward.experts.down_proj.zero_()
    assert (ours - hf_last_logits(hf, prompt)).abs().max() > 1e-3


def test_inductor_structured_greedy_row_equals_eager(inductor_qwen2):
    """A regex-constrained greedy row (batch 1) on the shared inductor runtime: the compiled
    graphs unpack the token bitmask as the eager ones do (tests/test_structured.py has the rest)."""
    hf, compiled = inductor_qwen2
    eager = tiny_runtime(hf, batch_size=4)
    sp = neuronfx.SamplingParams(structured=neuronfx.StructuredOutputs(regex=r"[a-c]{2}-[0-9]{3}"))
    tok = byte_tokenizer()
    runs = [neuronfx.generate(rt, neuronfx.init_state(rt), [[5, 6, 7]], max_new_tokens=8, sampling=sp, tokenizer=tok)[0]
            for rt in (eager, compiled)]
    assert runs[0].token_ids == runs[1].token_ids and runs[1].finish_reasons == ("stop",)
    assert len(runs[1].texts[0]) == 6 and runs[1].texts[0][2] == "-"


def test_another_plan_of_the_model_loads_its_compiled_parts(inductor_qwen2):
    """A second plan of the session's tiny qwen2 (a sub-ladder of its buckets: new graphs, not a
    cache entry) finds every part in the compile cache's kernel store: AOTAutograd cache hits,
    no lowering (``inductor_parts.autograd_cache_keyed_by_source``); the same tokens and
    logits as the first plan."""
    from torch._dynamo.utils import counters

    from neuronfx.io import cache

    hf, first = inductor_qwen2
    plan = tiny_plan(hf, "inductor", prefill_buckets=(16, 32), decode_buckets=(32, 64))
    with contextlib.suppress(ArtifactError):  # a kept test cache (NEURONFX_TEST_CACHE_DIR) holds its entry
        cache.clear(cache.cache_key(plan))
    before = dict(counters["aot_autograd"])
    rt = neuronfx.compile(plan, hf.state_dict(), progress=False)
    assert not rt.from_cache
    after = counters["aot_autograd"]
    # 9 parts: a prologue per bucket (2 + 2), prefill's and decode's layer group and epilogue, the
    # greedy graphs' epilogue (their prologues and layers are the decode graphs')
    assert (after["autograd_cache_hit"] - before.get("autograd_cache_hit", 0),
            after["autograd_cache_miss"] - before.get("autograd_cache_miss", 0)) == (9, 0)
    prompts = [random_prompt(12, seed=5), random_prompt(20, seed=6)]
    got, got_logits, _, _ = run_steps(rt, neuronfx.init_state(rt), [0, 1], prompts, 8)
    want, want_logits, _, _ = run_steps(first, neuronfx.init_state(first), [0, 1], prompts, 8)
    assert got == want
    for row, want_row in zip(got_logits, want_logits, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(row, want_row, strict=True))
