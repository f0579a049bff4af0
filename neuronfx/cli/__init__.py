"""The command line: ``neuronfx <command>``, one module per command in this package, each
exporting ``COMMAND`` (a :class:`~neuronfx.cli.types.Subcommand`: its options and its run
function). Adding a command is one module and one entry in :data:`COMMANDS`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from neuronfx.cli import bench, bench_serving, cache, chat, check_accuracy, env, generate, plan, serve
from neuronfx.cli import compile as compile_command
from neuronfx.cli.launch import launch_ranks, quiet_other_ranks, rank_tag
from neuronfx.cli.options import check_text_options
from neuronfx.cli.types import Subcommand
from neuronfx.errors import NeuronfxError
from neuronfx.runtime.distributed import under_launcher

COMMANDS: tuple[Subcommand, ...] = (generate.COMMAND, chat.COMMAND, serve.COMMAND, compile_command.COMMAND, plan.COMMAND,
                                    cache.COMMAND, check_accuracy.COMMAND, bench.COMMAND, bench_serving.COMMAND, env.COMMAND)

DESCRIPTION = ("neuronfx runs decoder-only LLMs as a fixed set of static-shape graphs (one per phase and bucket): generate and "
               "chat at the command line, serve over OpenAI's HTTP API, compile and cache runtimes, check accuracy against "
               "transformers, and benchmark.")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser of every command in :data:`COMMANDS`, and each command's own parser by name
    (an unknown option is reported with its command's usage, not the top level's)."""
    parser = argparse.ArgumentParser(prog="neuronfx", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {}
    for command in COMMANDS:
        commands[command.name] = sub.add_parser(command.name, help=command.help, description=command.description or command.help)
        command.add_arguments(commands[command.name])
    return parser, commands


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (2: a neuronfx error, printed as one line). A
    command that asks for tensor-parallel ranks starts them here (unless already under a
    launcher); ranks other than 0 print nothing but their errors."""
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_other_ranks()
    by_name = {c.name: c for c in COMMANDS}
    command = by_name.get(argv[0]) if argv else None
    if command is not None and command.legacy_argv is not None:
        argv = [argv[0], *command.legacy_argv(argv[1:])]
    parser, parsers = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")  # exits 2
    command = by_name[args.command]
    try:
        check_text_options(args)
        tp = command.tp_degree(args) if command.tp_degree is not None else 1
        if tp > 1 and not under_launcher():
            return launch_ranks(main, argv, tp)
        return command.run(args)
    except NeuronfxError as exc:
        print(f"neuronfx: error{rank_tag()}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
