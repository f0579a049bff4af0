"""``neuronfx bench artifacts``: compile against the compile cache against a saved runtime, each
phase in its own fresh process with an empty torch inductor cache (TORCHINDUCTOR_CACHE_DIR), so
nothing is warm but what the neuronfx compile cache or the saved runtime carries.

Phases: ``compile`` (cold: an empty neuronfx cache, which it fills) then ``save``; ``cached``
(compile of the same plan, same neuronfx cache: a hit); ``load`` (``neuronfx.load`` of the saved
directory). cached and load run --repeat times, alternating, and the fastest run is reported
(on a shared machine the least disturbed run is the figure). Each generates 16 greedy tokens of
one 20-token prompt with their top-5 raw logprobs; the report says whether tokens and logprobs
are identical across the phases."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

import neuronfx
from neuronfx.bench.options import add_engine, add_model, check_at_least, logger
from neuronfx.bench.types import Benchmark
from neuronfx.errors import NeuronfxError
from neuronfx.io import checkpoints


def phase(mode: str, model: str, backend: str, dtype: str, out: str) -> dict[str, Any]:
    """One phase, run by :func:`child` in a fresh process: compile (and save to ``out``), a
    cached compile, or a load of ``out``; then 16 greedy tokens with their top-5 logprobs.
    Seconds of the compile or load, of the save, the tokens, logprobs and cache key."""
    save_s = 0.0
    t0 = time.perf_counter()
    if mode == "load":
        rt = neuronfx.load(out)
    else:
        ckpt = checkpoints.load_checkpoint(model, dtype=getattr(torch, dtype))
        t0 = time.perf_counter()
        rt = neuronfx.compile(neuronfx.make_plan(ckpt.config, neuronfx.InferenceConfig(backend=backend, dtype=dtype)), ckpt.state_dict,
                              progress=False)
    seconds = time.perf_counter() - t0
    if mode == "compile":
        t0 = time.perf_counter()
        neuronfx.save(rt, out)
        save_s = time.perf_counter() - t0
    prompt = torch.randint(3, rt.plan.model.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0)).tolist()
    res, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompt, max_new_tokens=16,
                               sampling=neuronfx.SamplingParams(logprobs=5, ignore_eos=True))
    logprobs = [[lp.token_id, lp.logprob, list(lp.top_ids), list(lp.top_logprobs)] for lp in res.logprobs[0]]
    return {"seconds": seconds, "save_s": save_s, "tokens": list(res.token_ids[0]), "logprobs": logprobs, "cache_key": rt.cache_key}


CHILD = "import json, sys; from neuronfx.bench.artifacts import phase; print(json.dumps(phase(*sys.argv[1:])))"
"""The command of a phase's fresh process (``python -c CHILD MODE MODEL BACKEND DTYPE OUT``)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --backend, --dtype and --repeat."""
    add_model(p)
    add_engine(p, backend="inductor")
    p.add_argument("--repeat", type=int, default=2, help="runs of the cached-compile and load phases (the fastest is reported)")


def child(mode: str, args: argparse.Namespace, out: str, cache: str) -> dict[str, Any]:
    """Run one phase in a fresh process with an empty inductor cache; NeuronfxError with its
    stderr's tail when it fails."""
    inductor = tempfile.mkdtemp(prefix="inductor-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor, NEURONFX_CACHE_DIR=cache, HF_HUB_OFFLINE="1")
    model = str(args.model or checkpoints.default_model_path())
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, mode, model, args.backend, args.dtype, out], env=env,
                              capture_output=True, text=True)
    finally:
        shutil.rmtree(inductor, ignore_errors=True)
    if done.returncode:
        raise NeuronfxError(f"the {mode} phase failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The phases of the module docstring in fresh processes; the figures (seconds)."""
    check_at_least("repeat", args.repeat, 1)
    out, cache = tempfile.mkdtemp(prefix="neuronfx-artifact-"), tempfile.mkdtemp(prefix="neuronfx-cache-")
    try:
        built = child("compile", args, out, cache)
        runs = [child(mode, args, out, cache) for _ in range(args.repeat) for mode in ("cached", "load")]
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    cached, loaded = min(runs[0::2], key=lambda r: r["seconds"]), min(runs[1::2], key=lambda r: r["seconds"])
    same = all(r["tokens"] == built["tokens"] and r["logprobs"] == built["logprobs"] for r in runs)
    logger(args)(f"{args.backend} {args.dtype}: compile {built['seconds']:.1f} s (cold: empty caches, fresh process); cached "
                 f"compile {cached['seconds']:.1f} s (x{built['seconds'] / cached['seconds']:.1f}); save {built['save_s']:.1f} s; "
                 f"load {loaded['seconds']:.1f} s (fresh process, x{built['seconds'] / loaded['seconds']:.1f}); tokens and top-5 "
                 f"logprobs identical: {same}")
    return {"compile_s": built["seconds"], "cached_compile_s": cached["seconds"], "save_s": built["save_s"],
            "load_s": loaded["seconds"], "cached_runs_s": [r["seconds"] for r in runs[0::2]],
            "load_runs_s": [r["seconds"] for r in runs[1::2]], "identical": same, "tokens": built["tokens"],
            "cache_hit": all(r["cache_key"] == built["cache_key"] for r in runs[0::2])}


BENCHMARK = Benchmark(name="artifacts", help="cold compile against a compile-cache hit against loading a saved runtime, each in "
                      "a fresh process", description=__doc__, add_arguments=add_arguments, run=run)
