"""Decode buckets pay off: one decode step at 100 cached tokens vs at 1000, same runtime.

Usage: .venv/bin/python scripts/bench_decode_buckets.py [--backend inductor] [--dtype float32]
Plan: SmolLM2-135M-Instruct, batch 1, max_context_length 1024, sequence_length 1024, decode
buckets derived (128, 256, 512, 1024). Prints ms/step and the bucket each step ran in.
"""

from __future__ import annotations

import argparse
import time

import neuronfx
from neuronfx.config.dtypes import DTYPES
from neuronfx.config.sampling import SamplingParams
from neuronfx.io.checkpoints import default_model_path, load_checkpoint
from neuronfx.runtime.steps import DecodeBatch, PrefillBatch, decode_step, prefill_step


def step_ms(runtime: neuronfx.Runtime, prompt_len: int, steps: int = 20) -> tuple[float, int]:
    """Median ms of ``steps`` decode steps right after a ``prompt_len``-token prefill, and the bucket."""
    greedy = [SamplingParams()]
    state = neuronfx.init_state(runtime)
    out, state = prefill_step(runtime, state, PrefillBatch(seq_ids=[0], prompts=[[7] * prompt_len], sampling=greedy))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out, state = decode_step(runtime, state, DecodeBatch(seq_ids=[0], input_ids=out.tokens, sampling=greedy))
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3, out.bucket


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    ckpt = load_checkpoint(default_model_path(), dtype=DTYPES[args.dtype])
    inference = neuronfx.InferenceConfig(max_context_length=1024, sequence_length=1024, backend=args.backend, dtype=args.dtype)
    runtime = neuronfx.compile(neuronfx.make_plan(ckpt.config, inference), ckpt.state_dict)
    step_ms(runtime, 50, 3)  # warm-up
    short, b_short = step_ms(runtime, 100)
    long, b_long = step_ms(runtime, 1000)
    print(f"{args.backend} {args.dtype}: decode at ~100 cached tokens: {short:.1f} ms/step (bucket {b_short}); "
          f"at ~1000: {long:.1f} ms/step (bucket {b_long}); ratio {long / short:.2f}")


if __name__ == "__main__":
    main()
