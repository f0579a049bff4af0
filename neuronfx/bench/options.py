"""Options several benchmarks share, and the checks on them (before anything loads)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from neuronfx.config.dtypes import FLOAT_DTYPES
from neuronfx.config.inference import BACKENDS, DEFAULT_BACKEND
from neuronfx.errors import InputError

Log = Callable[[str], Any]


def add_model(p: argparse.ArgumentParser) -> None:
    """--model: the checkpoint a benchmark reads."""
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: the SmolLM2-135M-Instruct GGUF)")


def add_engine(p: argparse.ArgumentParser, backend: str = DEFAULT_BACKEND, dtype: str = "float32") -> None:
    """--backend and --dtype of the plans a benchmark compiles."""
    p.add_argument("--backend", choices=BACKENDS, default=backend, help=f"(default {backend})")
    p.add_argument("--dtype", choices=FLOAT_DTYPES, default=dtype, help=f"(default {dtype})")


def add_threads(p: argparse.ArgumentParser) -> None:
    """--threads: torch threads of the run (:func:`set_threads`)."""
    p.add_argument("--threads", type=int, default=None, metavar="N", help="torch threads (default: torch's, OMP_NUM_THREADS)")


def set_threads(threads: int | None) -> None:
    """torch.set_num_threads(threads) when given; InputError for < 1."""
    import torch

    if threads is None:
        return
    if threads < 1:
        raise InputError(f"--threads={threads} must be >= 1.")
    torch.set_num_threads(threads)


def logger(args: argparse.Namespace) -> Log:
    """``print`` for the human report, or a function that drops the lines under ``--json``."""
    return (lambda line: None) if args.json else print


def check_at_least(name: str, values: int | Sequence[int], low: int) -> None:
    """InputError naming ``--name`` when a value is below ``low``."""
    bad = [v for v in ([values] if isinstance(values, int) else values) if v < low]
    if bad:
        raise InputError(f"--{name.replace('_', '-')} has {bad}; each value must be >= {low}.")
