"""``neuronfx plan [MODEL]``: the graphs ``neuronfx compile`` would build for the plan options
(one per phase, batch bucket and length bucket) and the KV cache they share, without compiling:
what a plan costs, seen before minutes of compiling. A saved runtime shows its own plan."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

from neuronfx.cli.loading import plan_inference
from neuronfx.cli.options import MODEL_HELP, add_plan_options
from neuronfx.cli.types import Subcommand
from neuronfx.config.plan import Plan, make_plan
from neuronfx.config.serialization import plan_from_json
from neuronfx.io import checkpoints
from neuronfx.io.artifacts import PLAN, first_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL and the plan options."""
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    add_plan_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def plan_of(args: argparse.Namespace) -> Plan:
    """The saved runtime's plan, or the plan of MODEL's config for the options (the checkpoint's
    config is read, its weights are not kept). Raises what ``plan_inference`` and ``make_plan`` raise."""
    saved, inference = plan_inference(args)
    if saved is not None:
        return plan_from_json((first_dir(saved) / PLAN).read_text())
    model = args.model or checkpoints.default_model_path()
    return make_plan(checkpoints.load_checkpoint(model, lazy=True).config, inference, checkpoint=str(model))


def summary(plan: Plan) -> dict[str, Any]:
    """The plan's buckets, graphs ([phase, batch size, bucket] each) and KV cache bytes."""
    inf = plan.inference
    return {"model_type": plan.model.model_type, "layers": plan.model.num_hidden_layers, "backend": inf.backend, "dtype": inf.dtype,
            "weight_format": inf.weight_format, "batch_buckets": list(plan.batch_buckets), "prefill_buckets": list(plan.prefill_buckets),
            "decode_buckets": list(plan.decode_buckets), "chunk_buckets": list(plan.chunk_buckets), "kv_bytes": plan.kv.nbytes,
            "graphs": [list(g.key) for g in plan.graphs]}


def report(s: dict[str, Any]) -> list[str]:
    """The summary as lines: buckets, KV cache MiB, one line per graph."""
    per_phase = Counter(phase for phase, _, _ in s["graphs"])
    lines = [f"{s['model_type']}, {s['layers']} layers; {s['backend']} {s['dtype']}, weights {s['weight_format']}",
             f"batch buckets {s['batch_buckets']}; prefill buckets {s['prefill_buckets']}; decode buckets {s['decode_buckets']}"
             + (f"; chunk buckets {s['chunk_buckets']}" if s["chunk_buckets"] else ""),
             f"KV cache {s['kv_bytes'] / 2**20:.1f} MiB; {len(s['graphs'])} graphs: "
             + ", ".join(f"{n} {phase}" for phase, n in per_phase.items())]
    return lines + [f"  {phase:8s} batch {b:<3d} bucket {bucket}" for phase, b, bucket in s["graphs"]]


def run(args: argparse.Namespace) -> int:
    """Print the plan's summary (or one JSON object); exit status 0."""
    s = summary(plan_of(args))
    print(json.dumps(s) if args.json else "\n".join(report(s)))
    return 0


COMMAND = Subcommand(name="plan", help="the graphs compile would build for the plan options and their KV cache, without "
                     "compiling", description=__doc__, add_arguments=add_arguments, run=run)
