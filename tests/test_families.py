"""Families beyond the first four, end to end from a directory transformers saved: smollm3 (NoPE
layers), llama4 text (MoE, chunked and NoPE layers) and granite (its scalars, with every bias). Each loads through ``load_checkpoint``
with its config and weights intact, generates through the CLI exactly transformers' greedy
tokens, and runs in bf16 within the bound the bf16 tests use. Logits and greedy tokens per
backend are in test_models.py (``EAGER`` and the shared compiled runtimes).

Inductor for the families whose compiled coverage is not elsewhere is in their own files (phi3,
gemma3, qwen3_moe) or in the session fixtures (qwen2; llama4 with dense and MoE layers
alternating: conftest.py; llama: SmolLM2). Compared on eager only, for the test-time budget:
mixtral (its sparse MoE block is qwen3_moe's), granite (four scalar multiplications on llama's
layer) and smollm3 (NoPE by a per-layer index, as llama4's; sliding windows, as gemma3's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import bf16_logit_errors, hf_greedy, hf_last_logits, random_prompt, run_steps, tiny_hf_model, tiny_runtime
from test_cli import run_json
from test_lowp import BF16_LOGIT_BOUND

import neuronfx
from neuronfx.config.model import ModelConfig
from neuronfx.io.checkpoints import load_checkpoint

FAMILIES = {"smollm3": {"use_sliding_window": True, "sliding_window": 6}, "llama4_text": {},
            "granite": {"attention_bias": True, "mlp_bias": True}}


def save_with_tokenizer(model: torch.nn.Module, path: Path) -> Path:
    """``model`` saved by transformers with a word-level tokenizer: token i is the word "w{i}"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(model.config.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_directory_loads_and_the_cli_matches_transformers(family, tmp_path, capsys):
    hf = tiny_hf_model(family, seed=21, **FAMILIES[family])
    directory = save_with_tokenizer(hf, tmp_path / family)
    ckpt = load_checkpoint(directory)
    assert ckpt.config == ModelConfig.from_hf(hf.config)
    reference = hf.state_dict()
    if hf.config.tie_word_embeddings:  # saved once, as the embedding
        reference.pop("lm_head.weight")
    assert set(ckpt.state_dict) == set(reference)
    assert all(torch.equal(ckpt.state_dict[k], reference[k]) for k in reference)

    prompt = random_prompt(13, seed=9)
    out = run_json(capsys, "--model", str(directory), "--prompt", " ".join(f"w{t}" for t in prompt), "--backend", "eager",
                   "--max-new-tokens", "24", "--ignore-eos", "--max-context-length", "32", "--sequence-length", "64")
    assert out["token_ids"] == hf_greedy(hf, prompt, 24)  # one prompt: its tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_track_the_fp32_reference(family):
    errors = bf16_logit_errors(tiny_hf_model(family, seed=22, **FAMILIES[family]))
    assert max(errors) < BF16_LOGIT_BOUND, errors


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen2"])
def test_attention_biases_match_transformers(model_type):
    """attention_bias: llama and qwen3 bias q/k/v and o_proj, qwen2 q/k/v only (transformers
    initialises biases to zero: here they are random, so each one moves the logits)."""
    hf = tiny_hf_model(model_type, seed=23, attention_bias=True)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    assert any(n.endswith("o_proj.bias") for n, _ in hf.named_parameters()) == (model_type != "qwen2")
    rt = tiny_runtime(hf, "eager")
    for length in (7, 17):
        prompt = random_prompt(length, seed=length)
        tokens, logits, _, _ = run_steps(rt, neuronfx.init_state(rt), [0], [prompt], 4)
        for i in range(4):
            ref = hf_last_logits(hf, prompt + tokens[0][:i])
            torch.testing.assert_close(logits[0][i], ref, atol=1e-4, rtol=0)
