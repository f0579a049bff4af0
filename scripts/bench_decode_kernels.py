"""Decode with this library's CPU kernels against the path they replaced, in one run: the
``cached_attention`` kernel against inductor's fusion of the same attention as fp32 reductions
(``ops.fused_cached_attention``), and, for quantized weights, Q/K/V and SwiGLU as one
``quant_gemm_multi`` / ``quant_glu`` call each against one ``quant_gemm`` per weight.

    PYTHONPATH=. .venv/bin/python scripts/bench_decode_kernels.py [--weight-format gguf]
        [--batch-sizes 1 8] [--rounds 7]

Per batch size, two runtimes of SmolLM2 (inductor, fp32 activations, prompt 128, 64 new tokens,
the bench's plan), the second built with the replaced path bound in (this script swaps the two
functions of ``graphs/ops.py`` / ``graphs/kernels.py`` that choose them while it compiles; the
library itself has no switch). Each round runs both, first one then the other first; printed: each round's ITL p50,
the medians and the median of the per-round ratios (this machine's runs move by 10-30%, so only
same-round ratios compare).
"""

from __future__ import annotations

import argparse
import tempfile

import torch

import neuronfx
from neuronfx.bench import ab_rounds, bench_plan, format_ab, random_prompts
from neuronfx.config.plan import Plan
from neuronfx.graphs import kernels, ops
from neuronfx.io.checkpoints import default_model_path, load_checkpoint
from neuronfx.runtime.runtime import Runtime


def replaced_path_runtime(plan: Plan, weights: dict, cache: str) -> Runtime:
    """A runtime compiled with the fused-reduction attention and per-weight quantized products."""
    kernel_attention, same_layout = ops.kernel_cached_attention, kernels.same_quant_layout
    ops.kernel_cached_attention, kernels.same_quant_layout = ops.fused_cached_attention, lambda weights: False
    try:
        return neuronfx.compile(plan, weights, progress=False, cache=cache)
    finally:
        ops.kernel_cached_attention, kernels.same_quant_layout = kernel_attention, same_layout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weight-format", default="gguf", choices=["float", "int8", "int4", "gguf"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    ckpt = load_checkpoint(default_model_path(), dtype=torch.float32, gguf_blocks=args.weight_format == "gguf")
    print(f"SmolLM2-135M, weights {args.weight_format}, inductor, {torch.get_num_threads()} threads, prompt 128, 64 new tokens")
    for batch in args.batch_sizes:
        plan = bench_plan(ckpt, "inductor", "float32", batch, 128, 64, weight_format=args.weight_format)
        with tempfile.TemporaryDirectory() as new_cache, tempfile.TemporaryDirectory() as old_cache:
            runtimes = {"kernels": neuronfx.compile(plan, ckpt.state_dict, progress=False, cache=new_cache),
                        "replaced": replaced_path_runtime(plan, ckpt.state_dict, old_cache)}
            prompts = random_prompts(ckpt.config.vocab_size, batch, 128)
            itl = ab_rounds(runtimes, prompts, 64, args.rounds)
        print("\n".join(format_ab(f"batch {batch}", itl, "replaced", "kernels")))


if __name__ == "__main__":
    main()
