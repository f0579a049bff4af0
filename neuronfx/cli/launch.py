"""Tensor-parallel commands: ``neuronfx generate --tp-degree N`` (and compile) start N ranks of
the same command line on this machine through ``neuronfx.launch``; under torchrun the ranks
are already there. Rank 0 prints the results; the others print only their errors."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

import neuronfx
from neuronfx.errors import TensorParallelError

Main = Callable[[list[str]], int]


def quiet_other_ranks() -> None:
    """In a tensor-parallel rank other than 0 (torchrun or ``neuronfx.launch`` set ``RANK``),
    send stdout to /dev/null: rank 0 prints the results."""
    if int(os.environ.get("RANK", "0")) != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the rank


def rank_main(main: Main, argv: list[str]) -> int:
    """One rank of a tensor-parallel CLI command (started by :func:`launch_ranks`): the same
    command; a failed rank exits with its status, so the launcher stops the others."""
    code = main(argv)
    if code:
        sys.exit(code)
    return code


def launch_ranks(main: Main, argv: list[str], tp_degree: int) -> int:
    """Start ``tp_degree`` ranks running ``main(argv)`` on this machine; their exit status
    (2 when the ranks failed on a neuronfx error, each printed as one line already; 1 on
    another launch failure, printed here)."""
    # The launcher logs each failure with the rank's traceback; a CLI user gets one line.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        return neuronfx.launch(rank_main, main, argv, tp_degree=tp_degree)
    except TensorParallelError as exc:
        if set(getattr(exc, "exit_codes", {}).values()) == {2}:
            return 2
        print(f"neuronfx: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def rank_tag() -> str:
    """" (rank R)" in a tensor-parallel rank other than 0, so each error says where it came from."""
    import torch.distributed as dist

    return f" (rank {dist.get_rank()})" if dist.is_initialized() and dist.get_rank() != 0 else ""
