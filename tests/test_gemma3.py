"""Gemma 3 text (``Gemma3ForCausalLM``) against transformers on a tiny random model
(``helpers.GEMMA3``: a sliding layer over 5 tokens with its own RoPE base, then a global layer;
vocabulary 257; query_pre_attn_scalar != head_dim; soft-capped logits; random norm weights).

The standard eager checks (prefill lengths 1-32, decode logits, greedy, NaN-filled cache, a
ragged batch) run in test_models.py (EAGER "gemma3"); tensor parallel in test_tensor_parallel.py.
Here: the inductor backend (one runtime for the module, on the blocks KV layout, whose window
ring keeps the sliding layer's last 8 positions: ``tests/test_kv_ring.py``), a bf16 run, self-speculation, the
configuration (what is read, what is refused), that every Gemma feature changes the tiny
model's logits (so matching transformers needs it), and a saved directory through
``load_checkpoint`` and the CLI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    GEMMA3,
    GREEDY,
    TINY,
    bf16_logit_errors,
    hf_greedy,
    hf_last_logits,
    random_prompt,
    run_steps,
    tiny_hf_model,
    tiny_runtime,
)
from transformers import Gemma3Config, Gemma3TextConfig

import neuronfx
from neuronfx import InferenceConfig, ModelConfig, PrefillBatch, make_plan
from neuronfx.cli import main
from neuronfx.config.attention import ROPE_GLOBAL, ROPE_LOCAL, attention_layout
from neuronfx.config.extras import Gemma3Extras
from neuronfx.config.model import RopeScaling
from neuronfx.errors import UnsupportedModelError
from neuronfx.graphs.backends import inductor_parts
from neuronfx.graphs.kernels.bundles import REFERENCE_OPS
from neuronfx.graphs.models import family_math
from neuronfx.graphs.phases.common import embed_tokens
from neuronfx.io.checkpoints import load_checkpoint

ATOL = 1e-4
WINDOW = GEMMA3["sliding_window"]


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("gemma3_text", seed=21)


@pytest.fixture(scope="module")
def inductor_rt(hf):
    """Inductor, prefill buckets (8, 32) and one decode bucket (64), self-speculation at k = 4
    (``generate`` speculates): 5 graphs. The blocks layout: its window ring (3 blocks of 4
    positions: the window and a verify pass's 4 tokens, and a block of margin) is what these
    prompts and outputs outgrow (the slots layout's kernel and masks are the same code; other
    families test it on inductor). One layer per compiled group: the sliding layer's ring cache
    and the full layer's blocks, of two block counts, go through one compiled part (as
    gemma-3-1b's groups of 2 do)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(inductor_parts, "MAX_LAYER_GROUP", 1)
        patch.setattr(inductor_parts, "PREFILL_LAYER_GROUP", 1)
        rt = tiny_runtime(hf, "inductor", prefill_buckets=(8, 32), decode_buckets=(64,), speculation_length=4, draft_layers=1,
                          kv_layout="blocks", kv_block_size=4)
    assert {graph.parts.group_size for graph in rt.graphs.values()} == {1}
    assert rt.plan.kv.ring_blocks == 3 and rt.plan.kv.ring_layers == (True, False)
    return rt


@pytest.fixture(scope="module")
def eager_rt(hf):
    return tiny_runtime(hf, "eager", prefill_buckets=(8, 32), decode_buckets=(64,))


@pytest.fixture(params=["eager", "inductor"])
def rt(request):
    return request.getfixturevalue(f"{request.param}_rt")


# --- the config ---------------------------------------------------------------------------------


def test_config_reads_every_gemma3_option(hf):
    cfg = ModelConfig.from_hf(hf.config)
    assert cfg.model_type == "gemma3_text" and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.sliding_window == WINDOW
    assert (cfg.rope_theta, cfg.sliding_rope_theta, cfg.rope_scaling) == (10000.0, 100.0, None)
    assert cfg.extras == Gemma3Extras(query_pre_attn_scalar=24.0, final_logit_softcapping=0.5)
    assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.head_dim == 32
    layout = attention_layout(cfg)
    assert (layout.ropes, layout.rope_index, layout.masks, layout.mask_index) == (
        (ROPE_LOCAL, ROPE_GLOBAL), (0, 1), ("sliding", "full"), (0, 1))


def test_config_linear_scaling_on_global_layers_only():
    """Gemma 3 4B-27B: linear RoPE scaling (factor 8) on the global layers; local ones unscaled."""
    hf_cfg = Gemma3TextConfig(**TINY, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    cfg = ModelConfig.from_hf(hf_cfg)
    assert cfg.rope_scaling == RopeScaling(rope_type="linear", factor=8.0)
    assert (cfg.rope_theta, cfg.sliding_rope_theta) == (1e6, 1e4)


@pytest.mark.parametrize("overrides, needles", [
    ({"attn_logit_softcapping": 50.0}, ("attn_logit_softcapping=50.0", "not supported", "unset")),
    ({"use_bidirectional_attention": True}, ("use_bidirectional_attention=True", "not supported")),
    ({"attention_bias": True}, ("attention_bias=True",)),
    ({"hidden_activation": "silu"}, ("hidden_act='silu'", "only 'gelu_pytorch_tanh'")),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     ("sliding_attention", "rope_type='linear'", "only the 'default'")),
])
def test_config_refuses_unsupported_options(overrides, needles):
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_hf(Gemma3TextConfig(**TINY, **overrides))
    for needle in needles:
        assert needle in str(info.value)


def test_multimodal_config_names_the_text_model(tmp_path):
    config = Gemma3Config(text_config=Gemma3TextConfig(**TINY).to_dict())
    with pytest.raises(UnsupportedModelError, match="model_type='gemma3'.*Gemma3ForCausalLM.*text_config"):
        ModelConfig.from_hf(config)
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="config.json.*Gemma3ForCausalLM"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("plain", [
    {"final_logit_softcapping": None}, {"query_pre_attn_scalar": 32}, {"rope_local_base_freq": 10000.0},
    {"sliding_window": 64}, {"hidden_activation": "silu"},
])
def test_each_gemma3_feature_changes_the_logits(hf, plain):
    """The tiny model exercises each feature: without it the same weights give other logits
    for a prompt past the window (plain: no cap, scale 1/sqrt(head_dim), one RoPE base, no
    window, SiLU)."""
    prompt = random_prompt(20, seed=7)
    other = tiny_hf_model("gemma3_text", seed=21, **plain)
    assert (hf_last_logits(hf, prompt) - hf_last_logits(other, prompt)).abs().max() > 1e-3


def test_embedding_multiplier_is_rounded_like_transformers():
    """hidden 72: sqrt(72) = 8.485 is 8.5 in bf16; transformers multiplies by the rounded value."""
    hf = tiny_hf_model("gemma3_text", hidden_size=72, num_attention_heads=4, head_dim=18).to(torch.bfloat16)
    plan = make_plan(ModelConfig.from_hf(hf.config), InferenceConfig(batch_size=1, max_context_length=8, sequence_length=16,
                                                                      backend="eager", dtype="bfloat16"))
    ids = torch.tensor([[3, 200, 17, 256, 0, 1, 2, 9]], dtype=torch.int32)
    embed = hf.model.embed_tokens.weight.detach()
    h, _, _ = embed_tokens(plan, REFERENCE_OPS, family_math("gemma3_text"), embed, ids, torch.arange(8, dtype=torch.int32)[None],
                           torch.tensor([8]))
    want = hf.model.embed_tokens(ids.long()).detach()
    assert torch.equal(h, want)
    assert not torch.equal(h, (embed[ids.long()].float() * 72 ** 0.5).to(torch.bfloat16))  # the rounding shows


# --- eager and inductor -------------------------------------------------------------------------


@pytest.mark.parametrize("length", [7, 8, 9, 2 * WINDOW + 3])  # bucket - 1, bucket, bucket + 1, past two windows
def test_prefill_logits_match_transformers(hf, rt, length):
    prompt = random_prompt(length, seed=length)
    out, _ = neuronfx.prefill_step(rt, neuronfx.init_state(rt), PrefillBatch(seq_ids=[0], prompts=[prompt], sampling=[GREEDY]))
    assert out.bucket == (8 if length <= 8 else 32)
    ref = hf_last_logits(hf, prompt)
    torch.testing.assert_close(out.logits[0], ref, atol=ATOL, rtol=0)


def test_greedy_24_tokens_and_ragged_batch_match_transformers(hf, rt):
    """24 greedy tokens of each prompt alone are transformers' ``generate``; the ragged batch of
    all three gives each prompt's own tokens."""
    prompts = [random_prompt(n, seed=500 + n) for n in (3, 9, 20)]  # 44 positions at most: 8x the window
    want = [hf_greedy(hf, p, 24) for p in prompts]
    for p, w in zip(prompts, want):
        result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), p, max_new_tokens=24, eos_token_ids=[])
        assert list(result.token_ids[0]) == w
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=24, eos_token_ids=[])
    assert [list(t) for t in result.token_ids] == want


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_self_speculation_equals_plain_greedy(hf, backend, request):
    # the draft: the sliding layer alone; inductor: the module's runtime (blocks, its window ring)
    rt = (tiny_runtime(hf, "eager", speculation_length=4, draft_layers=1) if backend == "eager"
          else request.getfixturevalue("inductor_rt"))
    prompts = [random_prompt(n, seed=600 + n) for n in (5, 12)]
    result, state = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=20, eos_token_ids=[])
    assert [list(t) for t in result.token_ids] == [hf_greedy(hf, p, 20) for p in prompts]
    assert all(s.drafted > 0 and s.emitted == 19 for s in result.speculation)
    if backend == "inductor":
        assert int((state.blocks.refs > 0).sum()) == 0  # every block back


def test_inductor_decode_logits_equal_eager_slots(inductor_rt, eager_rt):
    """Decode steps through the compiled block writes and the C++ kernel walking both tables (the
    full layer's blocks, the sliding layer's ring) against the eager slots layout: the same
    tokens, logits within fp32 reordering, 30 tokens past prompts of up to 20 (10x the window)."""
    prompts = [random_prompt(n, seed=700 + n) for n in (11, 5, 20)]
    tokens, logits, _, _ = run_steps(inductor_rt, neuronfx.init_state(inductor_rt), [0, 2, 3], prompts, 30)
    want_tokens, want_logits, _, _ = run_steps(eager_rt, neuronfx.init_state(eager_rt), [0, 2, 3], prompts, 30)
    assert tokens == want_tokens
    assert max((a - b).abs().max().item() for ra, rb in zip(logits, want_logits) for a, b in zip(ra, rb)) < 1e-4


def test_bf16_decode_logits_track_fp32_reference():
    """bf16 graphs against transformers in fp32 on the same bf16-rounded weights, within
    test_lowp.py's bound (0.06 on these logits)."""
    errors = bf16_logit_errors(tiny_hf_model("gemma3_text", seed=22))
    assert max(errors) < 0.06, errors


# --- a saved directory: load_checkpoint and the CLI ---------------------------------------------


@pytest.fixture(scope="module")
def model_dir(hf, tmp_path_factory) -> Path:
    """``hf`` saved by transformers, with a word-level tokenizer (token i is "w{i}")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("gemma3")
    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(257)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    return path


def test_saved_directory_loads_and_generates_like_transformers(hf, model_dir):
    ckpt = load_checkpoint(model_dir)
    assert ckpt.config == ModelConfig.from_hf(hf.config, hf.generation_config)
    assert "lm_head.weight" not in ckpt.state_dict  # tied: the embedding serves as LM head
    inference = InferenceConfig(batch_size=1, max_context_length=32, sequence_length=64, backend="eager")
    rt = neuronfx.compile(make_plan(ckpt.config, inference), ckpt.state_dict, progress=False)
    prompt = random_prompt(13, seed=9)
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompt, max_new_tokens=16, eos_token_ids=[])
    assert list(result.token_ids[0]) == hf_greedy(hf, prompt, 16)


def test_cli_generate_matches_transformers(hf, model_dir, capsys):
    args = ["generate", "--model", str(model_dir), "--prompt", "w5 w9 w11 w3 w200 w256 w7", "--max-new-tokens", "12",
            "--ignore-eos", "--backend", "eager", "--batch-size", "1", "--max-context-length", "32",
            "--sequence-length", "64", "--json"]
    assert main(args) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == hf_greedy(hf, [5, 9, 11, 3, 200, 256, 7], 12)
