"""Weight-only quantized plans (int8, int4) against transformers on the dequantized weights.

The reference is transformers in fp32 with every quantized weight replaced by the values
neuronfx multiplies by (``graphs.weights.dequantized_state_dict``): the same products, so the
only difference left is the order of fp32 accumulation (the kernels sum per group, then scale).
Logits of the tiny models are O(1) over K <= 128 products, so that order moves them by
~1e-6; the tolerance below, 1e-4, is the one every fp32 comparison with transformers uses.
"""

from __future__ import annotations

import pytest
import torch
from helpers import random_prompt, run_steps, tiny_hf_model, tiny_runtime

import neuronfx
from neuronfx.config.inference import InferenceConfig
from neuronfx.config.quantization import quantized_formats
from neuronfx.graphs.models import quant
from neuronfx.io.weights import dequantized_state_dict

PROMPTS = [random_prompt(11, seed=3), random_prompt(5, seed=4)]
ATOL = 1e-4
STEPS = 6


@pytest.fixture(scope="module")
def hf():
    """Tied embeddings: the embedding lookup then reads the quantized head's rows."""
    return tiny_hf_model("llama", seed=7, tie_word_embeddings=True)


def reference(hf, runtime):
    """transformers on the weights ``runtime`` multiplies by."""
    ref = tiny_hf_model("llama", seed=7, tie_word_embeddings=True)
    ref.load_state_dict(dequantized_state_dict(hf.state_dict(), runtime.weights, runtime.plan.model), strict=False)
    return ref


@torch.no_grad()
def reference_steps(ref, prompt, n):
    """Greedy tokens and the logits before each, from transformers' full forward passes."""
    ids, tokens, logits = list(prompt), [], []
    for _ in range(n):
        step = ref(torch.tensor([ids])).logits[0, -1].float()
        logits.append(step)
        tokens.append(int(step.argmax()))
        ids.append(tokens[-1])
    return tokens, logits


def check_against_reference(hf, rt):
    ref = reference(hf, rt)
    tokens, logits, _, _ = run_steps(rt, neuronfx.init_state(rt), [0, 1], PROMPTS, STEPS)
    for row, prompt in enumerate(PROMPTS):
        want_tokens, want_logits = reference_steps(ref, prompt, STEPS)
        assert tokens[row] == want_tokens
        for got, want in zip(logits[row], want_logits):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("weight_format", "group"), [("int8", 32), ("int4", 32), ("int4", 64)])
def test_eager_quantized_matches_transformers_on_dequantized_weights(hf, weight_format, group):
    rt = tiny_runtime(hf, "eager", weight_format=weight_format, weight_group_size=group)
    layer = rt.weights["layers"][0]
    assert isinstance(layer["wq"], quant.Int8Weight if weight_format == "int8" else quant.Int4Weight)
    assert isinstance(rt.weights["lm_head"], quant.Int8Weight)  # the head gets 8 bits in both
    assert rt.weights["embed"] is rt.weights["lm_head"]
    assert layer["attn_norm"].dtype == torch.float32  # norms stay float
    check_against_reference(hf, rt)


def test_quantization_changes_the_weights(hf):
    """The reference really is the quantized model: int4 moves logits away from the float model."""
    rt = tiny_runtime(hf, "eager", weight_format="int4", batch_size=1, prefill_buckets=(32,), decode_buckets=(64,))
    _, logits, _, _ = run_steps(rt, neuronfx.init_state(rt), [0], PROMPTS[:1], 1)
    _, float_logits = reference_steps(hf, PROMPTS[0], 1)
    assert (logits[0][0] - float_logits[0]).abs().max() > 10 * ATOL


def test_inductor_int4_kernels_match_reference(hf):
    """Decode through ``quant_gemm`` and prefill through ``quant_prefill`` (tiles dequantized,
    then fp32 GEMM; inductor) give the reference's tokens and logits."""
    rt = tiny_runtime(hf, "inductor", weight_format="int4", batch_size=2, max_context_length=16, prefill_buckets=(16,),
                      decode_buckets=(64,))
    check_against_reference(hf, rt)


def test_save_and_load_keep_the_quantized_records(hf, tmp_path):
    rt = tiny_runtime(hf, "eager", weight_format="int4", batch_size=2, prefill_buckets=(32,), decode_buckets=(64,))
    neuronfx.save(rt, tmp_path / "rt")
    loaded = neuronfx.load(tmp_path / "rt")
    assert isinstance(loaded.weights["layers"][1]["down"], quant.Int4Weight)
    assert loaded.weights["embed"] is loaded.weights["lm_head"]
    for a, b in zip(loaded.weights["layers"][1]["down"], rt.weights["layers"][1]["down"]):
        assert torch.equal(a, b)
    assert run_steps(loaded, neuronfx.init_state(loaded), [0, 1], PROMPTS, 3)[0] == run_steps(rt, neuronfx.init_state(rt), [0, 1], PROMPTS, 3)[0]


def test_bf16_activations_int8_weights(hf):
    """A bf16 plan keeps activations and KV cache in bf16 over int8 weights: tokens and logits
    near the fp32 reference (bf16 rounding of activations: 2^-8 relative per op)."""
    rt = tiny_runtime(hf, "eager", weight_format="int8", dtype="bfloat16", batch_size=1, prefill_buckets=(32,), decode_buckets=(64,))
    assert rt.weights["layers"][0]["attn_norm"].dtype == torch.bfloat16
    _, logits, _, state = run_steps(rt, neuronfx.init_state(rt), [0], PROMPTS[:1], 3)
    assert state.kv[0].k.dtype == torch.bfloat16
    _, want = reference_steps(reference(hf, rt), PROMPTS[0], 3)
    for got, ref in zip(logits[0], want):
        torch.testing.assert_close(got, ref, atol=0.1, rtol=0)


def test_quantized_formats_is_a_pure_function_of_the_plan():
    layers = {"wq", "wk", "wv", "wo", "gate", "up", "down", "dense_gate", "dense_up", "dense_down"}
    assert quantized_formats(InferenceConfig()) == {}
    assert quantized_formats(InferenceConfig(weight_format="int4")) == dict.fromkeys(layers, "int4") | {"lm_head": "int8"}
    assert quantized_formats(InferenceConfig(weight_format="int8", quantize_lm_head=False)) == dict.fromkeys(layers, "int8")
    assert quantized_formats(InferenceConfig(weight_format="gguf"))["lm_head"] == "gguf"
