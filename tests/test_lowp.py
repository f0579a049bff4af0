"""16-bit weights: the streaming GEMV kernel choice and bf16/fp16 graphs against transformers.

Tolerances: bf16 keeps 8 mantissa bits, so one rounding of a value v errs by up to |v| * 2**-8;
the graphs round activations after every op, so logits are compared against an fp32 reference
on the same rounded weights with an absolute bound sized for the tiny models' logits (|l| < 2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import hf_last_logits, random_prompt, run_steps, tiny_hf_model, tiny_runtime

import neuronfx
from neuronfx.graphs.kernels.bundles import REFERENCE_OPS, cpu_linear, gemv


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_fp32_linear_rounded_once(dtype, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 96, generator=g).to(dtype)
    w = torch.randn(40, 96, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype) if bias else None
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    out = gemv(x, w, b)
    assert out.shape == (1, 1, 40) and out.dtype == dtype
    # fp32 sums in another order differ by ~1e-6 relative; then one rounding to ``dtype``.
    eps = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 1e-6}[dtype]
    assert torch.allclose(out.float(), ref, rtol=eps, atol=1e-5)


def test_cpu_linear_uses_gemv_for_a_single_16bit_row_without_kernels():
    # The reference ops (eager, export) are F.linear whatever the shape: the reduction form would
    # materialise an (out, in) fp32 product in eager mode. The CPU bundle without the kernels
    # takes the reduction for one row of 16-bit weights, which inductor turns into one loop.
    x = torch.randn(1, 96).to(torch.bfloat16)
    w = torch.randn(40, 96).to(torch.bfloat16)
    assert torch.equal(REFERENCE_OPS.linear(x, w, None), F.linear(x, w))
    compiled = torch.compile(lambda x, w: cpu_linear(x, w, kernels=False, widen=True), fullgraph=True, dynamic=False)
    assert torch.allclose(compiled(x, w).float(), gemv(x, w).float(), rtol=2**-8, atol=1e-5)


BF16_LOGIT_BOUND = 0.06
"""Max |logit error| of a bf16 run against fp32 on the same (bf16-rounded) weights."""


@pytest.fixture(scope="module")
def hf_bf16_ref():
    """A tiny qwen2 (q/k/v biases cover the bias path) whose fp32 weights are bf16-rounded."""
    hf = tiny_hf_model("qwen2", seed=11)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return hf


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_bf16_batch1_decode_logits_track_fp32_reference(hf_bf16_ref, backend):
    # batch_size=1 is the plan where compiled decode streams the weights once per row; one
    # bucket per phase keeps the compile to 2 graphs.
    rt = tiny_runtime(hf_bf16_ref, backend, batch_size=1, dtype="bfloat16", prefill_buckets=(32,), decode_buckets=(64,))
    prompt = random_prompt(11, seed=5)
    tokens, logits, _, _ = run_steps(rt, neuronfx.init_state(rt), [0], [prompt], 8)
    for i in range(8):
        ref = hf_last_logits(hf_bf16_ref, prompt + tokens[0][:i])
        err = (logits[0][i] - ref).abs().max().item()
        assert err < BF16_LOGIT_BOUND, f"step {i}: max |logit error| {err:.4f}"
    # Greedy tokens are the reference's argmax wherever its top-2 margin exceeds the error bound.
    for i in range(8):
        ref = hf_last_logits(hf_bf16_ref, prompt + tokens[0][:i])
        top2 = ref.topk(2).values
        if (top2[0] - top2[1]).item() > 0.12:
            assert tokens[0][i] == int(ref.argmax())
