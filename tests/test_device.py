"""Devices: ``InferenceConfig.device`` in the plan and its JSON, the checks before loading, the
placement helpers (``graphs/device.py``), and tiny models on every device present against
transformers on the same device. CUDA cases are skipped with the reason "no CUDA device" where
torch sees none (CI); ``tests/device/run_on_gpu.sh`` runs them on a lent GPU, with the CUDA-graph
cases (``graphs/cuda_graphs.py``).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import NEEDS_CUDA, devices, random_prompt, run_steps, tiny_hf_model, tiny_plan, tiny_runtime

import neuronfx
from neuronfx import InferenceConfig, ModelConfig, make_plan
from neuronfx.config.inputs import DecodeInputs
from neuronfx.config.serialization import plan_from_json, plan_to_json
from neuronfx.errors import ConfigError
from neuronfx.graphs.phases.device import check_device, device_scope, plan_device, to_device, to_host
from neuronfx.graphs.phases.inputs import LayerKV, example_inputs


def tiny_model() -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-6)


# --- the plan ---------------------------------------------------------------------------------------


def test_default_plan_names_the_cpu_in_its_json():
    plan = make_plan(tiny_model(), InferenceConfig())
    assert plan.inference.device == "cpu"
    assert json.loads(plan_to_json(plan))["inference"]["device"] == "cpu"


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:3"])
def test_plan_json_round_trip_with_device(device):
    # A plan is a pure value: a CUDA plan is written and read on a machine without a GPU.
    plan = make_plan(tiny_model(), InferenceConfig(device=device, backend="inductor"))
    text = plan_to_json(plan)
    assert json.loads(text)["inference"]["device"] == device
    back = plan_from_json(text)
    assert back == plan and back.inference.device == device


@pytest.mark.parametrize("bad", ["gpu", "CUDA", "cuda:", "cuda:-1", "cuda:01", "cuda:0 ", "mps", None, 0])
def test_unknown_device_names_are_config_errors(bad):
    with pytest.raises(ConfigError, match="'cuda:N'"):
        InferenceConfig(device=bad)


@pytest.mark.parametrize("fields, names", [
    ({"backend": "export"}, "backend='export'"),
    ({"backend": "neuron"}, "backend='neuron'"),
    ({"backend": "eager", "weight_format": "int4"}, "weight_format='int4'"),
    ({"backend": "eager", "weight_format": "gguf"}, "weight_format='gguf'"),
])
def test_what_cuda_rules_out(fields, names):
    with pytest.raises(ConfigError, match=names):
        InferenceConfig(device="cuda", **fields)
    InferenceConfig(device="cpu", **fields)  # the same options are fine on the CPU


def test_cuda_device_missing_is_a_config_error_before_loading():
    count = torch.cuda.device_count()  # 0 here: "cuda:0" is missing too
    with pytest.raises(ConfigError, match=f"device='cuda:{count}'.*device='cpu'"):
        check_device(InferenceConfig(device=f"cuda:{count}"))
    with pytest.raises(ConfigError, match="device='cuda'"):
        check_device(InferenceConfig(device="cuda", tp_degree=count + 1))
    check_device(InferenceConfig(device="cpu"))  # nothing to check


def test_plan_device_follows_the_tensor_parallel_rank():
    assert plan_device(make_plan(tiny_model(), InferenceConfig())) == torch.device("cpu")
    assert plan_device(make_plan(tiny_model(), InferenceConfig(device="cuda:3"))) == torch.device("cuda", 3)
    assert plan_device(make_plan(tiny_model(), InferenceConfig(device="cuda"))) == torch.device("cuda", 0)
    rank1 = make_plan(tiny_model(), InferenceConfig(device="cuda", tp_degree=2, backend="eager"), rank=1)
    assert plan_device(rank1) == torch.device("cuda", 1)


# --- the helpers ----------------------------------------------------------------------------------


def test_to_device_moves_every_tensor_and_keeps_ties_and_records():
    embed = torch.randn(8, 4)
    weights = {"embed": embed, "lm_head": embed, "norm": torch.ones(4), "layers": [{"wq": torch.randn(4, 4), "rope_index": torch.tensor(1)}],
               "absent": None}
    moved = to_device(weights, "meta")
    assert moved["lm_head"] is moved["embed"]  # tied embeddings stay one tensor
    assert moved["absent"] is None
    flat = [moved["embed"], moved["norm"], moved["layers"][0]["wq"], moved["layers"][0]["rope_index"]]
    assert all(t.device.type == "meta" for t in flat)
    assert [(t.shape, t.dtype) for t in flat] == [(t.shape, t.dtype) for t in (embed, weights["norm"], *weights["layers"][0].values())]
    kv = to_device((LayerKV(torch.zeros(2, 1, 4, 2), torch.zeros(2, 1, 4, 2)),), "meta")
    assert type(kv[0]) is LayerKV and kv[0].k.device.type == "meta"
    plan = make_plan(tiny_model(), InferenceConfig(batch_size=2, max_context_length=8, sequence_length=16))
    record = example_inputs(plan, plan.graph("decode", 2, 16))
    assert type(to_device(record, "meta")) is DecodeInputs
    assert type(to_device(record, "meta").sampler) is type(record.sampler)
    assert all(t.device.type == "meta" for t in to_device(record, "meta").sampler)


def test_cpu_placement_is_the_identity():
    weights = {"embed": torch.randn(4, 2), "layers": [{"wq": torch.randn(2, 2)}]}
    same = to_device(weights, "cpu")
    assert same["embed"] is weights["embed"] and same["layers"][0]["wq"] is weights["layers"][0]["wq"]
    out = {"tokens": torch.tensor([3]), "logits": torch.randn(1, 4)}
    assert all(to_host(out)[k] is out[k] for k in out)
    plan = make_plan(tiny_model(), InferenceConfig())
    with device_scope(plan):
        assert torch.zeros(1).device.type == "cpu"


def test_cuda_plans_bind_torch_ops_not_the_cpu_kernels():
    from neuronfx.graphs.kernels.bundles import REFERENCE_OPS, compiled_ops

    ops = compiled_ops("bfloat16", "cuda:1")
    assert (ops.linear, ops.projections, ops.glu, ops.attention, ops.cached_attention, ops.topk) == (
        REFERENCE_OPS.linear, REFERENCE_OPS.projections, REFERENCE_OPS.glu, REFERENCE_OPS.attention, REFERENCE_OPS.cached_attention,
        REFERENCE_OPS.topk)


def test_cuda_graphs_only_for_single_rank_cuda_plans(monkeypatch):
    from neuronfx.graphs.backends.cuda_graphs import uses_cuda_graphs

    monkeypatch.delenv("NEURONFX_CUDA_GRAPHS", raising=False)
    cuda = make_plan(tiny_model(), InferenceConfig(device="cuda"))
    assert uses_cuda_graphs(cuda)
    assert not uses_cuda_graphs(make_plan(tiny_model(), InferenceConfig()))
    assert not uses_cuda_graphs(make_plan(tiny_model(), InferenceConfig(device="cuda", tp_degree=2, backend="eager")))
    monkeypatch.setenv("NEURONFX_CUDA_GRAPHS", "0")
    assert not uses_cuda_graphs(cuda)
    monkeypatch.setenv("NEURONFX_CUDA_GRAPHS", "yes")
    with pytest.raises(ConfigError, match="NEURONFX_CUDA_GRAPHS='yes'"):
        uses_cuda_graphs(cuda)


def test_a_capture_is_keyed_by_every_kv_tensor_and_the_weights():
    from neuronfx.graphs.backends.cuda_graphs import kv_key
    from neuronfx.graphs.phases.inputs import empty_kv

    plan = make_plan(tiny_model(), InferenceConfig(batch_size=1, max_context_length=8, sequence_length=16))
    weights, kv = {"embed": torch.zeros(1)}, empty_kv(plan)
    assert kv_key(weights, kv) == kv_key(weights, kv)
    other = (kv[0], LayerKV(kv[1].k, torch.zeros_like(kv[1].v)))  # one V tensor replaced
    assert kv_key(weights, other) != kv_key(weights, kv)
    assert kv_key(dict(weights), kv) != kv_key(weights, kv)


# --- tiny models on each device against transformers --------------------------------------------


@torch.no_grad()
def hf_greedy_on(hf, prompt, n, device) -> tuple[list[int], torch.Tensor]:
    """(``n`` greedy tokens, fp32 logits of the first one [vocab] on the host) from
    transformers on ``device``."""
    ids = torch.tensor([list(prompt)], device=device)
    first = hf(ids).logits[0, -1].float().cpu()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist(), first


@pytest.mark.parametrize("device", devices())
def test_tiny_model_on_device_matches_transformers(device):
    hf = tiny_hf_model("llama")
    runtime = tiny_runtime(hf, "eager", device=device)
    state = neuronfx.init_state(runtime)
    assert runtime.plan.inference.device == device
    assert runtime.weights["embed"].device.type == device and state.kv[0].k.device.type == device
    assert state.output_counts.device.type == "cpu"  # host bookkeeping stays on the host
    prompts = [random_prompt(11, 1), random_prompt(5, 2)]
    tokens, logits, _, state = run_steps(runtime, state, [0, 2], prompts, 6)
    reference = copy.deepcopy(hf).to(device)
    for r, prompt in enumerate(prompts):
        want, first = hf_greedy_on(reference, prompt, 6, device)
        assert tokens[r] == want
        assert logits[r][0].device.type == "cpu"  # outputs come back to the host
        torch.testing.assert_close(logits[r][0], first, atol=1e-4, rtol=1e-4)


@NEEDS_CUDA
def test_cuda_graphs_replay_the_eager_steps_and_follow_a_new_state():
    from neuronfx.graphs.backends.cuda_graphs import CapturedGraph

    hf = tiny_hf_model("llama")
    eager = tiny_runtime(hf, "eager", device="cuda")
    graphed = neuronfx.compile(tiny_plan(hf, "inductor", device="cuda"), hf.state_dict(), progress=False, cache=False)
    assert all(isinstance(g, CapturedGraph) for g in graphed.graphs.values())
    prompts = [random_prompt(11, 1), random_prompt(5, 2), random_prompt(20, 3), random_prompt(3, 4)]
    want, want_logits, want_buckets, _ = run_steps(eager, neuronfx.init_state(eager), [0, 1, 2, 3], prompts, 12)
    for _ in range(2):  # a second state has another KV cache: every graph is captured again for it
        got, got_logits, buckets, _ = run_steps(graphed, neuronfx.init_state(graphed), [0, 1, 2, 3], prompts, 12)
        assert got == want and buckets == want_buckets
        for r in range(len(prompts)):
            torch.testing.assert_close(torch.stack(got_logits[r]), torch.stack(want_logits[r]), atol=2e-4, rtol=2e-4)
