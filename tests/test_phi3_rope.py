"""Phi-3 and the RoPE scaling types against transformers on the same random weights.

The tiny Phi-3 (helpers ``_HF_CLASSES["phi3"]``: 2 layers, GQA, vocabulary 250, RoPE on 12 of 16
head dims, longrope switching at 20 tokens, inside the tiny ladders) runs on eager and on one
inductor runtime shared by this module's tests: prefill logits around a bucket and past the
switch, decode logits across the switch (the scheduler recomputes the slot there, as
transformers' Phi-3 ``generate`` drops its cache), greedy tokens and a ragged batch; bf16 on
eager; a saved checkpoint through ``load_checkpoint`` (lazy tensor-parallel reads of the fused
tensors included) and the CLI. Llama runs yarn, dynamic NTK and longrope, and ``mlp_bias``.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import GREEDY, hf_greedy, hf_last_logits, random_prompt, run_steps, tiny_hf_model, tiny_runtime

import neuronfx
from neuronfx import DecodeBatch, ModelConfig, PrefillBatch
from neuronfx.config.sharding import rank_shard
from neuronfx.graphs.models.layers import row_inv_freq
from neuronfx.io.weights import convert_hf_state_dict
from neuronfx.runtime.steps import refill_step

ATOL = 1e-4
SWITCH = 20  # original_max_position_embeddings of the tiny Phi-3
VOCAB = 250


def prompt(length: int, seed: int) -> list[int]:
    return [t % VOCAB for t in random_prompt(length, seed)]


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("phi3", seed=21)


@pytest.fixture(scope="module")
def eager(hf):
    return tiny_runtime(hf, "eager")


@pytest.fixture(scope="module")
def inductor(hf):
    """The module's one compiled runtime: prefill buckets 16 and 32, decode 64 (3 graphs)."""
    return tiny_runtime(hf, "inductor", prefill_buckets=(16, 32), decode_buckets=(64,))


@pytest.fixture(scope="module")
def greedy_refs(hf):
    """transformers' 24 greedy tokens per prompt length (15, 16, 17 cross the switch in decode)."""
    return {n: hf_greedy(hf, prompt(n, n), 24) for n in (5, 15, 16, 17, 24)}


@pytest.fixture(params=["eager", "inductor"])
def rt(request):
    return request.getfixturevalue(request.param)


def test_config_and_switch_are_exercised(hf):
    m = ModelConfig.from_hf(hf.config)
    assert (m.model_type, m.vocab_size, m.head_dim, m.rotary_dim) == ("phi3", VOCAB, 16, 12)
    assert m.rope_scaling.rope_type == "longrope" and m.rope_scaling.original_max_position_embeddings == SWITCH
    inv = row_inv_freq(m, torch.tensor([SWITCH, SWITCH + 1]))  # (2, 6): short table, then long
    assert inv.shape == (2, 6) and not torch.allclose(inv[0], inv[1])


@pytest.mark.parametrize("length", [15, 16, 17, 24])  # bucket 16 -1, 0, +1; 24 > the switch: long factors
def test_prefill_logits_match_transformers(hf, rt, length):
    ids = prompt(length, length)
    out, _ = neuronfx.prefill_step(rt, neuronfx.init_state(rt), PrefillBatch(seq_ids=[0], prompts=[ids], sampling=[GREEDY]))
    torch.testing.assert_close(out.logits[0], hf_last_logits(hf, ids), atol=ATOL, rtol=0)


def test_decode_logits_across_the_switch(hf, eager):
    """Each step's logits are transformers' on the whole prefix (long factors everywhere past the
    switch): the step at the switch is a refill; a plain decode there keeps short-factor keys
    and is measurably off (the refill is what makes the match)."""
    ids = prompt(17, 3)
    tokens, logits, _, _ = run_steps(eager, neuronfx.init_state(eager), [0], [ids], SWITCH - 17 + 2)
    plain_error = (logits[0][-1] - hf_last_logits(hf, ids + tokens[0][:-1])).abs().max().item()
    assert plain_error > 1e-3  # the decode step at position 20 without refill

    state = neuronfx.init_state(eager)
    out, state = neuronfx.prefill_step(eager, state, PrefillBatch(seq_ids=[0], prompts=[ids], sampling=[GREEDY]))
    seq = ids + [out.tokens[0]]
    for _ in range(6):
        if state.cache_lens[0] == SWITCH:
            out, state = refill_step(eager, state, PrefillBatch(seq_ids=[0], prompts=[seq], sampling=[GREEDY]))
        else:
            out, state = neuronfx.decode_step(eager, state, DecodeBatch(seq_ids=[0], input_ids=[seq[-1]], sampling=[GREEDY]))
        torch.testing.assert_close(out.logits[0], hf_last_logits(hf, seq), atol=ATOL, rtol=0)
        seq.append(out.tokens[0])


@pytest.mark.parametrize("length", [15, 16, 17, 24])
def test_greedy_generate_matches_transformers(rt, greedy_refs, length):
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompt(length, length), max_new_tokens=24, eos_token_ids=[])
    assert list(result.token_ids[0]) == greedy_refs[length]


def test_ragged_batch_equals_each_prompt_alone(rt, greedy_refs):
    lengths = (24, 5, 17)  # past the switch at prefill, crossing late, crossing early
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [prompt(n, n) for n in lengths], max_new_tokens=24,
                                  eos_token_ids=[])
    assert [list(t) for t in result.token_ids] == [greedy_refs[n] for n in lengths]


def test_async_decode_refills_at_the_switch(eager, greedy_refs):
    """Overlapped decode runs the refill at the switch synchronously: the same tokens."""
    lengths = (24, 5, 17)
    result, _ = neuronfx.generate(eager, neuronfx.init_state(eager), [prompt(n, n) for n in lengths], max_new_tokens=24,
                                  eos_token_ids=[], async_decode=True)
    assert [list(t) for t in result.token_ids] == [greedy_refs[n] for n in lengths]


def test_bf16_decode_logits_track_fp32_reference():
    """test_lowp's bound (0.06) on weights rounded to bf16, past the switch (long factors)."""
    hf = tiny_hf_model("phi3", seed=22)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    rt = tiny_runtime(hf, "eager", batch_size=1, dtype="bfloat16")
    ids = prompt(22, 9)
    tokens, logits, _, _ = run_steps(rt, neuronfx.init_state(rt), [0], [ids], 8)
    for i in range(8):
        err = (logits[0][i] - hf_last_logits(hf, ids + tokens[0][:i])).abs().max().item()
        assert err < 0.06, f"step {i}: max |logit error| {err:.4f}"


@pytest.fixture(scope="module")
def phi3_dir(hf, tmp_path_factory):
    """``hf`` saved by transformers, with a word-level tokenizer (token i is "w{i}")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("phi3")
    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    return path


def test_checkpoint_dir_loads_and_generates(hf, phi3_dir, greedy_refs, capsys):
    from neuronfx.cli import main
    from neuronfx.io.checkpoints import load_checkpoint

    ckpt = load_checkpoint(phi3_dir)
    assert (ckpt.config.model_type, ckpt.config.rotary_dim, ckpt.config.rope_scaling) == ("phi3", 12, ModelConfig.from_hf(hf.config).rope_scaling)
    ids = prompt(17, 17)
    text = " ".join(f"w{t}" for t in ids)
    args = ["generate", "--model", str(phi3_dir), "--prompt", text, "--max-new-tokens", "24", "--backend", "eager",
            "--batch-size", "1", "--max-context-length", "32", "--sequence-length", "64", "--ignore-eos", "--json"]
    assert main(args) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["token_ids"] == greedy_refs[17]


def test_lazy_tensor_parallel_reads_split_the_fused_tensors(hf, phi3_dir):
    """Each rank's weights read lazily from the saved files (only its rows of qkv_proj and
    gate_up_proj) equal its shard of the in-memory weights, and the parts of each fused tensor
    are transformers' q/k/v and gate/up rows."""
    from neuronfx.io.checkpoints import load_checkpoint

    cfg = ModelConfig.from_hf(hf.config)
    lazy = load_checkpoint(phi3_dir, lazy=True).state_dict
    eager = hf.state_dict()
    whole = convert_hf_state_dict(eager, cfg, "float32")
    q = cfg.num_attention_heads * cfg.head_dim
    layer = eager["model.layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(whole["layers"][1]["wq"], layer[:q]) and torch.equal(whole["layers"][1]["wv"], layer[q + q // 2:])
    assert torch.equal(whole["layers"][0]["up"], eager["model.layers.0.mlp.gate_up_proj.weight"][cfg.intermediate_size:])
    for rank in range(2):
        shard = rank_shard(cfg, 2, rank)
        got, want = convert_hf_state_dict(lazy, cfg, "float32", shard), convert_hf_state_dict(eager, cfg, "float32", shard)
        for i in range(cfg.num_hidden_layers):
            for name in want["layers"][i]:
                assert torch.equal(got["layers"][i][name], want["layers"][i][name]), (rank, i, name)
        assert got["layers"][0]["wk"].shape == (cfg.head_dim, cfg.hidden_size)  # one of 2 KV heads per rank


# --- rope types and mlp_bias on llama (eager) -------------------------------------------------------

ROPE_CASES = {
    "yarn": dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "yarn-mscale": dict(rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                                         "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                                         "truncate": False}),
    # dynamic NTK rescales past max_position_embeddings = 20, per row
    "dynamic": dict(max_position_embeddings=20, rope_parameters={"rope_type": "dynamic", "factor": 3.0}),
    # llama keeps its short-factor keys past the switch (transformers' llama generate does)
    "longrope": dict(rope_parameters={"rope_type": "longrope", "original_max_position_embeddings": 20,
                                      "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 3.0, 4.0, 5.0],
                                      "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 48.0, 64.0]}),
}


@pytest.fixture(scope="module", params=list(ROPE_CASES))
def rope_case(request):
    overrides = ROPE_CASES[request.param]
    hf = tiny_hf_model("llama", seed=31, rope_theta=10000.0, **overrides)
    return request.param, hf, tiny_runtime(hf, "eager")


def _reset_rotary(hf) -> None:
    """transformers' dynamic RoPE keeps the longest length it saw across calls: a 1-token call
    resets it, so each reference call starts as a fresh model's would."""
    with torch.no_grad():
        hf(torch.tensor([[1]]))


def test_rope_scaling_types_match_transformers(rope_case):
    name, hf, rt = rope_case
    m = rt.plan.model
    assert m.rope_scaling.rope_type == name.split("-")[0]
    for length in (7, 19, 20, 21, 30):
        ids = random_prompt(length, length)
        out, _ = neuronfx.prefill_step(rt, neuronfx.init_state(rt), PrefillBatch(seq_ids=[0], prompts=[ids], sampling=[GREEDY]))
        _reset_rotary(hf)
        torch.testing.assert_close(out.logits[0], hf_last_logits(hf, ids), atol=ATOL, rtol=0, msg=f"{name} {length}")
    for length in (14, 25):
        ids = random_prompt(length, 50 + length)
        result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), ids, max_new_tokens=12, eos_token_ids=[])
        _reset_rotary(hf)
        assert list(result.token_ids[0]) == hf_greedy(hf, ids, 12), f"{name} {length}"


def test_llama_mlp_bias_matches_transformers():
    hf = tiny_hf_model("llama", seed=32, mlp_bias=True)
    with torch.no_grad():  # transformers initialises biases to 0: make them matter
        for name, p in hf.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_(0, 0.5)
    rt = tiny_runtime(hf, "eager")
    assert rt.plan.model.mlp_bias
    ids = random_prompt(11, 4)
    tokens, logits, _, _ = run_steps(rt, neuronfx.init_state(rt), [0], [ids], 4)
    for i in range(4):
        torch.testing.assert_close(logits[0][i], hf_last_logits(hf, ids + tokens[0][:i]), atol=ATOL, rtol=0)
