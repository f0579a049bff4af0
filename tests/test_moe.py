"""Mixture-of-experts families (mixtral, qwen3_moe): the router and both expert strategies
against naive references, the registry's options and refusals, and the tiny random models
against transformers: 24 greedy tokens and a ragged batch on eager (both families) and inductor
(qwen3_moe: one compiled runtime of 6 layers alternating dense and MoE, shared by its tests), prefill logits at bucket - 1 and bucket
on inductor (bucket - 1, bucket, bucket + 1 on eager: tests/test_models.py), bf16, a save_pretrained directory (hub layout: one
tensor per expert) through load_checkpoint, lazy tensor-parallel reads and the CLI, and
self-speculation. qwen3_moe with dense layers among the MoE ones (``mlp_only_layers``,
``decoder_sparse_step``): which layers the config records as MoE, the configs with none refused,
eager against transformers on three patterns (one that repeats, one whose period does not
divide the layers, one that never repeats), a saved directory and its tensor-parallel split, an
int8 plan, that inductor runtime (a 2-layer compiled group reused three times in prefill) and
the compiled group sizes of irregular patterns.

The tiny models (tests/helpers.py): mixtral 4 experts, qwen3_moe 8 experts (48 wide), both
top-2, vocabulary 257. Decode of 4 rows runs the dense strategy on mixtral (4 * 2 > 4 experts)
and the gathered one on qwen3_moe (4 * 2 <= 8); one row gathers on both; prefill is dense.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import GREEDY, hf_greedy, hf_last_logits, random_prompt, run_steps, tiny_hf_model, tiny_runtime
from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import neuronfx
from neuronfx import ModelConfig, PrefillBatch
from neuronfx.cli import main
from neuronfx.config.attention import layer_kinds
from neuronfx.config.sharding import rank_shard
from neuronfx.errors import CheckpointError, ConfigError, UnsupportedModelError
from neuronfx.graphs.models import quant
from neuronfx.graphs.models.moe import dense_experts, gathered_experts, route, use_gather
from neuronfx.io.checkpoints import load_checkpoint
from neuronfx.io.weights import convert_hf_state_dict, dequantized_state_dict

ATOL = 1e-4
FAMILIES = ["mixtral", "qwen3_moe"]
SEED = {"mixtral": 21, "qwen3_moe": 22}


# --- router and experts against naive references ----------------------------------------------


def naive_moe(x: torch.Tensor, router: torch.Tensor, k: int, renormalise: bool, gate, up, down) -> torch.Tensor:
    """Token by token, expert by expert, in float64: softmax, pick the k largest, optionally
    renormalise, sum weight * down(silu(gate x) * up x)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for n in range(x.shape[0]):
        xn = x[n].double()
        probs = torch.softmax(router.double() @ xn, -1).tolist()
        picked = sorted(range(len(probs)), key=lambda e: -probs[e])[:k]
        total = sum(probs[e] for e in picked) if renormalise else 1.0
        for e in picked:
            a = F.silu(gate[e].double() @ xn) * (up[e].double() @ xn)
            out[n] += probs[e] / total * (down[e].double() @ a)
    return out


@pytest.mark.parametrize("renormalise", [False, True])
@pytest.mark.parametrize("experts, k", [(4, 1), (4, 2), (8, 2), (6, 6)])
def test_route_and_both_strategies_match_naive(experts, k, renormalise):
    g = torch.Generator().manual_seed(experts * 10 + k)
    n, h, i = 5, 12, 7
    x = torch.randn(n, h, generator=g)
    router = torch.randn(experts, h, generator=g)
    gate, up = torch.randn(experts, i, h, generator=g), torch.randn(experts, i, h, generator=g)
    down = torch.randn(experts, h, i, generator=g)
    weights, ids = route(x, router, k, renormalise)
    assert weights.dtype == torch.float32 and ids.shape == (n, k)
    probs = torch.softmax(x.double() @ router.double().T, -1)
    for row in range(n):
        want = probs[row].topk(k).indices
        assert set(ids[row].tolist()) == set(want.tolist())
        expect = probs[row, ids[row]] / (probs[row, ids[row]].sum() if renormalise else 1.0)
        torch.testing.assert_close(weights[row].double(), expect, atol=1e-6, rtol=0)
    ref = naive_moe(x, router, k, renormalise, gate, up, down).float()
    for experts_fn in (gathered_experts, dense_experts):
        torch.testing.assert_close(experts_fn(x, weights, ids, gate, up, down), ref, atol=1e-4, rtol=1e-5)


def test_strategy_is_chosen_from_rows_only():
    """Gather while the rows' k picks are at most all experts' weights, else dense."""
    cfg = ModelConfig.from_hf(tiny_hf_model("qwen3_moe").config)  # 8 experts, top-2
    assert [use_gather(rows, cfg) for rows in (1, 2, 4, 5, 8)] == [True, True, True, False, False]


# --- registry options ------------------------------------------------------------------------------


TINY_ARCH = dict(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)


def test_config_fields_from_transformers():
    mixtral = ModelConfig.from_hf(MixtralConfig(**TINY_ARCH, num_local_experts=8, num_experts_per_tok=2, sliding_window=4096,
                                                router_jitter_noise=0.1, output_router_logits=True, router_aux_loss_coef=0.5))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.norm_topk_prob, mixtral.moe_intermediate_size) == (8, 2, True, 128)
    assert mixtral.sliding_window == 4096 and not mixtral.qk_norm
    qwen = ModelConfig.from_hf(Qwen3MoeConfig(**TINY_ARCH, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
                                              norm_topk_prob=True, output_router_logits=True))
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.norm_topk_prob, qwen.moe_intermediate_size) == (6, 3, True, 32)
    assert qwen.qk_norm and qwen.sliding_window is None
    assert ModelConfig.from_hf(LlamaConfig(**TINY_ARCH)).num_experts == 0


@pytest.mark.parametrize("overrides, moe_layers", [
    (dict(mlp_only_layers=[1]), (0,)),
    (dict(decoder_sparse_step=2), (1,)),
    (dict(num_hidden_layers=3, mlp_only_layers=[0]), (1, 2)),  # irregular: nothing repeats
    (dict(num_hidden_layers=5, decoder_sparse_step=2), (1, 3)),  # period 2 does not divide 5
    (dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]), (1,)),  # both options at once
    (dict(num_hidden_layers=3, mlp_only_layers=[]), ()),  # every layer MoE: no per-layer record
])
def test_qwen3_moe_dense_layers_are_recorded(overrides, moe_layers):
    """ModelConfig.moe_layers lists the layers transformers builds a sparse MoE block for (the
    others get a dense Qwen3MoeMLP of intermediate_size); () when every layer is MoE."""
    hf = tiny_hf_model("qwen3_moe", **overrides)
    cfg = ModelConfig.from_hf(hf.config)
    assert cfg.moe_layers == moe_layers
    assert cfg.dense_intermediate_size == (hf.config.intermediate_size if moe_layers else 0)
    built = tuple("moe" if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) else "dense" for layer in hf.model.layers)
    assert layer_kinds(cfg) == (built if moe_layers else ("same",) * cfg.num_hidden_layers)


@pytest.mark.parametrize("overrides, error, needle", [
    (dict(mlp_only_layers=[0, 1]), UnsupportedModelError, "mlp_only_layers=[0, 1]"),  # every layer dense
    (dict(decoder_sparse_step=3), UnsupportedModelError, "decoder_sparse_step=3"),  # 2 layers: no MoE layer either
    (dict(decoder_sparse_step=0), ConfigError, "decoder_sparse_step=0"),
])
def test_qwen3_moe_without_moe_layers_is_refused(overrides, error, needle):
    with pytest.raises(error, match=re.escape(needle)):
        ModelConfig.from_hf(Qwen3MoeConfig(**TINY_ARCH, num_experts=4, moe_intermediate_size=32, **overrides))


@pytest.mark.parametrize("overrides, needle", [
    (dict(model_type="llama", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8), "num_experts=4"),
    (dict(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0), "num_experts=0"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok=0"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size=0"),
])
def test_invalid_expert_fields(overrides, needle):
    base = ModelConfig.from_hf(MixtralConfig(**TINY_ARCH, num_local_experts=4))
    fields = {f: getattr(base, f) for f in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                             "num_key_value_heads", "head_dim", "intermediate_size", "rope_theta", "rms_norm_eps",
                                             "num_experts", "num_experts_per_tok", "moe_intermediate_size")}
    with pytest.raises(ConfigError, match=needle):
        ModelConfig(**(fields | overrides))


# --- against transformers --------------------------------------------------------------------------


@pytest.fixture(scope="module", params=FAMILIES)
def hf(request):
    return tiny_hf_model(request.param, seed=SEED[request.param])


# One bucket per phase. Inductor: one runtime, qwen3_moe (2 graphs, ~6 compiled parts, the
# suite's budget allows one): its prefill runs the dense experts, its decode of 4 rows the
# gathered ones (4 * 2 <= 8 experts); mixtral differs from it only in Llama's attention (compiled
# in test_models.py) and the renormalisation (the same route() on every backend).
COMPILED = dict(max_context_length=16, prefill_buckets=(16,), decode_buckets=(64,))


@pytest.fixture(scope="module")
def eager(hf):
    return tiny_runtime(hf, "eager", **COMPILED)


@pytest.fixture(scope="module")
def inductor_qwen3_moe():
    """(tiny qwen3_moe, its inductor runtime): 6 layers alternating dense and MoE
    (decoder_sparse_step=2), batch 4, prefill bucket 16, decode bucket 64."""
    hf = tiny_hf_model("qwen3_moe", seed=28, num_hidden_layers=6, decoder_sparse_step=2)
    return hf, tiny_runtime(hf, "inductor", **COMPILED)


@pytest.mark.parametrize("length", [15, 16])  # bucket - 1, bucket (bucket + 1 is the next graph: eager, test_models.py)
def test_inductor_prefill_logits_match_transformers(inductor_qwen3_moe, length):
    hf, rt = inductor_qwen3_moe
    prompt = random_prompt(length, seed=length)
    out, _ = neuronfx.prefill_step(rt, neuronfx.init_state(rt), PrefillBatch(seq_ids=[0], prompts=[prompt], sampling=[GREEDY]))
    assert out.bucket == 16
    torch.testing.assert_close(out.logits[0], hf_last_logits(hf, prompt), atol=ATOL, rtol=0)


def check_greedy_and_ragged(hf, rt) -> None:
    """24 greedy tokens of one prompt, then a ragged batch of three prompts whose tokens each
    equal that prompt run alone (and transformers')."""
    prompt = random_prompt(11, seed=3)
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompt, max_new_tokens=24, eos_token_ids=[])
    assert list(result.token_ids[0]) == hf_greedy(hf, prompt, 24)
    prompts = [random_prompt(n, seed=40 + n) for n in (3, 16, 9)]
    batch, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=12, eos_token_ids=[])
    for p, tokens in zip(prompts, batch.token_ids, strict=True):
        alone, _ = neuronfx.generate(rt, neuronfx.init_state(rt), p, max_new_tokens=12, eos_token_ids=[])
        assert list(tokens) == list(alone.token_ids[0]) == hf_greedy(hf, p, 12), f"prompt length {len(p)}"


def test_eager_24_greedy_tokens_and_ragged_batch_match_transformers(hf, eager):
    check_greedy_and_ragged(hf, eager)


def test_inductor_24_greedy_tokens_and_ragged_batch_match_transformers(inductor_qwen3_moe):
    check_greedy_and_ragged(*inductor_qwen3_moe)


def test_qwen3_moe_renormalised_top_k_matches_transformers():
    hf = tiny_hf_model("qwen3_moe", seed=23, norm_topk_prob=True)
    rt = tiny_runtime(hf, "eager", **COMPILED)
    assert rt.plan.model.norm_topk_prob
    for length in (5, 12):
        prompt = random_prompt(length, seed=60 + length)
        out, _ = neuronfx.prefill_step(rt, neuronfx.init_state(rt), PrefillBatch(seq_ids=[0], prompts=[prompt], sampling=[GREEDY]))
        torch.testing.assert_close(out.logits[0], hf_last_logits(hf, prompt), atol=ATOL, rtol=0)


def test_bf16_decode_logits_track_fp32_reference(hf):
    """As tests/test_lowp.py: bf16 graphs against fp32 transformers on the same bf16-rounded
    weights, |logit error| < 0.06 over 8 decode steps (batch 1: the gathered experts)."""
    ref = tiny_hf_model(hf.config.model_type, seed=SEED[hf.config.model_type])
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    rt = tiny_runtime(ref, "eager", batch_size=1, dtype="bfloat16", **COMPILED)
    prompt = random_prompt(11, seed=5)
    tokens, logits, _, _ = run_steps(rt, neuronfx.init_state(rt), [0], [prompt], 8)
    for i in range(8):
        err = (logits[0][i] - hf_last_logits(ref, prompt + tokens[0][:i])).abs().max().item()
        assert err < 0.06, f"step {i}: max |logit error| {err:.4f}"


def test_self_speculation_gives_plain_greedy(hf):
    rt = tiny_runtime(hf, "eager", speculation_length=3, draft_layers=1, **COMPILED)
    prompts = [random_prompt(n, seed=70 + n) for n in (6, 13)]
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=15, eos_token_ids=[])
    for p, tokens in zip(prompts, result.token_ids, strict=True):
        assert list(tokens) == hf_greedy(hf, p, 15)
    assert all(s.drafted > 0 and s.emitted == 14 for s in result.speculation)


# --- checkpoints: both layouts, lazy tensor-parallel reads, the CLI ---------------------------------


@pytest.fixture(scope="module")
def saved(hf, tmp_path_factory) -> Path:
    """``hf`` saved by transformers (per-expert hub names) with a word-level tokenizer ("w{i}" = i)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp(hf.config.model_type)
    hf.save_pretrained(path)
    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(hf.config.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    return path


def test_saved_directory_holds_per_expert_tensors_and_loads(hf, saved):
    ckpt = load_checkpoint(saved)
    assert ckpt.config == ModelConfig.from_hf(hf.config, hf.generation_config)
    assert any(".experts.3." in name for name in ckpt.state_dict)  # the hub layout
    assert not any(name.endswith("gate_up_proj") for name in ckpt.state_dict)
    # both layouts give the same weights
    from_file = convert_hf_state_dict(ckpt.state_dict, ckpt.config, "float32")
    from_memory = convert_hf_state_dict(hf.state_dict(), ckpt.config, "float32")
    for name in ("router", "experts_gate", "experts_up", "experts_down"):
        for layer in range(ckpt.config.num_hidden_layers):
            assert torch.equal(from_file["layers"][layer][name], from_memory["layers"][layer][name]), name


@pytest.mark.parametrize("layout", ["hub", "fused"])
def test_lazy_tensor_parallel_reads_split_every_expert(hf, saved, tmp_path, layout):
    """Rank r of 3 reads, lazily from safetensors, exactly the slices of the whole weights its
    shard names (moe_intermediate_size does not divide by 3: the last rank is zero-padded);
    ``fused``: a file written with transformers' in-memory names (gate_up_proj)."""
    from safetensors.torch import save_file

    if layout == "fused":
        save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text((saved / "config.json").read_text())
        source = tmp_path
    else:
        source = saved
    cfg = ModelConfig.from_hf(hf.config)
    whole = convert_hf_state_dict(hf.state_dict(), cfg, "float32")
    lazy = load_checkpoint(source, lazy=True).state_dict
    i = cfg.moe_intermediate_size
    for rank in range(3):
        shard = rank_shard(cfg, 3, rank)
        part = convert_hf_state_dict(lazy, cfg, "float32", shard)
        start, size = shard.expert_intermediate_start, shard.expert_intermediate_size
        real = max(0, min(size, i - start))
        for lw, ref in zip(part["layers"], whole["layers"], strict=True):
            assert torch.equal(lw["router"], ref["router"])
            for name in ("experts_gate", "experts_up"):
                assert lw[name].shape == (cfg.num_experts, size, cfg.hidden_size)
                assert torch.equal(lw[name][:, :real], ref[name][:, start:start + real])
                assert torch.count_nonzero(lw[name][:, real:]) == 0
            assert torch.equal(lw["experts_down"][:, :, :real], ref["experts_down"][:, :, start:start + real])


def test_incomplete_experts_are_named(hf, saved):
    state_dict = dict(load_checkpoint(saved).state_dict)
    del state_dict["model.layers.1.mlp.experts.2.down_proj.weight" if hf.config.model_type == "qwen3_moe"
                   else "model.layers.1.block_sparse_moe.experts.2.w2.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensors \['model.layers.1.mlp.experts.down_proj'\]"):
        convert_hf_state_dict(state_dict, ModelConfig.from_hf(hf.config), "float32")


def test_cli_generates_transformers_greedy_tokens(hf, saved, capsys):
    prompt = [5, 9, 11, 3, 200]
    args = ["generate", "--model", str(saved), "--prompt", " ".join(f"w{t}" for t in prompt), "--max-new-tokens", "12",
            "--ignore-eos", "--backend", "eager", "--batch-size", "1", "--max-context-length", "16", "--sequence-length", "64",
            "--json"]
    assert main(args) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == hf_greedy(hf, prompt, 12)


# --- qwen3_moe with dense layers among the MoE layers -----------------------------------------------

DENSE_LAYERS = {  # name -> config overrides (layer kinds as transformers builds them)
    "mlp-only": dict(mlp_only_layers=[1]),  # MoE, dense
    "sparse-step": dict(num_hidden_layers=3, decoder_sparse_step=2),  # dense, MoE, dense: no period divides
    "irregular": dict(num_hidden_layers=3, mlp_only_layers=[0]),  # dense, MoE, MoE
}


@pytest.fixture(scope="module", params=list(DENSE_LAYERS))
def mixed(request):
    return tiny_hf_model("qwen3_moe", seed=25, **DENSE_LAYERS[request.param])


def check_logits(hf, rt, lengths=(5, 16), steps=6) -> None:
    """Prefill logits at each length, then ``steps`` decode steps' logits, against transformers'
    full forward passes."""
    for length in lengths:
        prompt = random_prompt(length, seed=80 + length)
        tokens, logits, _, _ = run_steps(rt, neuronfx.init_state(rt), [0], [prompt], steps)
        for i in range(steps):
            torch.testing.assert_close(logits[0][i], hf_last_logits(hf, prompt + tokens[0][:i]), atol=ATOL, rtol=0,
                                       msg=lambda m, i=i, n=length: f"prompt {n}, step {i}: {m}")


def test_dense_layers_match_transformers_eager(mixed):
    rt = tiny_runtime(mixed, "eager", **COMPILED)
    moe_layers = rt.plan.model.moe_layers
    assert moe_layers and all(("router" in lw) == (i in moe_layers) for i, lw in enumerate(rt.weights["layers"]))
    assert all(("gate" in lw) == (i not in moe_layers) for i, lw in enumerate(rt.weights["layers"]))
    check_logits(mixed, rt)
    check_greedy_and_ragged(mixed, rt)


def test_dense_layers_load_from_a_saved_directory_and_split_over_ranks(tmp_path):
    """save_pretrained's hub layout (per-expert tensors in MoE layers, mlp.*_proj in dense ones)
    loads; at tp 2 each rank holds its half of the dense MLP's intermediate rows and of every
    expert's (no rule is missing for either kind of layer)."""
    hf = tiny_hf_model("qwen3_moe", seed=26, num_hidden_layers=3, decoder_sparse_step=2)
    hf.save_pretrained(tmp_path)
    ckpt = load_checkpoint(tmp_path)
    assert "model.layers.0.mlp.gate_proj.weight" in ckpt.state_dict and "model.layers.1.mlp.experts.0.up_proj.weight" in ckpt.state_dict
    whole = convert_hf_state_dict(ckpt.state_dict, ckpt.config, "float32")
    from_memory = convert_hf_state_dict(hf.state_dict(), ckpt.config, "float32")
    for lw, ref in zip(whole["layers"], from_memory["layers"], strict=True):
        assert lw.keys() == ref.keys() and all(torch.equal(lw[k], ref[k]) for k in lw)
    i, e = ckpt.config.intermediate_size // 2, ckpt.config.moe_intermediate_size // 2
    for rank in range(2):
        part = convert_hf_state_dict(load_checkpoint(tmp_path, lazy=True).state_dict, ckpt.config, "float32", rank_shard(ckpt.config, 2, rank))
        dense, sparse = part["layers"][0], part["layers"][1]
        assert torch.equal(dense["gate"], whole["layers"][0]["gate"][rank * i:(rank + 1) * i])
        assert torch.equal(dense["down"], whole["layers"][0]["down"][:, rank * i:(rank + 1) * i])
        assert torch.equal(sparse["experts_up"], whole["layers"][1]["experts_up"][:, rank * e:(rank + 1) * e])
    rt = neuronfx.compile(neuronfx.make_plan(ckpt.config, neuronfx.InferenceConfig(backend="eager", batch_size=1, sequence_length=64, **COMPILED)), ckpt.state_dict,
                          progress=False)
    prompt = random_prompt(9, seed=4)
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompt, max_new_tokens=12, eos_token_ids=[])
    assert list(result.token_ids[0]) == hf_greedy(hf, prompt, 12)


def test_dense_layers_quantize_and_experts_stay_float():
    """An int8 plan quantizes the dense layers' MLP (as any dense MLP) and keeps the experts
    float; its logits are transformers' on the weights it multiplies by."""
    hf = tiny_hf_model("qwen3_moe", seed=27, mlp_only_layers=[1])
    rt = tiny_runtime(hf, "eager", weight_format="int8", batch_size=1, **COMPILED)
    dense, sparse = rt.weights["layers"][1], rt.weights["layers"][0]
    assert isinstance(dense["down"], quant.Int8Weight) and sparse["experts_down"].dtype == torch.float32
    ref = tiny_hf_model("qwen3_moe", seed=27, mlp_only_layers=[1])
    ref.load_state_dict(dequantized_state_dict(hf.state_dict(), rt.weights, rt.plan.model))
    check_logits(ref, rt, lengths=(7,), steps=3)


def test_dense_layers_match_transformers_inductor(inductor_qwen3_moe):
    """The module's inductor runtime, 6 layers alternating dense and MoE: prefill runs one
    compiled 2-layer group (dense, MoE) three times, decode one 6-layer group; its logits are
    transformers' (its greedy tokens and a ragged batch: the test above)."""
    from neuronfx.graphs.backends.inductor_parts import phase_group_size

    hf, rt = inductor_qwen3_moe
    assert rt.plan.model.moe_layers == (1, 3, 5)
    assert (phase_group_size(rt.plan, "prefill"), phase_group_size(rt.plan, "decode")) == (2, 6)
    check_logits(hf, rt, lengths=(15, 16), steps=4)


@pytest.mark.parametrize("overrides, groups", [
    (dict(num_hidden_layers=3, mlp_only_layers=[0]), (3, 3)),  # nothing repeats: the whole stack
    (dict(num_hidden_layers=12, mlp_only_layers=[0]), (12, 12)),  # above the group limits, still whole
    (dict(num_hidden_layers=5, decoder_sparse_step=2), (5, 5)),  # period 2 does not divide 5
    (dict(num_hidden_layers=12, decoder_sparse_step=3), (3, 6)),  # dense, dense, MoE: whole periods
])
def test_compiled_layer_groups_hold_whole_periods_of_layer_kinds(overrides, groups):
    """The inductor backend's layer group (one compiled group serves every group of a phase) is
    a whole number of periods of the dense / MoE pattern, the whole stack when it has none."""
    from neuronfx.graphs.backends.inductor_parts import phase_group_size

    cfg = ModelConfig.from_hf(Qwen3MoeConfig(**(TINY_ARCH | overrides), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    plan = neuronfx.make_plan(cfg, neuronfx.InferenceConfig(backend="inductor", batch_size=1, sequence_length=64, **COMPILED))
    assert (phase_group_size(plan, "prefill"), phase_group_size(plan, "decode")) == groups
