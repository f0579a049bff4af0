"""neuronfx's version: the one place it is written (pyproject.toml reads it from here), and
the fingerprint of the source compiled graphs are made of (saved runtimes, compile-cache keys and
the inductor parts' cache keys compare it)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__version__ = "0.1.0"

PACKAGE_ROOT = Path(__file__).resolve().parent
"""The ``neuronfx`` package directory."""


def fingerprint_sources() -> list[Path]:
    """The source files compiled graphs are made of: every .py and .cpp under
    ``neuronfx/graphs`` and ``neuronfx/config``, sorted."""
    sources = [p for sub in ("graphs", "config") for p in (PACKAGE_ROOT / sub).rglob("*")]
    return sorted(p for p in sources if p.suffix in (".py", ".cpp") and "__pycache__" not in p.parts)


@functools.cache
def source_fingerprint() -> str:
    """sha256 over :func:`fingerprint_sources` (paths and contents): an edited checkout must not
    reuse graphs compiled from the old code. Computed once per process."""
    h = hashlib.sha256()
    for path in fingerprint_sources():
        h.update(str(path.relative_to(PACKAGE_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()
