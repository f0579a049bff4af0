"""Compile vs compile cache vs saved runtime: SmolLM2-135M, default plan, one backend. Each phase
runs in its own fresh process with an empty torch inductor cache (TORCHINDUCTOR_CACHE_DIR), so
nothing is warm but what the neuronfx compile cache or the artifact carries.

Usage: .venv/bin/python scripts/bench_artifacts.py [--backend inductor|export] [--dtype float32]

Phases: ``compile`` (cold: empty neuronfx cache, fills it) then ``save``; ``cached`` (compile of
the same plan, same neuronfx cache: a hit); ``load`` (neuronfx.load of the saved directory);
cached and load run ``--repeat`` times (default 2) and the fastest run is reported. Each
generates 16 greedy tokens with their top-5 raw logprobs (functions of the logits); prints the
seconds, the ratios and whether tokens and logprobs are identical across the three.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
import neuronfx
from neuronfx.io.checkpoints import default_model_path, load_checkpoint
from neuronfx.config.dtypes import DTYPES
mode, backend, dtype, out = sys.argv[1:5]
prompt = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2]]
save_s = 0.0
if mode in ("compile", "cached"):
    ckpt = load_checkpoint(default_model_path(), dtype=DTYPES[dtype])
    plan = neuronfx.make_plan(ckpt.config, neuronfx.InferenceConfig(backend=backend, dtype=dtype))
    t0 = time.perf_counter(); rt = neuronfx.compile(plan, ckpt.state_dict, progress=False); seconds = time.perf_counter() - t0
    if mode == "compile":
        t0 = time.perf_counter(); neuronfx.save(rt, out); save_s = time.perf_counter() - t0
else:
    t0 = time.perf_counter(); rt = neuronfx.load(out); seconds = time.perf_counter() - t0
res, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompt, max_new_tokens=16,
                           sampling=neuronfx.SamplingParams(logprobs=5))
logprobs = [[lp.token_id, lp.logprob, list(lp.top_ids), list(lp.top_logprobs)] for lp in res.logprobs[0]]
print(json.dumps({"seconds": seconds, "save_s": save_s, "tokens": list(res.token_ids[0]), "logprobs": logprobs,
                  "cache_key": rt.cache_key}))
"""


def child(mode: str, backend: str, dtype: str, out: str, cache: str) -> dict:
    inductor = tempfile.mkdtemp(prefix="inductor-")  # empty torch cache in every process
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor, NEURONFX_CACHE_DIR=cache, HF_HUB_OFFLINE="1")
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, mode, backend, dtype, out], env=env, capture_output=True, text=True)
    finally:
        shutil.rmtree(inductor, ignore_errors=True)
    if done.returncode:
        sys.exit(f"{mode} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=2, help="runs of the cached-compile and load phases (the fastest is reported)")
    args = ap.parse_args()
    out = tempfile.mkdtemp(prefix="neuronfx-artifact-")
    cache = tempfile.mkdtemp(prefix="neuronfx-cache-")
    try:
        built = child("compile", args.backend, args.dtype, out, cache)
        # twice each, alternating: on a shared machine the least disturbed run is the figure
        runs = [child(mode, args.backend, args.dtype, out, cache) for _ in range(args.repeat) for mode in ("cached", "load")]
        cached = min(runs[0::2], key=lambda r: r["seconds"])
        loaded = min(runs[1::2], key=lambda r: r["seconds"])
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    same = all(r["tokens"] == built["tokens"] and r["logprobs"] == built["logprobs"] for r in runs)
    print(f"{args.backend} {args.dtype}: compile {built['seconds']:.1f} s (cold: empty caches, fresh process); "
          f"cached compile {cached['seconds']:.1f} s (x{built['seconds'] / cached['seconds']:.1f}); "
          f"save {built['save_s']:.1f} s; load {loaded['seconds']:.1f} s (fresh process, x{built['seconds'] / loaded['seconds']:.1f}); "
          f"tokens and top-5 logprobs identical: {same}")
    print(json.dumps({"compile_s": built["seconds"], "cached_compile_s": cached["seconds"], "save_s": built["save_s"],
                      "load_s": loaded["seconds"], "cached_runs_s": [r["seconds"] for r in runs[0::2]],
                      "load_runs_s": [r["seconds"] for r in runs[1::2]], "identical": same, "tokens": built["tokens"]}))


if __name__ == "__main__":
    main()
