"""Saved runtime vs compiling: SmolLM2-135M, default plan, one backend; each phase in its own
process with its own empty inductor cache, so nothing is warm but what the artifact carries.

Usage: .venv/bin/python scripts/bench_artifacts.py [--backend export|inductor] [--dtype float32]
Prints compile seconds, save seconds, load seconds (fresh process), the ratio, and whether the
loaded runtime's greedy tokens equal the compiled one's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
import neuronfx
from neuronfx.checkpoints import default_model_path, load_checkpoint
from neuronfx.graphs.weights import DTYPES
mode, backend, dtype, out = sys.argv[1:5]
prompt = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2]]
if mode == "compile":
    ckpt = load_checkpoint(default_model_path(), dtype=DTYPES[dtype])
    plan = neuronfx.make_plan(ckpt.config, neuronfx.InferenceConfig(backend=backend, dtype=dtype))
    t0 = time.perf_counter(); rt = neuronfx.compile(plan, ckpt.state_dict, progress=False); seconds = time.perf_counter() - t0
    t0 = time.perf_counter(); neuronfx.save(rt, out); save_s = time.perf_counter() - t0
else:
    t0 = time.perf_counter(); rt = neuronfx.load(out); seconds = time.perf_counter() - t0; save_s = 0.0
res, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompt, max_new_tokens=16)
print(json.dumps({"seconds": seconds, "save_s": save_s, "tokens": list(res.token_ids[0])}))
"""


def child(mode: str, backend: str, dtype: str, out: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-"))
    done = subprocess.run([sys.executable, "-c", CHILD, mode, backend, dtype, out], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    out = tempfile.mkdtemp(prefix="neuronfx-artifact-")
    built = child("compile", args.backend, args.dtype, out)
    loaded = child("load", args.backend, args.dtype, out)
    print(f"{args.backend} {args.dtype}: compile {built['seconds']:.1f} s (cold cache), save {built['save_s']:.1f} s, "
          f"load {loaded['seconds']:.1f} s in a fresh process -> x{built['seconds'] / loaded['seconds']:.1f}; "
          f"tokens identical: {built['tokens'] == loaded['tokens']}")


if __name__ == "__main__":
    main()
