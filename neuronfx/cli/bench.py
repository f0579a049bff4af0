"""``neuronfx bench <name>``: one subcommand per benchmark of :data:`neuronfx.bench.BENCHMARKS`,
each with its own options and ``--json``. The flags of the older single ``neuronfx bench``
still work: ``neuronfx bench [flags]`` is ``bench latency``, with ``--serving`` ``bench
throughput``, with ``--speculate`` ``bench speculative``, with ``--tp-degree`` ``bench
tensor-parallel``."""

from __future__ import annotations

import argparse
import json

from neuronfx.bench import BENCHMARKS
from neuronfx.cli.types import Subcommand

LEGACY_MODES = (("--tp-degree", "tensor-parallel", False), ("--speculate", "speculative", True), ("--serving", "throughput", True))
"""(flag of the old ``neuronfx bench``, the benchmark it chose, whether the flag is dropped): the
first flag present wins, as the old command's checks went."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One sub-parser per benchmark, each with its own options and ``--json``."""
    names = p.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for b in BENCHMARKS:
        q = names.add_parser(b.name, help=b.help, description=b.description, formatter_class=argparse.RawDescriptionHelpFormatter)
        b.add_arguments(q)
        q.add_argument("--json", action="store_true", help="print one JSON object of every figure instead of the report")


def legacy_argv(rest: list[str]) -> list[str]:
    """The arguments after ``bench``, with the benchmark's name put first when they start with
    an option (the old single command's spelling); ``-h`` alone still lists the benchmarks."""
    if rest and (not rest[0].startswith("-") or rest[0] in ("-h", "--help")):
        return rest
    for flag, name, dropped in LEGACY_MODES:
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            return [name, *(a for a in rest if not (dropped and a == flag))]
    return ["latency", *rest]


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark; print its figures as JSON with --json (it prints its own report otherwise)."""
    data = next(b for b in BENCHMARKS if b.name == args.benchmark).run(args)
    if args.json:
        print(json.dumps(data))
    return 0


COMMAND = Subcommand(name="bench", help="benchmarks: latency, serving, throughput, speculative, tensor-parallel, ... "
                     "(neuronfx bench BENCHMARK --help)", description=__doc__, add_arguments=add_arguments, run=run,
                     legacy_argv=legacy_argv)
