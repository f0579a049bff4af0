"""The record every ``neuronfx`` subcommand module exports as ``COMMAND`` (vLLM's
``CLISubcommand``, as a value instead of a base class)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import attrs


@attrs.frozen(kw_only=True)
class Subcommand:
    """One ``neuronfx NAME`` command: its parser's options and the function that runs it.

    ``run`` returns the exit status (0 done, 1 a check failed); it raises NeuronfxError for bad
    input, which ``neuronfx.cli.main`` prints as one line and exits 2. ``tp_degree``, for commands
    that can run as tensor-parallel ranks, returns the ranks the parsed arguments ask for
    (checking them first); ``main`` starts that many ranks of the same command line when it
    is more than 1. ``legacy_argv`` rewrites the arguments after NAME before parsing, for
    spellings kept from an older command layout."""

    name: str
    help: str  # one line in `neuronfx --help`
    description: str | None = None  # the text of `neuronfx NAME --help` (default: help)
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    tp_degree: Callable[[argparse.Namespace], int] | None = None
    legacy_argv: Callable[[list[str]], list[str]] | None = None
