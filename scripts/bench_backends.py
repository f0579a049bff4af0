"""Compile time and greedy decode tok/s of each backend on SmolLM2-135M-Instruct, in one run.

Usage: .venv/bin/python scripts/bench_backends.py [--backends eager export] [--dtype float32]
Prompt: 100 tokens; 64 new tokens; batch 1; the default plan (max_context_length 256,
sequence_length 512). Figures printed per backend; decode tok/s excludes the prefill token.
"""

from __future__ import annotations

import argparse
import time

import neuronfx
from neuronfx.io.checkpoints import default_model_path, load_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", nargs="+", default=["eager", "export"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    t0 = time.perf_counter()
    ckpt = load_checkpoint(default_model_path())
    print(f"load_checkpoint: {time.perf_counter() - t0:.1f} s")
    prompt = [list(range(1, 101))]
    for backend in args.backends:
        inference = neuronfx.InferenceConfig(backend=backend, dtype=args.dtype)
        plan = neuronfx.make_plan(ckpt.config, inference)
        t0 = time.perf_counter()
        runtime = neuronfx.compile(plan, ckpt.state_dict, progress=False)
        compile_s = time.perf_counter() - t0
        state = neuronfx.init_state(runtime)
        _, state = neuronfx.generate(runtime, state, prompt, max_new_tokens=4, eos_token_ids=[])  # warm-up
        result, state = neuronfx.generate(runtime, state, prompt, max_new_tokens=args.new_tokens, eos_token_ids=[])
        per_graph = ", ".join(f"{p}{k}x{b}={s:.1f}s" for (p, b, k), s in runtime.compile_s.items())
        print(
            f"{backend:7s} {args.dtype}: compile {compile_s:.1f} s ({per_graph}); "
            f"prefill(100 tok) {result.prefill_s * 1000:.0f} ms; "
            f"decode {(args.new_tokens - 1) / result.decode_s:.1f} tok/s"
        )


if __name__ == "__main__":
    main()
