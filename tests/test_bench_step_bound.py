"""``neuronfx bench step-bound``: the product list of a decode step (``bench/step_products.py``)
against the kernel calls a decode graph with the CPU kernel ops really makes, on tiny models of
each weight format and layer shape; the benchmark end to end on a tiny GGUF; its option checks."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import TINY_INFERENCE, tiny_hf_model, write_tiny_gguf

import neuronfx
from neuronfx.bench.step_products import kernel_calls, products_bytes, recorded_kernel_calls, step_products
from neuronfx.cli import main
from neuronfx.config.inference import InferenceConfig
from neuronfx.config.model import ModelConfig
from neuronfx.config.plan import make_plan
from neuronfx.errors import UnsupportedModelError
from neuronfx.graphs.kernels.activation_choice import ALL_PATHS, FLOAT_PATHS
from neuronfx.graphs.kernels.bundles import cpu_kernel_ops
from neuronfx.graphs.kernels.library import small_gemm_available
from neuronfx.graphs.phases.compose import build_module
from neuronfx.graphs.phases.inputs import empty_kv, example_inputs
from neuronfx.io.checkpoints import load_checkpoint

FLOAT_LAYER = ["neuronfx::small_gemm_multi", "neuronfx::small_gemm", "neuronfx::small_glu", "neuronfx::small_gemm"]
QUANT_LAYER = ["neuronfx::quant_gemm_multi", "neuronfx::quant_gemm", "neuronfx::quant_glu", "neuronfx::quant_gemm"]
PATHS = {"float": FLOAT_PATHS, "int8": ALL_PATHS}


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not small_gemm_available():
        pytest.fail("the neuronfx kernel library did not build on this machine (see the warning above)")


@pytest.fixture(autouse=True)
def small_read_probe(monkeypatch):
    monkeypatch.setattr("neuronfx.bench.bandwidth.READ_PROBE_BYTES", 4 * 2**20)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    """Two layers whose linears alternate types (F32, F16, Q4_0, Q4_1, Q8_0): dequantized at load
    (one compiled layer group serves every layer), so float layers; a Q4_1 LM head kept."""
    return write_tiny_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"), tiny_hf_model("llama", seed=5))


UNIFORM = dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), "Q4_1")
"""SmolLM2's GGUF: every linear Q4_1."""
MIXED = {"attn_q": "Q4_1", "attn_k": "F16", "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_gate": "Q4_1", "ffn_up": "Q8_0",
         "ffn_down": "Q8_0"}
"""One type per kind in every layer (so all kept), differing within Q/K/V and gate/up."""


def signature(call) -> tuple:
    """A kernel call's op and arguments: x (the first) by shape and dtype, every other tensor by
    shape, dtype and storage (the same weight), the rest (format ids, flags) by value."""
    def arg(i: int, a: object) -> object:
        return (tuple(a.shape), a.dtype, i == 0 or a.data_ptr()) if isinstance(a, torch.Tensor) else a
    return call.name, tuple(arg(i, a) for i, a in enumerate(call.args))


def graph_calls(runtime: neuronfx.Runtime, dtype: str, activation_format: str) -> list:
    """The product kernel calls (all but attention and the sampler's top-k) of one batch-1
    decode graph of ``runtime``'s plan built with the CPU kernel ops, run eagerly on its weights."""
    plan = runtime.plan
    spec = next(s for s in plan.graphs if s.phase == "decode" and s.batch_size == 1)
    graph = build_module(plan, spec, cpu_kernel_ops(dtype, PATHS[activation_format]))
    calls = recorded_kernel_calls(lambda: graph(runtime.weights, empty_kv(plan), example_inputs(plan, spec)))
    return [c for c in calls if c.name not in ("neuronfx::cached_attention", "neuronfx::topk_rows")]


def tiny_case(model_type: str, weight_format: str, dtype: str, **overrides: object) -> neuronfx.Runtime:
    hf = tiny_hf_model(model_type, **overrides)
    inference = InferenceConfig(**(TINY_INFERENCE | {"batch_size": 1, "dtype": dtype, "weight_format": weight_format, "backend": "eager"}))
    return neuronfx.compile(make_plan(ModelConfig.from_hf(hf.config, hf.generation_config), inference), hf.state_dict(), progress=False)


@pytest.mark.parametrize("model_type, weight_format, dtype, act, overrides, expected", [
    ("llama", "float", "float32", "float", {}, FLOAT_LAYER * 2 + ["neuronfx::small_gemm"]),
    ("llama", "float", "bfloat16", "float", {}, FLOAT_LAYER * 2 + ["neuronfx::small_gemm"]),
    ("llama", "int8", "float32", "float", {}, QUANT_LAYER * 2 + ["neuronfx::quant_gemm"]),
    ("llama", "int4", "float32", "int8", {}, QUANT_LAYER * 2 + ["neuronfx::quant_gemm"]),  # the int8 head keeps float x
    # int8 weights with int8 activations: the integer GEMM kernel at decode rows, one per weight; the int8 head keeps float x
    ("llama", "int8", "float32", "int8", {}, ["neuronfx::w8a8_gemm"] * 14 + ["neuronfx::quant_gemm"]),
    # q/k/v/o and gate/up/down biases: gate and up through small_gemm_multi with their biases
    ("llama", "float", "float32", "float", {"attention_bias": True, "mlp_bias": True},
     ["neuronfx::small_gemm_multi", "neuronfx::small_gemm", "neuronfx::small_gemm_multi", "neuronfx::small_gemm"] * 2
     + ["neuronfx::small_gemm"]),
    ("qwen3", "float", "float32", "float", {}, FLOAT_LAYER * 2 + ["neuronfx::small_gemm"]),  # o_proj K = 4 x 32 != hidden
    ("gemma3_text", "float", "float32", "float", {},  # gelu: gate and up as projections; a tied LM head
     ["neuronfx::small_gemm_multi", "neuronfx::small_gemm", "neuronfx::small_gemm_multi", "neuronfx::small_gemm"] * 2
     + ["neuronfx::small_gemm"]),
])
def test_step_products_are_the_decode_graphs_kernel_calls(model_type, weight_format, dtype, act, overrides, expected):
    rt = tiny_case(model_type, weight_format, dtype, **overrides)
    calls = kernel_calls(step_products(rt.weights, rt.plan.model), cpu_kernel_ops(dtype, PATHS[act]), getattr(torch, dtype))
    assert [c.name for c in calls] == expected
    assert [signature(c) for c in calls] == [signature(c) for c in graph_calls(rt, dtype, act)]


@pytest.mark.parametrize("types, expected", [
    (UNIFORM, QUANT_LAYER * 2 + ["neuronfx::quant_gemm"]),
    # Q/K/V of three formats (F16 dequantized: float) and gate/up of two: one product each, as cpu_projections / cpu_glu fall back
    (MIXED, ["neuronfx::quant_gemm", "neuronfx::small_gemm"] + ["neuronfx::quant_gemm"] * 5
     + ["neuronfx::quant_gemm", "neuronfx::small_gemm"] + ["neuronfx::quant_gemm"] * 6),
])
@pytest.mark.parametrize("act", ["float", "int8"])
def test_step_products_of_gguf_blocks(tmp_path, types, expected, act):
    hf = tiny_hf_model("llama", seed=5)
    ckpt = load_checkpoint(write_tiny_gguf(str(tmp_path / "tiny.gguf"), hf, types), gguf_blocks=True)
    inference = InferenceConfig(**(TINY_INFERENCE | {"batch_size": 1, "weight_format": "gguf", "backend": "eager"}))
    rt = neuronfx.compile(make_plan(ckpt.config, inference), ckpt.state_dict, progress=False)
    calls = kernel_calls(step_products(rt.weights, rt.plan.model), cpu_kernel_ops("float32", PATHS[act]), torch.float32)
    assert [c.name for c in calls] == expected
    assert [signature(c) for c in calls] == [signature(c) for c in graph_calls(rt, "float32", act)]
    # int8_x: a bool argument, dropped from the recorded call when it is the default False; on for 4-bit weights only
    quant = [c for c in calls if c.name.startswith("neuronfx::quant")]
    fmt_arg = {"neuronfx::quant_gemm": 4, "neuronfx::quant_gemm_multi": 1, "neuronfx::quant_glu": 7}
    four_bit = [c.args[fmt_arg[c.name]] in (1, 2, 3) for c in quant]  # the format id: int4, q4_0, q4_1
    assert [True in [a for a in c.args if isinstance(a, bool)] for c in quant] == [act == "int8" and f for f in four_bit]
    assert any(four_bit) and not all(four_bit) if types is MIXED else all(four_bit)


def test_products_bytes_counts_each_weight_once():
    """fp32: 2 layers of q 64x64, k and v 32x64, o 64x64, gate and up 128x64, down 64x128, the
    256x64 LM head; with biases, the q/k/v and gate/up biases too (o_proj's and down's are
    added outside the products)."""
    rt = tiny_case("llama", "float", "float32")
    layer = 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64
    assert products_bytes(step_products(rt.weights, rt.plan.model)) == 4 * (2 * layer + 256 * 64)
    biased = tiny_case("llama", "float", "float32", attention_bias=True, mlp_bias=True)
    assert products_bytes(step_products(biased.weights, biased.plan.model)) == 4 * (2 * (layer + 64 + 2 * 32 + 2 * 128) + 256 * 64)


def test_step_products_refuse_moe_and_mismatched_layers():
    moe = ModelConfig.from_hf(tiny_hf_model("mixtral").config)
    with pytest.raises(UnsupportedModelError, match="model_type='mixtral' has 4 experts"):
        step_products({"layers": []}, moe)
    rt = tiny_case("llama", "float", "float32")
    with pytest.raises(ValueError, match="the weights hold 1 layers, the config 2"):
        step_products({**rt.weights, "layers": rt.weights["layers"][:1]}, rt.plan.model)


def test_step_bound_cli_on_a_tiny_gguf(tiny_gguf, capsys):
    """Both formats measured in one round: the table has a row each with a ratio column that is
    step / products; --json's record holds the same figures and the exact byte counts."""
    args = ["bench", "step-bound", "--model", tiny_gguf, "--backend", "eager", "--weight-formats", "float32", "gguf",
            "--rounds", "1", "--prompt-len", "4", "--gen-len", "3"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("| format"))
    assert "| step / products (<= 1.10) |" in header
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in lines if line.startswith(("| float32 ", "| gguf "))}
    assert set(rows) == {"float32", "gguf"}
    for cells in rows.values():
        assert float(cells[1]) > 0 and float(cells[2]) > 0 and re.fullmatch(r"\d+\.\d{3}x( \(over\))?", cells[4])
    assert main([*args[:7], "float32", "--rounds", "1", "--prompt-len", "4", "--gen-len", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (row,) = data["formats"]
    assert row["format"] == "float32" and row["products"] == 9 and row["ratio"] == pytest.approx(row["step_ms"] / row["products_ms"])
    assert row["ops"] == {"neuronfx::small_gemm_multi": 2, "neuronfx::small_gemm": 5, "neuronfx::small_glu": 2}
    layer = 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64
    assert row["products_bytes"] == 4 * (2 * layer + 256 * 64)
    assert row["step_bytes"] == row["products_bytes"] + 4 * (2 * 2 * 64 + 64 + 64)  # norms, final norm, one embedding row


@pytest.mark.parametrize("args, error, names", [
    (["--weight-formats", "float32", "fp16"], "InputError",
     "--weight-formats has 'fp16'; the formats are float32, bfloat16, int8, int4, gguf."),
    (["--weight-formats", "gguf", "--model", "/nonexistent"], "ConfigError", "is not a .gguf file"),
    (["--weight-formats", "gguf", "--activation-format", "int8", "--backend", "eager"], "ConfigError", "backend='eager'"),
    (["--rounds", "0"], "InputError", "--rounds has [0]"),
])
def test_step_bound_checks_options_before_loading(args, error, names, capsys):
    assert main(["bench", "step-bound", "--model", "/nonexistent.gguf", *args]) == 2  # loading would be a CheckpointError
    err = capsys.readouterr().err
    assert f"error: {error}:" in err and names in err
