"""Decode with inductor's C++ wrapper (what CPU plans compile with) against its Python wrapper,
in one run: the same plan compiled twice, the second with ``cpp_wrapper`` off.

    PYTHONPATH=. .venv/bin/python scripts/bench_cpp_wrapper.py [--weight-format gguf]
        [--batch-sizes 1 8] [--rounds 10]

Per batch size: two runtimes of SmolLM2 (inductor, fp32 activations, prompt 128, 48 new tokens),
each round runs both, the order alternating (second place measured up to 5% slower here);
printed: the compile times, whether the greedy tokens are identical, each round's ITL p50, the
medians and the median of the per-round ratios (only same-round ratios compare on this machine).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

import neuronfx
from neuronfx.bench import ab_rounds, bench_plan, format_ab, random_prompts
from neuronfx.graphs import inductor
from neuronfx.io.checkpoints import default_model_path, load_checkpoint
from neuronfx.runtime.steps import DecodeBatch, PrefillBatch, decode_step, prefill_step, release


def compile_with(plan, weights: dict, cpp_wrapper: bool) -> tuple[neuronfx.Runtime, float]:
    """The plan compiled (in a private compile cache) with inductor's C++ or Python wrapper."""
    os.environ["NEURONFX_COMPILE_WORKERS"] = "0"  # a worker process would not see the swapped options
    chosen = inductor.inductor_options
    inductor.inductor_options = lambda plan: chosen(plan) | {"cpp_wrapper": cpp_wrapper}
    try:
        with tempfile.TemporaryDirectory() as cache:
            t0 = time.perf_counter()
            return neuronfx.compile(plan, weights, progress=False, cache=cache), time.perf_counter() - t0
    finally:
        inductor.inductor_options = chosen


def time_neuronfx_tokens(runtime: neuronfx.Runtime, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of 16 steps through the step functions (the same path the timing takes)."""
    state = neuronfx.init_state(runtime)
    slots = list(range(len(prompts)))
    greedy = [neuronfx.SamplingParams()] * len(prompts)
    out, state = prefill_step(runtime, state, PrefillBatch(seq_ids=slots, prompts=prompts, sampling=greedy))
    tokens = [list(out.tokens)]
    for _ in range(15):
        out, state = decode_step(runtime, state, DecodeBatch(seq_ids=slots, input_ids=out.tokens, sampling=greedy))
        tokens.append(list(out.tokens))
    release(runtime, state, slots)
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weight-format", default="gguf", choices=["float", "int8", "int4", "gguf"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    ckpt = load_checkpoint(default_model_path(), dtype=torch.float32, gguf_blocks=args.weight_format == "gguf")
    print(f"SmolLM2-135M, weights {args.weight_format}, inductor, {torch.get_num_threads()} threads, prompt 128, 48 new tokens")
    for batch in args.batch_sizes:
        plan = bench_plan(ckpt, "inductor", "float32", batch, 128, 48, weight_format=args.weight_format)
        runtimes = {}
        for name in ("cpp", "python"):
            runtimes[name], seconds = compile_with(plan, ckpt.state_dict, name == "cpp")
            print(f"batch {batch} {name:6s} wrapper: compiled {len(plan.graphs)} graphs in {seconds:.1f} s")
        prompts = random_prompts(ckpt.config.vocab_size, batch, 128)
        tokens = {name: time_neuronfx_tokens(rt, prompts) for name, rt in runtimes.items()}
        print(f"batch {batch} greedy tokens identical: {tokens['cpp'] == tokens['python']}")
        itl = ab_rounds(runtimes, prompts, 48, args.rounds)
        print("\n".join(format_ab(f"batch {batch}", itl, "python", "cpp")))


if __name__ == "__main__":
    main()
