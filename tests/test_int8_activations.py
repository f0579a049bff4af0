"""int8 activations with int8 weights (``int8_x.w8a8_linear``: torch's integer GEMM) and the
choice of which products take int8 activations (``kernels/activation_choice.py``).

References: a float64 product of x rounded per row (:func:`int8_x.reference_w8a8_linear`) for
the op, and transformers whose every linear input is rounded the same way (a forward pre-hook)
for a compiled plan, within the 1e-4 of every fp32 comparison with transformers (measured:
4e-7). A value on a rounding boundary could round the other way under another fp32 summation
order; with these seeded inputs none does.
"""

from __future__ import annotations

import json
import tempfile

import pytest
import torch
from helpers import random_prompt, run_steps, tiny_hf_model, tiny_plan, tiny_runtime

import neuronfx
from neuronfx.config.quantization import quantized_formats
from neuronfx.graphs.backends import inductor
from neuronfx.graphs.kernels import activation_choice as choice
from neuronfx.graphs.kernels import library
from neuronfx.graphs.kernels.bundles import cpu_kernel_ops
from neuronfx.graphs.models import int8_x, quant
from neuronfx.io.cache_key import cache_key
from neuronfx.io.weights import convert_hf_state_dict, dequantized_state_dict

PROMPTS = [random_prompt(11, seed=3), random_prompt(5, seed=4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 3, 5), (5, 577, 65), (130, 64, 33)])
def test_w8a8_linear_matches_its_reference(dtype, m, k, n):
    g = torch.Generator().manual_seed(m * k + n)
    x = (torch.randn(2, m, k, generator=g) * 3).to(dtype)
    q = quant.quantize_int8(torch.randn(n, k, generator=g))
    bias = torch.randn(n, generator=g)
    got = int8_x.w8a8_linear(x, q, bias)
    assert got.shape == (2, m, n) and got.dtype == dtype
    want = int8_x.reference_w8a8_linear(x, q) + bias.double()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7  # bf16: the output's rounding
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    # against the exact product: x's rounding error is at most absmax / 254 per value of a row
    exact = x.double() @ quant.dequantize(q, k).double().T
    bound = (x.double().abs().amax(-1, keepdim=True) / 254) * quant.dequantize(q, k).double().abs().sum(-1)
    assert ((int8_x.reference_w8a8_linear(x, q) - exact).abs() <= bound + 1e-9).all()


def test_int8_rows_of_a_zero_row_are_zero():
    xq, xs = int8_x.int8_rows(torch.tensor([[0.0, 0.0], [1.0, -0.5]]))
    assert xq.tolist() == [[0, 0], [127, -64]] and xs[0].item() == 0  # -63.5 rounds half to even


def test_decide_keeps_float_unless_int8_wins_by_the_margin():
    times = {("int8", "one"): (1.0, 0.95), ("int8", "prefill"): (1.0, 0.5), ("4bit", "one"): (1.0, 1.2)}
    assert choice.decide(times).enabled == {("int8", "prefill")}
    assert choice.decide(times, margin=1.0).enabled == {("int8", "prefill"), ("int8", "one")}


def test_int8_paths_of_each_format(monkeypatch):
    assert choice.int8_paths("float", 64, 128, 4) == choice.FLOAT_PATHS
    assert choice.int8_paths("int8", 64, 128, 4).enabled == choice.AVAILABLE
    monkeypatch.setattr(choice, "measured_paths", lambda h, i, b: ("measured", h, i, b))
    assert choice.int8_paths("auto", 64, 128, 32) == ("measured", 64, 128, library.SMALL_GEMM_MAX_ROWS)
    with pytest.raises(ValueError, match="activation_format='int4'.*'auto'"):
        choice.int8_paths("int4", 64, 128, 4)


def test_measured_paths_are_kept_per_machine(tmp_path, monkeypatch):
    """The first call measures (every available path, float and int8 timed) and writes the
    verdict; the next reads it without measuring; an edited file is what is used."""
    if not library.small_gemm_available():
        pytest.fail("the neuronfx kernels did not build on this machine (see the warning above)")
    first = choice.measured_paths(64, 128, 4, root=tmp_path)
    (path,) = tmp_path.glob("neuronfx_int8x_*.json")
    kept = json.loads(path.read_text())
    assert set(kept["seconds"]) == {f"{k}/{r}" for k, r in choice.AVAILABLE}
    assert all(t > 0 for pair in kept["seconds"].values() for t in pair)
    assert first == choice.decide({tuple(p.split("/")): tuple(t) for p, t in kept["seconds"].items()})
    monkeypatch.setattr(choice, "measure", lambda *a: pytest.fail("measured again"))
    assert choice.measured_paths(64, 128, 4, root=tmp_path) == first
    path.write_text(json.dumps({"enabled": [["int8", "prefill"], ["fp8", "prefill"]]}))  # not a path: dropped
    assert choice.measured_paths(64, 128, 4, root=tmp_path).enabled == {("int8", "prefill")}
    assert choice.cache_file(64, 128, 4, tmp_path) != choice.cache_file(64, 256, 4, tmp_path)


def test_verdicts_are_kept_under_torch_extensions_dir(tmp_path, monkeypatch):
    """The kernel library builds under ``$TORCH_EXTENSIONS_DIR`` where set; the verdicts are kept
    beside it, not in ``~/.cache`` (which may be read-only: then every process measured again)."""
    from neuronfx.graphs.kernels import gemm_choice

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert choice.cache_file(64, 128, 4).parent == tmp_path
    assert gemm_choice.cache_file("bfloat16").parent == tmp_path


def test_a_verdict_that_cannot_be_written_is_measured_once_per_process(tmp_path, monkeypatch):
    """Where the verdict file cannot be written (a read-only cache directory), the compile's
    many asks (the cache key, then each graph) measure once and all get the same verdict."""
    if not library.small_gemm_available():
        pytest.fail("the neuronfx kernels did not build on this machine (see the warning above)")
    calls = []
    monkeypatch.setattr(choice, "write_verdict", lambda path, data: False)
    monkeypatch.setattr(choice, "measure", lambda *a: calls.append(a) or {("int8", "prefill"): (1.0, 0.5)})
    first = choice.measured_paths(64, 128, 4, root=tmp_path)
    assert first.enabled == {("int8", "prefill")}
    assert choice.measured_paths(64, 128, 4, root=tmp_path) == first and len(calls) == 1
    assert not list(tmp_path.iterdir())


def test_ops_bundle_routes_each_path():
    """Only the enabled paths take int8 activations: here int8 weights at prefill rows."""
    g = torch.Generator().manual_seed(2)
    q = quant.quantize_int8(torch.randn(40, 96, generator=g))
    q4 = quant.quantize_int4(torch.randn(40, 96, generator=g), 32)
    decode, prefill = torch.randn(2, 96, generator=g), torch.randn(12, 96, generator=g)
    ops = cpu_kernel_ops("float32", choice.Int8Paths(frozenset({("int8", "prefill")})))
    assert "int8_activations=int8/prefill" in ops.name
    assert torch.equal(ops.linear(prefill, q), int8_x.w8a8_linear(prefill, q))
    assert torch.equal(ops.glu(prefill, q, q), torch.nn.functional.silu(int8_x.w8a8_linear(prefill, q)) * int8_x.w8a8_linear(prefill, q))
    torch.testing.assert_close(ops.linear(decode, q), decode @ quant.dequantize(q, 96).T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.linear(prefill, q4), prefill @ quant.dequantize(q4, 96).T, rtol=1e-5, atol=1e-4)
    every = cpu_kernel_ops("float32", choice.ALL_PATHS)
    both = every.projections(decode, [q, q], [None, torch.ones(40)])
    assert torch.equal(both[1], int8_x.w8a8_linear(decode, q, torch.ones(40)))
    # the LM head keeps float x for int8 weights (its input's rounding lands on every logit); 4-bit heads keep their paths
    assert torch.equal(every.head_linear(decode, q), library.quant_gemm(decode, q))
    assert torch.equal(every.head_linear(decode, q4), library.quant_gemm(decode, q4, None, True))


def test_packed_int8_weights_take_int8_x_at_every_row_count():
    """A packed int8 weight multiplies int8 x through ``w8a8_packed`` whatever the paths say
    (packing is decided once for the plan), the bits of ``int8_x.w8a8_linear`` on the row-major
    weight; Q/K/V and gate/up of packed weights in one call each."""
    g = torch.Generator().manual_seed(3)
    q = quant.quantize_int8(torch.randn(48, 96, generator=g))
    p = quant.pack_int8(q)
    ops = cpu_kernel_ops("float32", choice.FLOAT_PATHS)
    for rows in (1, 4, 12, 70):  # 70: above PACKED_KERNEL_MAX_ROWS, torch's integer GEMM on the rows kept
        x = torch.randn(rows, 96, generator=g)
        assert torch.equal(ops.linear(x, p), int8_x.w8a8_linear(x, q))
        want = torch.nn.functional.silu(int8_x.w8a8_linear(x, q)) * int8_x.w8a8_linear(x, q)
        torch.testing.assert_close(ops.glu(x, p, p), want, rtol=1e-5, atol=1e-6)  # one call: its own exp
        assert torch.equal(ops.projections(x, [p, p], [None, torch.ones(48)])[1], int8_x.w8a8_linear(x, q, torch.ones(48)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [36, 96, 1540])  # vector lanes then a tail of 4; whole vectors; 1540 = 96 x 16 + 4
def test_packed_rows_round_as_torch_at_every_special_value(dtype, k):
    """``w8a8_packed`` rounds each row with its vectorised absolute maximum (``csrc/w8a8_gemm.cpp``
    ``abs_max``): NaN in the vector lanes or the scalar tail, -0, all-zero rows and a maximum in
    the tail give the bits of ``int8_x.w8a8_linear`` (torch's amax and round) row for row. A row
    holding +-inf has an infinite scale: no output of it is finite either way (the kernel's are
    +-inf where torch's NaN casts to int8 give NaN), and the step reports the row not finite."""
    g = torch.Generator().manual_seed(k)
    q = quant.quantize_int8(torch.randn(32, k, generator=g))
    x = torch.randn(8, k, generator=g) * 5
    x[1, 3] = float("nan")  # a vector lane
    x[2, k - 1] = float("nan")  # the tail (k = 96: the last vector)
    x[3, 10], x[3, k - 2] = float("inf"), float("-inf")
    x[4] = 0.0
    x[5] = -0.0
    x[6, k - 3] = 1e4  # the maximum in the tail
    x = x.to(dtype)
    ops = cpu_kernel_ops("float32", choice.FLOAT_PATHS)  # a packed weight takes w8a8_packed whatever the paths
    got, want = ops.linear(x, quant.pack_int8(q)), int8_x.w8a8_linear(x, q)
    rows = [0, 1, 2, 4, 5, 6, 7]
    assert torch.equal(got[rows].isnan(), want[rows].isnan()) and torch.equal(got[rows].nan_to_num(), want[rows].nan_to_num())
    assert got[[1, 2]].isnan().all() and (got[[4, 5]] == 0).all() and not got[3].isfinite().any() and not want[3].isfinite().any()


def test_plans_pack_weights_only_where_every_product_takes_int8_x(monkeypatch):
    """Packing needs int8 x at the plan's decode rows and at prefill rows; the LM head is packed with
    the layers, the tied embedding's lookup keeps the row-major values (the packed head's rows are
    the same tensor); float weights and other formats are left alone."""
    hf = tiny_hf_model("llama", seed=7, tie_word_embeddings=True)
    float_x = tiny_plan(hf, "inductor", weight_format="int8", activation_format="float")
    weights = convert_hf_state_dict(hf.state_dict(), float_x.model, "float32", float_x.shard, quantized_formats(float_x.inference))
    assert choice.pack_weights(float_x, weights) is weights and isinstance(weights["layers"][0]["wq"], quant.Int8Weight)
    for batch, enabled, packs in [(1, {("int8", "one"), ("int8", "prefill")}, True), (1, {("int8", "one"), ("int8", "batch")}, False),
                                  (1, {("int8", "batch"), ("int8", "prefill")}, False), (2, {("int8", "batch"), ("int8", "prefill")}, True),
                                  (2, choice.AVAILABLE, True)]:
        monkeypatch.setattr(choice, "measured_paths", lambda h, i, b, e=enabled: choice.Int8Paths(frozenset(e)))
        plan = tiny_plan(hf, "inductor", weight_format="int8", activation_format="auto", batch_size=batch)
        packed = choice.pack_weights(plan, weights)
        assert all(isinstance(w, quant.Int8Packed if packs else quant.Int8Weight) for w in packed["layers"][1].values()
                   if isinstance(w, quant.QUANTIZED_TYPES)), enabled
        assert packed["embed"] is weights["embed"] and isinstance(packed["embed"], quant.Int8Weight)
        assert isinstance(packed["lm_head"], quant.Int8Packed if packs else quant.Int8Weight)
        assert not packs or packed["lm_head"].rows is weights["embed"].data
        assert torch.equal(packed["layers"][1]["mlp_norm"], weights["layers"][1]["mlp_norm"])


def round_linear_inputs(model: torch.nn.Module) -> None:
    """Every nn.Linear of ``model`` (the LM head too) multiplies x rounded per row as
    :func:`int8_x.int8_rows`."""
    def hook(module, args):
        xq, xs = int8_x.int8_rows(args[0])
        return ((xq.float() * xs).reshape(args[0].shape).to(args[0].dtype),)

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(hook)


def assert_matches(ref: torch.nn.Module, tokens: list, logits: list, plain: torch.nn.Module | None = None) -> float:
    """Each step's logits of ``PROMPTS`` within 1e-4 of ``ref``'s on the same ids (the plan's
    greedy tokens appended) and each token ``ref``'s argmax; returns how far ``plain``'s logits
    (unrounded x) sit from ``ref``'s at most (0 without ``plain``)."""
    moved = 0.0
    with torch.no_grad():
        for row, prompt in enumerate(PROMPTS):
            ids = list(prompt)
            for got_token, got in zip(tokens[row], logits[row]):
                want = ref(torch.tensor([ids])).logits[0, -1]
                torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
                assert got_token == int(want.argmax())
                if plain is not None:
                    moved = max(moved, (plain(torch.tensor([ids])).logits[0, -1] - want).abs().max().item())
                ids.append(got_token)
    return moved


def test_inductor_int8_weights_with_int8_activations_match_rounded_transformers():
    """A compiled plan of int8 weights with ``activation_format="int8"`` (prefill and decode
    through the integer GEMM, the int8 head packed too) gives the greedy tokens and logits of
    transformers on the same weights with every linear input rounded per row; and differs from
    float x."""
    hf = tiny_hf_model("llama", seed=7, tie_word_embeddings=True)
    rt = tiny_runtime(hf, "inductor", weight_format="int8", activation_format="int8", batch_size=2, max_context_length=16,
                      prefill_buckets=(16,), decode_buckets=(64,))
    ref = tiny_hf_model("llama", seed=7, tie_word_embeddings=True)
    ref.load_state_dict(dequantized_state_dict(hf.state_dict(), rt.weights, rt.plan.model), strict=False)
    plain = tiny_hf_model("llama", seed=7, tie_word_embeddings=True)
    plain.load_state_dict(ref.state_dict())
    round_linear_inputs(ref)
    assert isinstance(rt.weights["layers"][0]["gate"], quant.Int8Packed)  # int8 x everywhere: packed for vpdpbusd
    assert isinstance(rt.weights["lm_head"], quant.Int8Packed) and isinstance(rt.weights["embed"], quant.Int8Weight)
    tokens, logits, _, _ = run_steps(rt, neuronfx.init_state(rt), [0, 1], PROMPTS, 6)
    moved = assert_matches(ref, tokens, logits, plain)
    assert moved > 2e-3  # the rounding is real: float x moves logits by 20x the tolerance (4.5e-3 measured)
    with tempfile.TemporaryDirectory() as d:  # saved and loaded: the packed head's rows stay the embedding's tensor
        neuronfx.save(rt, d)
        loaded = neuronfx.load(d)
        assert loaded.weights["lm_head"].rows is loaded.weights["embed"].data
        assert run_steps(loaded, neuronfx.init_state(loaded), [0, 1], PROMPTS, 6)[0] == tokens


def test_auto_keeps_float_x_for_4bit_weights_that_do_not_pack(monkeypatch):
    """"auto" measures the packed 4-bit kernel: a plan whose 4-bit weights pack (GGUF blocks, int4
    in groups of 32, int8 x at its decode rows and at prefill) keeps the 4-bit paths; int4 in
    groups of 64, or a verdict without prefill, drops them (quant_gemm's int8 x was never timed);
    "int8" keeps them all."""
    hf = tiny_hf_model("llama", seed=7)
    every = choice.Int8Paths(choice.AVAILABLE)
    monkeypatch.setattr(choice, "measured_paths", lambda h, i, b: every)
    assert choice.plan_int8_paths(tiny_plan(hf, "inductor", weight_format="int4", weight_group_size=32, activation_format="auto")) == every
    g64 = choice.plan_int8_paths(tiny_plan(hf, "inductor", weight_format="int4", weight_group_size=64, activation_format="auto"))
    assert g64 == every.without("4bit")
    assert choice.plan_int8_paths(tiny_plan(hf, "inductor", weight_format="int4", weight_group_size=64, activation_format="int8")) == every
    no_prefill = choice.Int8Paths(frozenset({("4bit", "one"), ("4bit", "batch"), ("int8", "prefill")}))
    monkeypatch.setattr(choice, "measured_paths", lambda h, i, b: no_prefill)
    plan = tiny_plan(hf, "inductor", weight_format="int4", weight_group_size=32, activation_format="auto")
    assert choice.plan_int8_paths(plan).enabled == {("int8", "prefill")}


def test_auto_is_a_backend_choice_in_the_compile_cache_key(monkeypatch):
    hf = tiny_hf_model("llama", seed=7)
    plan = tiny_plan(hf, "inductor", weight_format="int8", activation_format="auto")
    monkeypatch.setattr(choice, "measured_paths", lambda h, i, b: choice.Int8Paths(frozenset({("int8", "prefill")})))
    assert inductor.choices(plan)["int8_activations"] == "int8/prefill"
    assert "int8_activations" not in inductor.choices(tiny_plan(hf, "inductor", weight_format="int8", activation_format="int8"))
    # graphs built with the kernel library link its C shims: not served to a process without it
    assert inductor.choices(plan)["kernels"] is True and "kernels" not in inductor.choices(tiny_plan(hf, "inductor", device="cuda"))
    monkeypatch.setattr(inductor, "small_gemm_available", lambda: False)  # (the real one is cached per process)
    without_kernels = cache_key(plan)
    assert inductor.choices(plan)["kernels"] is False
    monkeypatch.undo()
    monkeypatch.setattr(choice, "measured_paths", lambda h, i, b: choice.Int8Paths(frozenset({("int8", "prefill")})))
    key = cache_key(plan)
    assert key != without_kernels
    monkeypatch.setattr(choice, "measured_paths", lambda h, i, b: choice.FLOAT_PATHS)
    assert cache_key(plan) != key  # a runtime compiled for other paths is not reused


def test_inductor_int4_weights_with_int8_activations_match_rounded_transformers():
    """A compiled int4 plan (groups of 32) with ``activation_format="int8"``: the layers' 4-bit
    weights packed for ``vpdpbusd`` (prefill and decode through ``w4a8_packed``, x rounded per 32
    values), the int8 LM head packed too (x rounded per row): the greedy tokens and logits of
    transformers on the same dequantized weights with those roundings; saved and loaded, the
    same tokens. (Per-32 rounding makes more rounding decisions than per-row: with seeds 9 and
    10 one x value of one step sat on a boundary and rounded the other way, 1-2e-3 on the logits;
    the seed here has none, as the module docstring says.)"""
    hf = tiny_hf_model("llama", seed=11, tie_word_embeddings=False)
    rt = tiny_runtime(hf, "inductor", weight_format="int4", weight_group_size=32, activation_format="int8", batch_size=2,
                      max_context_length=16, prefill_buckets=(16,), decode_buckets=(64,))
    assert all(isinstance(rt.weights["layers"][0][k], quant.Int4Packed) for k in ("wq", "wk", "wv", "wo", "gate", "up", "down"))
    assert isinstance(rt.weights["lm_head"], quant.Int8Packed)
    ref = tiny_hf_model("llama", seed=11, tie_word_embeddings=False)
    ref.load_state_dict(dequantized_state_dict(hf.state_dict(), rt.weights, rt.plan.model), strict=False)

    def round_groups(module, args):  # the layers' 4-bit products round x per 32 values
        xq, xs = int8_x.int8_groups(args[0])
        return ((xq.float() * xs[..., None]).reshape(args[0].shape),)

    for name, module in ref.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.register_forward_pre_hook(round_groups)
    round_linear_inputs(ref.lm_head)  # the packed int8 head rounds per row
    tokens, logits, _, _ = run_steps(rt, neuronfx.init_state(rt), [0, 1], PROMPTS, 6)
    assert_matches(ref, tokens, logits)
    with tempfile.TemporaryDirectory() as d:
        neuronfx.save(rt, d)
        loaded = neuronfx.load(d)
        assert isinstance(loaded.weights["layers"][1]["down"], quant.Int4Packed)
        assert run_steps(loaded, neuronfx.init_state(loaded), [0, 1], PROMPTS, 6)[0] == tokens
