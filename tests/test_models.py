"""neuronfx against transformers on the same random weights, per model file and backend.

Eager runtimes are built here (nothing to compile); the compiled ones are the session's shared
runtimes (conftest.py): llama (with speculate and draft graphs) and qwen3 exported, qwen2
(Llama's math plus biases) with the tiny ladders and llama with one bucket per phase (and
speculate/draft graphs) under inductor. On runtimes that can speculate, ``generate`` speculates:
its greedy tokens must still be transformers' own.
Expected buckets come from each runtime's own plan: the smallest that holds the length.
"""

from __future__ import annotations

import pytest
import torch
from helpers import GREEDY, hf_greedy, hf_last_logits, kv_tensors, random_prompt, run_steps, tiny_hf_model, tiny_runtime

import neuronfx
from neuronfx import PrefillBatch
from neuronfx.config.buckets import select_bucket

ATOL = 1e-4
EAGER = ["llama", "mistral", "qwen2", "qwen3", "granite", "mixtral", "qwen3_moe"]
SHARED = {"llama-export": "export_llama", "qwen3-export": "export_qwen3",
          "qwen2-inductor": "inductor_qwen2", "llama-inductor": "inductor_llama_speculative"}


@pytest.fixture(scope="module", params=[f"{m}-eager" for m in EAGER] + list(SHARED))
def case(request):
    if request.param in SHARED:
        return request.getfixturevalue(SHARED[request.param])
    model_type = request.param.removesuffix("-eager")
    hf = tiny_hf_model(model_type, seed=EAGER.index(model_type))
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


@pytest.mark.parametrize("shared", ["export_llama", "inductor_llama_speculative"])
def test_compiled_speculate_and_draft_graphs(request, shared):
    hf, rt = request.getfixturevalue(shared)
    assert rt.can_speculate
    prompts = [random_prompt(n, seed=50 + n) for n in (6, 11, 2)]
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=15, eos_token_ids=[])
    for p, tokens in zip(prompts, result.token_ids, strict=True):
        assert list(tokens) == hf_greedy(hf, p, 15)
    assert all(s.drafted == 3 * s.target_passes and s.emitted == 14 for s in result.speculation)
