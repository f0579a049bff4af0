"""``neuronfx bench-serving``: the older name of ``neuronfx bench serving``, kept as an alias
(the same options and figures)."""

from __future__ import annotations

import argparse
import json

from neuronfx.bench import serving
from neuronfx.cli.types import Subcommand


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``neuronfx bench serving``, and ``--json``."""
    serving.add_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
    """``neuronfx bench serving``: print its table (or one JSON object); exit status 0."""
    data = serving.run(args)
    if args.json:
        print(json.dumps(data))
    return 0


COMMAND = Subcommand(name="bench-serving", help="the same as neuronfx bench serving", description=serving.__doc__,
                     add_arguments=add_arguments, run=run)
