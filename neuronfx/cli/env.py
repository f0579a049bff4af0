"""``neuronfx env``: what a bug report needs about this machine (vLLM's ``collect-env``): the
versions of neuronfx, Python, torch and transformers, the CPU's vector ISA as torch sees it,
the threads a step uses, CUDA devices, the compile cache and the default model."""

from __future__ import annotations

import argparse
import json
import os
import platform
from typing import Any

import torch

from neuronfx.cli.types import Subcommand
from neuronfx.errors import CheckpointError
from neuronfx.io import cache, checkpoints
from neuronfx.version import __version__


def facts() -> dict[str, Any]:
    """This machine as a flat dict of strings, numbers and lists."""
    import transformers

    try:
        model = checkpoints.default_model_path()
    except CheckpointError as exc:
        model = f"not installed ({exc})"
    cuda = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {"neuronfx": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "platform": platform.platform(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "cuda_devices": cuda, "compile_cache": str(cache.default_cache_dir()), "default_model": model}


def run(args: argparse.Namespace) -> int:
    """Print the facts, one per line (or one JSON object); exit status 0."""
    found = facts()
    print(json.dumps(found) if args.json else "\n".join(f"{k:16s} {v}" for k, v in found.items()))
    return 0


COMMAND = Subcommand(name="env", help="versions, CPU, threads, CUDA devices, compile cache and default model, for a bug report",
                     description=__doc__, add_arguments=lambda p: p.add_argument("--json", action="store_true", help="print one JSON object"),
                     run=run)
