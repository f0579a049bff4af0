"""Decode with int8 activations in the 4-bit products (``activation_format="int8"``, llama.cpp's
method) against float activations (the default), in one run.

    PYTHONPATH=. .venv/bin/python scripts/bench_int8_activations.py [--weight-format gguf]
        [--batch-sizes 1 8] [--rounds 9]

Per batch size, two runtimes of SmolLM2 (inductor, fp32 plan, prompt 128, 64 new tokens, the
bench's plan), differing only in ``activation_format``, compiled into a temporary compile cache
(every run compiles them: about a minute per batch size); each round runs both, the order
alternating; printed: each round's ITL p50, the medians and the median of the per-round ratios
(this machine's runs move by 10-30%, so only same-round ratios compare), and how many of the
first 16 greedy tokens agree (int8 activations change the numerics).
"""

from __future__ import annotations

import argparse
import tempfile

import torch

import neuronfx
from neuronfx.bench import ab_rounds, bench_plan, format_ab, random_prompts
from neuronfx.graphs import kernels
from neuronfx.io.checkpoints import default_model_path, load_checkpoint


def greedy_tokens(runtime: neuronfx.Runtime, prompts: list[list[int]], steps: int = 16) -> list[list[int]]:
    """Each row's first ``steps`` greedy tokens."""
    result, _ = neuronfx.generate(runtime, neuronfx.init_state(runtime), prompts, max_new_tokens=steps, eos_token_ids=[])
    return [list(t) for t in result.token_ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weight-format", default="gguf", choices=["int4", "gguf"],
                    help="the plans' 4-bit weights: gguf (the file's Q4_1 blocks, default) or int4 (groups of 32)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="one pair of plans each (default: 1 8)")
    ap.add_argument("--rounds", type=int, default=9, help="alternating rounds per batch size (default: 9)")
    args = ap.parse_args()
    ckpt = load_checkpoint(default_model_path(), dtype=torch.float32, gguf_blocks=args.weight_format == "gguf")
    kernels.small_gemm_available()
    print(f"SmolLM2-135M, weights {args.weight_format}, inductor, {torch.get_num_threads()} threads, prompt 128, 64 new tokens; "
          f"float path {kernels.quant_isa()}, int8 path {kernels.quant_int8_x_isa()}")
    for batch in args.batch_sizes:
        runtimes = {}
        with tempfile.TemporaryDirectory() as cache:
            for name in ("float", "int8"):
                plan = bench_plan(ckpt, "inductor", "float32", batch, 128, 64, weight_format=args.weight_format,
                                  activation_format=name)
                runtimes[name] = neuronfx.compile(plan, ckpt.state_dict, progress=False, cache=cache)
        prompts = random_prompts(ckpt.config.vocab_size, batch, 128)
        same = [sum(a == b for a, b in zip(x, y)) for x, y in zip(*(greedy_tokens(rt, prompts) for rt in runtimes.values()))]
        print(f"batch {batch}: greedy tokens equal per row (of 16): {same}")
        itl = ab_rounds(runtimes, prompts, 64, args.rounds)
        print("\n".join(format_ab(f"batch {batch}", itl, "float", "int8")))


if __name__ == "__main__":
    main()
