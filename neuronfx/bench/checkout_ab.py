"""``neuronfx bench latency --against REF``: decode tok/s of this tree against another checkout
(a git ref or a directory), rounds alternating in one run.

Each side runs in a worker process (``python -c`` :data:`WORKER`, with ``PYTHONPATH`` and the
working directory set to that checkout's root) that loads the checkpoint, compiles one plan per
batch size (the first round fills the compile cache; later rounds load from it) and warms each
up before it reports ready, so neither compile time nor a first call is measured (then it
freezes its heap, as ``neuronfx.frozen_heap`` does, so no full garbage collection lands in a
timed case); then it times one greedy case per request on stdin. Every round starts a fresh pair of workers: one process
per side for the whole run measured where its memory landed as much as its code. The worker uses only the
public API every checkout has (``neuronfx.make_plan``, ``compile``, ``init_state``,
``generate``), so the other side may be any checkout, whatever its command layout. A git ref is
exported with ``git archive`` into a temporary directory (the repository is not touched). The
sides alternate, the first going second in odd rounds (started first too), and each timed case
follows a short untimed one in the same worker; the report gives each side's median round, the
per-round ratios (this / other) and their summary over round pairs run in opposite orders
(``rounds.paired_ratio``; use an even ``--rounds``), and whether both produced the same greedy
tokens."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import attrs

import neuronfx
from neuronfx.bench.latency_run import LatencySpec
from neuronfx.bench.options import Log
from neuronfx.bench.rounds import median, paired_ratio
from neuronfx.errors import InputError, NeuronfxError
from neuronfx.io import checkpoints

WORKER = r'''
import gc, hashlib, json, sys, time
import torch
import neuronfx
try:
    from neuronfx.io.checkpoints import load_checkpoint
except ImportError:  # a checkout from before the io/ package
    from neuronfx.checkpoints import load_checkpoint

def say(obj):
    print("NFXAB " + json.dumps(obj), flush=True)

cfg = json.loads(sys.argv[1])
ckpt = load_checkpoint(cfg["model"], dtype=getattr(torch, cfg["dtype"]), gguf_blocks=cfg["gguf_blocks"])
options = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg["inference"].items()}
runtimes, compile_s = {}, {}
for b in cfg["batch_sizes"]:
    t0 = time.perf_counter()
    plan = neuronfx.make_plan(ckpt.config, neuronfx.InferenceConfig(batch_size=b, batch_buckets=(b,), **options))
    runtimes[b] = neuronfx.compile(plan, ckpt.state_dict, progress=False)
    compile_s[b] = time.perf_counter() - t0

def run(b, p, g, seed):
    ids = torch.randint(3, ckpt.config.vocab_size, (b, p), generator=torch.Generator().manual_seed(seed)).tolist()
    rt = runtimes[b]
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), ids, max_new_tokens=g, sampling=neuronfx.SamplingParams(ignore_eos=True))
    tokens = [list(t) for t in result.token_ids]
    return {"decode_tok_s": (result.num_generated - b) / result.decode_s, "prefill_s": result.prefill_s,
            "tokens_digest": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16], "first_tokens": tokens[0][:8]}

for b in runtimes:
    run(b, 8, 3, 1)  # warm-up: the first calls of a compiled graph are not what a step costs
gc.collect()
gc.freeze()  # as neuronfx.memory.frozen_heap (which an older checkout lacks): no full collection lands in a timed case
say({"neuronfx": neuronfx.__file__, "compile_s": compile_s, "threads": torch.get_num_threads()})
for line in sys.stdin:
    case = json.loads(line)
    say(run(case["batch_size"], case["prompt_len"], case["gen_len"], 0))
'''
"""The worker each side runs (see the module docstring); its protocol lines start with "NFXAB "."""

PROTOCOL = "NFXAB "

REWARM = {"prompt_len": 8, "gen_len": 3}
"""The untimed case each side runs right before each timed one, at the timed case's batch size
(the worker's own warm-up): every graph the timed case calls and every weight it reads touched
just before, on both sides alike."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--against, --against-option and --tolerance (the latency benchmark's A/B mode)."""
    p.add_argument("--against", default=None, metavar="REF|DIR",
                   help="compare decode tok/s with another checkout instead: a git ref of this repository (exported to a "
                        "temporary directory) or a directory holding a neuronfx package; rounds alternate (--rounds, default 5)")
    p.add_argument("--against-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an InferenceConfig option of the other side only, e.g. activation_format=int8 (with --against . : this "
                        "tree against itself with that option); VALUE is JSON or a string; repeatable")
    p.add_argument("--tolerance", type=float, default=0.03, help="with --against: the ratio's distance from 1 the report calls "
                   "within tolerance (default 0.03)")


def check_combination(args: argparse.Namespace) -> dict[str, Any]:
    """--against's options: the other side's InferenceConfig overrides. InputError for options
    the A/B run does not take (--compare, --plot) and for a KEY=VALUE without "="."""
    if args.compare or args.plot:
        raise InputError("--against compares two checkouts of neuronfx; it takes no --compare and no --plot (drop them).")
    overrides = {}
    for item in args.against_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(f"--against-option {item!r} must be KEY=VALUE, e.g. activation_format=int8.")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


@contextmanager
def checkout(other: str) -> Iterator[tuple[Path, str]]:
    """(root of the other checkout, its label): a directory holding ``neuronfx/__init__.py`` as
    it is, else a git ref of this repository exported into a temporary directory (removed after
    the block). InputError for neither."""
    path = Path(other).expanduser()
    if path.is_dir():
        if not (path / "neuronfx" / "__init__.py").is_file():
            raise InputError(f"--against {other!r} is a directory without neuronfx/__init__.py; give a checkout's root or a git ref.")
        yield path.resolve(), str(path)
        return
    repo = this_root()
    found = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{other}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise InputError(f"--against {other!r} names no directory and no commit of {repo}; give a git ref (main, HEAD~1, a hash) "
                         "or a checkout's directory.")
    commit = found.stdout.strip()
    archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit, "neuronfx"], capture_output=True, check=True)
    with tempfile.TemporaryDirectory(prefix="neuronfx-against-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        yield Path(tmp).resolve(), f"{other} ({commit[:10]})"


def this_root() -> Path:
    """The directory holding the neuronfx package this process runs."""
    return Path(neuronfx.__file__).resolve().parents[1]


@attrs.frozen(kw_only=True, eq=False)
class Worker:
    """One side's worker process and what it reported when ready."""

    label: str
    root: Path
    process: subprocess.Popen
    stderr: TextIO  # a temporary file: the worker's log, shown when it fails
    ready: dict[str, Any]


def worker_config(args: argparse.Namespace, spec: LatencySpec, overrides: dict[str, Any]) -> dict[str, Any]:
    """The JSON the worker reads: checkpoint, batch sizes and the plan options (as bench_plan's)."""
    longest, most = max(spec.prompt_lens), max(spec.gen_lens)
    inference = {"max_context_length": max(256, longest), "sequence_length": max(512, longest + most), "dtype": spec.dtype,
                 "backend": spec.backend, "weight_format": spec.weight_format, "weight_group_size": spec.weight_group_size,
                 "activation_format": spec.activation_format, "device": spec.device}
    if spec.kv_cache_dtype != "auto":  # only when given: a checkout older than the option would reject the key
        inference["kv_cache_dtype"] = spec.kv_cache_dtype
    return {"model": str(args.model or checkpoints.default_model_path()), "dtype": spec.dtype,
            "gguf_blocks": spec.weight_format == "gguf", "batch_sizes": list(spec.batch_sizes), "inference": inference | overrides}


@contextmanager
def start_worker(label: str, root: Path, config: dict[str, Any]) -> Iterator[Worker]:
    """Start the worker of the checkout at ``root`` and wait until it is compiled and warm;
    stopped when the block ends. NeuronfxError when it fails or imports another neuronfx."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with tempfile.TemporaryFile("w+") as stderr:
        # cwd = root: `python -c` puts the working directory first on sys.path
        process = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(config)], cwd=root, env=env, text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
        try:
            worker = Worker(label=label, root=root, process=process, stderr=stderr, ready={})
            worker = attrs.evolve(worker, ready=receive(worker))
            if not Path(worker.ready["neuronfx"]).resolve().is_relative_to(root):
                raise NeuronfxError(f"the {label} worker imported {worker.ready['neuronfx']}, not the checkout at {root}; unset "
                                    "what puts another neuronfx first on its path (a .pth file?).")
            yield worker
        finally:
            process.stdin.close()
            process.kill()
            process.wait()


def receive(worker: Worker) -> dict[str, Any]:
    """The worker's next protocol line; NeuronfxError with its log's tail when it exits first."""
    for line in worker.process.stdout:
        if line.startswith(PROTOCOL):
            return json.loads(line[len(PROTOCOL):])
    worker.process.wait()
    worker.stderr.seek(0)
    raise NeuronfxError(f"the {worker.label} worker (neuronfx at {worker.root}) exited with {worker.process.returncode}; its "
                        f"log ends:\n{worker.stderr.read()[-3000:]}")


def one_round(worker: Worker, case: dict[str, int]) -> dict[str, Any]:
    """One timed greedy case in ``worker``: decode tok/s, prefill seconds, a digest of the tokens."""
    worker.process.stdin.write(json.dumps(case) + "\n")
    worker.process.stdin.flush()
    return receive(worker)


def run_against(args: argparse.Namespace, spec: LatencySpec, log: Log) -> dict[str, Any]:
    """Measure every case on both sides in ``spec.rounds`` alternating rounds, each round in a
    fresh pair of workers (:func:`worker_round`); returns JSON-able ``{"this", "other",
    "rounds", "tolerance", "cases": [one row per case]}``. Raises InputError for a bad --against
    and NeuronfxError when a worker fails."""
    overrides = check_combination(args)
    cases = ab_cases(spec)
    with checkout(args.against) as (root, label):
        log(f"this tree ({this_root()}) against {label}: {spec.rounds} rounds, each in a fresh worker process per side "
            "(the first compiles both sides) ...")
        sides = {"this": (this_root(), worker_config(args, spec, {})), label: (root, worker_config(args, spec, overrides))}
        timed: list[dict[str, list[dict[str, Any]]]] = [{"this": [], "other": []} for _ in cases]
        ready: dict[str, dict[str, Any]] = {}
        for i in range(spec.rounds):
            order = ["this", label] if i % 2 == 0 else [label, "this"]
            reports = worker_round(sides, order, cases, timed)
            ready = ready or reports  # the first round's: it compiled
        rows = [case_row(case, t, args.tolerance) for case, t in zip(cases, timed)]
        for row in rows:
            log(format_case(row))
        return {"this": {"root": str(this_root()), **ready["this"]}, "other": {"label": label, "root": str(root), **ready[label]},
                "overrides": overrides, "rounds": spec.rounds, "tolerance": args.tolerance, "cases": rows}


def worker_round(sides: dict[str, tuple[Path, dict[str, Any]]], order: list[str], cases: list[dict[str, int]],
                 timed: list[dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """One round: start a worker per side (both alive while either measures), run every case
    on each side in ``order``, append the results to ``timed`` (per case, "this" and "other"),
    stop both; returns each side's ready report. A fresh process per round because where a
    process's weights land in memory moves its decode speed by several percent on a small
    machine (one process per side measured 0.905-1.034x of the same tree against itself). Each
    timed case runs right after a short untimed one in the same worker (:data:`REWARM`): a worker
    that had idled while the other ran measured slower, so whichever side went first in a round
    lost (this tree against itself at batch 8, 7 rounds: 0.91-0.97x in rounds it went first,
    1.01-1.12x in the others, 2026-12-04)."""
    with contextlib.ExitStack() as stack:
        workers = {name: stack.enter_context(start_worker(name, *sides[name])) for name in order}
        for case, results in zip(cases, timed):
            for name in order:
                one_round(workers[name], case | REWARM)
                results["this" if name == "this" else "other"].append(one_round(workers[name], case) | {"pid": workers[name].process.pid})
        return {name: w.ready for name, w in workers.items()}


def ab_cases(spec: LatencySpec) -> list[dict[str, int]]:
    """Every (batch size, prompt length, generation length) case of the spec, as worker requests."""
    return [{"batch_size": b, "prompt_len": p, "gen_len": g} for b in spec.batch_sizes for p in spec.prompt_lens for g in spec.gen_lens]


def case_row(case: dict[str, int], timed: dict[str, list[dict[str, Any]]], tolerance: float) -> dict[str, Any]:
    """One case's figures: each side's decode tok/s per round and median, this / other per
    round and their summary (``median_ratio``: :func:`~neuronfx.bench.rounds.paired_ratio`, the
    median of round pairs run in opposite orders), each round's worker process ids, and whether
    both sides' greedy tokens were the same every round."""
    this, other = ([r["decode_tok_s"] for r in timed[side]] for side in ("this", "other"))
    per_round = [a / b for a, b in zip(this, other, strict=True)]
    summary = paired_ratio(per_round)
    digests = {r["tokens_digest"] for side in timed.values() for r in side}
    pids = {side: [r["pid"] for r in timed[side]] for side in ("this", "other")}
    return case | {"this_tok_s": this, "other_tok_s": other, "this_pids": pids["this"], "other_pids": pids["other"], "this_median": median(this), "other_median": median(other),
                   "ratios": per_round, "median_ratio": summary, "same_tokens": len(digests) == 1,
                   "within_tolerance": abs(summary - 1) <= tolerance, "first_tokens": timed["this"][0]["first_tokens"]}


def format_case(row: dict[str, Any]) -> str:
    """One line of :func:`case_row`: medians, per-round ratios, tolerance and token agreement."""
    within = "within" if row["within_tolerance"] else "OUTSIDE"
    return (f"B={row['batch_size']} prompt={row['prompt_len']} gen={row['gen_len']}: decode tok/s this "
            f"{row['this_median']:.1f} / other {row['other_median']:.1f} (median rounds); this / other per round "
            + " ".join(f"{r:.3f}" for r in row["ratios"]) + f"; median of round pairs {row['median_ratio']:.3f}x ({within} tolerance); "
            f"greedy tokens {'identical' if row['same_tokens'] else 'DIFFER'}")
