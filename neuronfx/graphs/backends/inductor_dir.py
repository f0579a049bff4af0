"""The inductor backend's kernel directories: inductor writes its generated kernels (C++
libraries, sources) into its cache directory, so each runtime compiles and loads inside a private
copy (:func:`private_dir`, :func:`in_dir`); saved runtimes and compile-cache entries ship it
(:data:`INDUCTOR_DIR`), and the compile cache's kernel store collects every runtime's kernels
(:func:`publish_kernels`)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

INDUCTOR_DIR = "inductor"
"""Where a saved runtime or cache entry keeps its kernel directory, relative to its root."""
SKIPPED_SUFFIXES = (".lock", ".pyc")  # inductor's lock files and bytecode are not shipped


def private_dir(source: Path | None = None) -> Path:
    """A new private inductor cache directory (a copy of ``source`` when given): inductor writes
    into its cache while it works, so shared copies (artifacts, cache entries, the kernel store)
    stay read-only."""
    target = Path(tempfile.mkdtemp(prefix="neuronfx-inductor-"))
    if source is not None:
        shutil.copytree(source, target, dirs_exist_ok=True,
                        ignore=lambda _d, found: [n for n in found if skipped(n)])
    return target


def skipped(name: str) -> bool:
    """Inductor's lock files and bytecode, and the store's files being written."""
    return name.endswith(SKIPPED_SUFFIXES) or name == "__pycache__" or name.startswith(".tmp-")


def publish_kernels(directory: Path, store: Path) -> int:
    """Copy the files of a runtime's private ``directory`` that ``store`` lacks into it (the
    kernel store of the compile cache: later builds start from a copy of it, so a kernel
    compiled once is not compiled again; inductor names its files by a hash of their source, so
    a file of one name is the same file in every build). Each file is written to a temp name and
    renamed: readers see it whole or not at all. Returns the number of files added."""
    added = 0
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory)
        if not path.is_file() or any(skipped(part) for part in rel.parts):
            continue
        target = store / rel
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".tmp-{os.getpid()}-{threading.get_ident()}-{target.name}")
        shutil.copy2(path, tmp)
        os.replace(tmp, target)
        added += 1
    return added


def in_dir(directory: Path, fn: Callable, *args: object) -> object:
    """``fn(*args)`` with inductor's cache directory set to ``directory``."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir  # importing inductor costs 2 s: only when compiling

    with temporary_cache_dir(str(directory)):
        return fn(*args)




def ship(directory: str, out: Path) -> list[str]:
    """Copy a runtime's kernel ``directory`` to ``out / INDUCTOR_DIR`` (lock files and bytecode
    left out); the relative names of the files there."""
    shutil.copytree(directory, out / INDUCTOR_DIR, dirs_exist_ok=True,
                    ignore=lambda _d, found: [n for n in found if n.endswith(SKIPPED_SUFFIXES) or n == "__pycache__"])
    return sorted(
        f"{INDUCTOR_DIR}/{p.relative_to(out / INDUCTOR_DIR).as_posix()}" for p in (out / INDUCTOR_DIR).rglob("*")
        if p.is_file() and not p.name.endswith(SKIPPED_SUFFIXES) and "__pycache__" not in p.parts
    )
