"""The record every benchmark module exports as ``BENCHMARK`` (``neuronfx bench <name>``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class Benchmark:
    """One ``neuronfx bench NAME``: its options and the function that measures.

    ``run(args)`` returns the figures as a JSON-able dict (``--json`` prints it) and prints its
    human report unless ``args.json``; it raises NeuronfxError for bad options (checked before
    anything slow) and when a measured engine fails."""

    name: str
    help: str  # one line in `neuronfx bench --help`
    description: str  # the text of `neuronfx bench NAME --help`: what is measured and how
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], dict[str, Any]]
