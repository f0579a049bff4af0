"""``neuronfx cache list | inspect KEY | clear [KEY]``: the compile cache ($NEURONFX_CACHE_DIR,
default ~/.cache/neuronfx)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from neuronfx.cli.types import Subcommand
from neuronfx.io import cache


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The actions list, inspect KEY and clear [KEY], each with ``--dir``."""
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="one line per entry: key, model, backend, dtype, batch size, size")
    inspect = actions.add_parser("inspect", help="an entry's manifest and plan, verified")
    inspect.add_argument("key", help="entry key or a unique prefix of it")
    clear = actions.add_parser("clear", help="delete one entry, or every entry")
    clear.add_argument("key", nargs="?", default=None, help="entry key or a unique prefix (default: all)")
    for q in actions.choices.values():
        q.add_argument("--dir", default=None, help="cache directory (default $NEURONFX_CACHE_DIR or ~/.cache/neuronfx)")


def run(args: argparse.Namespace) -> int:
    """Print the entries, one entry's manifest and plan, or what was removed. Raises
    ArtifactError (from ``neuronfx.io.cache``) for a key that matches no entry or several."""
    root = Path(args.dir).expanduser() if args.dir else cache.default_cache_dir()
    if args.action == "list":
        entries = cache.list_entries(root)
        print(f"{root}: {len(entries)} entries")
        for e in entries:
            what = e.get("error") or f"{e['model_type']} {e['backend']} {e['dtype']} batch {e['batch_size']}, {e['files']} files, {e['created']}"
            print(f"{e['key'][:16]}  {e['bytes'] / 2**20:8.1f} MiB  {what}")
    elif args.action == "inspect":
        print(json.dumps(cache.inspect_entry(args.key, root), indent=2, sort_keys=True))
    else:
        removed = cache.clear(args.key, root)
        print(f"removed {len(removed)} entries from {root}" + "".join(f"\n  {name}" for name in removed))
    return 0


COMMAND = Subcommand(name="cache", help="list, inspect or clear the compile cache ($NEURONFX_CACHE_DIR, default ~/.cache/neuronfx)",
                     add_arguments=add_arguments, run=run)
