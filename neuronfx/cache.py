"""Compile cache: ``neuronfx.compile`` of a plan compiled before loads its graphs instead.

An entry is keyed by a content hash (:func:`cache_key`) of the model config, the inference
config, the backend, the versions of neuronfx, torch and Python, a fingerprint of neuronfx's
source, the machine and torch's thread count. It holds graph files only (the layout of a saved runtime without
weights: ``plan.json``, ``manifest.json``, ``graphs/*.pt2`` or ``inductor/``): weights are
graph inputs, never baked into compiled code, so a hit runs on the caller's weights.

Location: ``$NEURONFX_CACHE_DIR``, default ``~/.cache/neuronfx``; ``<root>/<key>/`` per entry.
Concurrency: a process holds ``<root>/<key>.lock`` (``filelock``) while it checks, builds or
loads that entry; a new entry is written to ``<root>/.tmp-<key>-*`` and renamed into place, so
an entry is complete or absent and a crash leaves only a temp directory (``clear`` removes it).
A corrupt or half-written entry (sha256 mismatch, missing file, unreadable plan or graph) is
reported with a RuntimeWarning naming the entry and the reason, moved aside, and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import attrs
import torch
from filelock import FileLock

from neuronfx.artifacts import MANIFEST, PLAN, environment, read_manifest, read_plan, write_graph_files, write_manifest
from neuronfx.config.plan import Plan
from neuronfx.config.serialization import plan_to_json, unstructure
from neuronfx.errors import ArtifactError, ConfigError, NeuronfxError
from neuronfx.graphs.backends import Built, get_backend
from neuronfx.graphs.layers import Weights
from neuronfx.runtime.runtime import Runtime, build_graphs, build_runtime

ENV_VAR = "NEURONFX_CACHE_DIR"
_ENTRY_ERRORS = (NeuronfxError, OSError, RuntimeError, EOFError, ValueError, KeyError, pickle.UnpicklingError)


class CacheEntryWarning(RuntimeWarning):
    """A compile-cache entry was corrupt or half-written; it was moved aside and rebuilt."""


def default_cache_dir() -> Path:
    """``$NEURONFX_CACHE_DIR`` if set, else ``~/.cache/neuronfx``."""
    return Path(os.environ.get(ENV_VAR) or Path.home() / ".cache" / "neuronfx").expanduser()


def resolve_cache(cache: bool | str | os.PathLike | None, backend: str) -> Path | None:
    """The cache root ``compile(..., cache=)`` uses, or None for no cache (see ``compile``):
    None means on for backends whose record says ``cached`` (export, inductor). Raises
    ConfigError for any other value."""
    if cache is None:
        return default_cache_dir() if get_backend(backend).cached else None
    if isinstance(cache, bool):
        return default_cache_dir() if cache else None
    if isinstance(cache, (str, os.PathLike)):
        return Path(cache).expanduser()
    raise ConfigError(f"cache={cache!r} must be None (default), True, False or a directory path.")


def cache_key(plan: Plan) -> str:
    """sha256 hex of the canonical JSON of (model config, inference config, tensor-parallel
    rank, environment, torch's intra-op thread count (compiled inductor code guards on it and
    refuses to run under another), what the backend chose on this machine (``Backend.choices``:
    the inductor backend's 16-bit prefill path)); ``plan.checkpoint`` is left out: entries hold
    no weights."""
    content = {
        "model": unstructure(plan.model),
        "inference": unstructure(plan.inference),
        "rank": plan.rank,
        "environment": environment(plan.inference.backend),
        "num_threads": torch.get_num_threads(),
        "choices": get_backend(plan.inference.backend).choices(plan),
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


KERNELS = "kernels"
"""The compile cache's kernel store: ``<root>/kernels/<shape key>/``, see :func:`kernel_store`."""

_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def kernel_store(root: Path, plan: Plan) -> Path:
    """The directory of compiled kernels that builds of models of ``plan``'s shape share:
    ``<root>/kernels/<sha256 of the shape fields and the environment>``. A build starts from a
    copy of it and adds what it compiled (``graphs/inductor.py``: ``publish_kernels``), so the
    second plan of a model (other buckets, batch sizes, speculation, dtype) reuses the kernels
    the first one compiled (a tiny llama's second plan: 37 s instead of 102 s, measured). Keyed
    by shape so that a runtime ships only the kernels of its own model's plans; inductor names
    kernels by their source's hash, so sharing one never runs another's code."""
    env = {k: v for k, v in environment(plan.inference.backend).items() if k != "neuronfx_source"}
    content = {"shape": {f: getattr(plan.model, f) for f in _SHAPE_FIELDS}, "environment": env,
               "num_threads": torch.get_num_threads()}
    digest = hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return root / KERNELS / digest[:32]


def compile_graphs(plan: Plan, weights: Weights, root: Path | None, progress: bool = True) -> Runtime:
    """The runtime of ``plan`` on ``weights``: graphs loaded from the cache entry under ``root``
    when there is a good one, else built (and, with a root, written as a new entry). With
    ``progress``, one line on stderr says which happened and what the next run will do."""
    if root is None:
        return build_runtime(plan, weights, build_graphs(plan, weights, progress))
    key = cache_key(plan)
    root.mkdir(parents=True, exist_ok=True)
    entry = root / key
    t0 = time.perf_counter()
    with FileLock(str(root / f"{key}.lock")):
        if entry.exists():
            loaded = _load_entry(entry, plan, weights)
            if loaded is not None:
                _report(progress, f"loaded {len(plan.graphs)} compiled graphs from the compile cache ({entry}) "
                        f"in {time.perf_counter() - t0:.1f} s")
                return build_runtime(plan, weights, loaded, key)
        runtime = build_runtime(plan, weights, build_graphs(plan, weights, progress, kernel_store(root, plan)), key)
        if _write_entry(root, key, runtime):
            _report(progress, f"compiled {len(plan.graphs)} graphs in {time.perf_counter() - t0:.0f} s and saved them "
                    f"in the compile cache ({entry}): the next run of this plan loads them in seconds")
        return runtime


def _report(progress: bool, line: str) -> None:
    if progress:
        print(f"neuronfx: {line}", file=sys.stderr, flush=True)


def _load_entry(entry: Path, plan: Plan, weights: Weights) -> Built | None:
    """The entry's graphs, or None after reporting and moving aside a bad entry (lock held)."""
    try:
        manifest = read_manifest(entry)
        if plan_to_json(read_plan(entry, manifest)) != plan_to_json(_without_checkpoint(plan)):
            raise ArtifactError(f"{entry / PLAN} is another plan than the one its key names")
        return get_backend(plan.inference.backend).load(plan, weights, entry)
    except _ENTRY_ERRORS as exc:
        warnings.warn(
            f"neuronfx compile cache entry {entry} is unusable ({type(exc).__name__}: {exc}); moved aside and rebuilt.",
            CacheEntryWarning, stacklevel=4,
        )
        _discard(entry)
        return None


def _without_checkpoint(plan: Plan) -> Plan:
    return attrs.evolve(plan, checkpoint=None)


def _discard(path: Path) -> None:
    """Move ``path`` out of the way (one rename: readers see it or nothing), then delete it."""
    aside = path.with_name(f".corrupt-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _write_entry(root: Path, key: str, runtime: Runtime) -> bool:
    """Write the entry to a temp directory and rename it into place (lock held); whether it
    was written. Failing to write only costs the cache (warned); the compiled runtime is still
    returned."""
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
    try:
        plan = _without_checkpoint(runtime.plan)
        files = write_graph_files(runtime, tmp)
        (tmp / PLAN).write_text(plan_to_json(plan))
        write_manifest(tmp, plan, files + [PLAN])
        os.rename(tmp, root / key)
    except (*_ENTRY_ERRORS, pickle.PicklingError, TypeError, AttributeError) as exc:
        warnings.warn(f"could not write neuronfx compile cache entry {root / key} ({type(exc).__name__}: {exc}); the runtime is fine, "
                      "the next compile of this plan compiles again.", CacheEntryWarning, stacklevel=3)
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    return True


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


_KEY = re.compile(r"[0-9a-f]{64}")
_LEFTOVER = re.compile(r"\.(tmp|corrupt)-([0-9a-f]{64})-.+")  # a crashed write, or an entry moved aside


def _entries(root: Path) -> list[Path]:
    """The cache entries under ``root``: directories named by a key (64 hex digits). Anything
    else there is not the cache's and is never listed or touched."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _KEY.fullmatch(p.name))


def _leftovers(root: Path) -> list[tuple[Path, str]]:
    """(directory, key) of the cache's own leftovers under ``root``: temp directories of
    interrupted writes and entries moved aside."""
    if not root.is_dir():
        return []
    found = [(p, _LEFTOVER.fullmatch(p.name)) for p in root.iterdir() if p.is_dir()]
    return sorted((p, m.group(2)) for p, m in found if m)


def list_entries(root: Path | None = None) -> list[dict[str, Any]]:
    """One summary per entry under ``root`` (default :func:`default_cache_dir`): key, model
    type, backend, dtype, batch size, number of graphs, bytes, created time. Entries whose
    manifest or plan cannot be read are listed with ``error`` set."""
    out = []
    for entry in _entries(root or default_cache_dir()):
        info: dict[str, Any] = {"key": entry.name, "bytes": _size(entry)}
        try:
            manifest = json.loads((entry / MANIFEST).read_text())
            plan = json.loads((entry / PLAN).read_text())
            inf = plan["inference"]
            info |= {"model_type": plan["model"]["model_type"], "backend": inf["backend"], "dtype": inf["dtype"],
                     "batch_size": inf["batch_size"], "files": len(manifest["files"]), "created": manifest.get("created")}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            info["error"] = f"{type(exc).__name__}: {exc}"
        out.append(info)
    return out


def _find(root: Path, key: str) -> Path:
    matches = [e for e in _entries(root) if e.name.startswith(key)] if key else []
    if len(matches) != 1:
        found = "no entry" if not matches else f"{len(matches)} entries"
        raise ArtifactError(f"key {key!r} matches {found} in {root}; `neuronfx cache list` shows the keys (a unique prefix is enough).")
    return matches[0]


def inspect_entry(key: str, root: Path | None = None) -> dict[str, Any]:
    """The manifest and plan of the entry whose key starts with ``key``, and whether it verifies
    (``ok``; ``error`` says why not). Raises ArtifactError when the prefix matches no or several entries."""
    entry = _find(root or default_cache_dir(), key)
    info: dict[str, Any] = {"key": entry.name, "path": str(entry), "bytes": _size(entry)}
    try:
        info["manifest"] = read_manifest(entry)
        info["plan"] = json.loads((entry / PLAN).read_text())
        info["ok"] = True
    except (ArtifactError, OSError, ValueError) as exc:
        info |= {"ok": False, "error": str(exc)}
    return info


def clear(key: str | None = None, root: Path | None = None) -> list[str]:
    """Delete the entry whose key starts with ``key`` (or, when None, every entry, the kernel
    store and the cache's own leftover temp directories), each under its key's lock; returns the removed
    names. Only directories named like cache entries are touched: anything else in ``root``
    stays. Raises ArtifactError for a prefix matching no or several entries."""
    root = root or default_cache_dir()
    if key is not None:
        targets = [(_find(root, key), None)]
    else:
        targets = [(p, None) for p in _entries(root)] + _leftovers(root)
    removed = []
    for path, owner in targets:
        with FileLock(str(root / f"{owner or path.name}.lock")):
            _discard(path)
        removed.append(path.name)
    if key is None and (root / KERNELS).is_dir():  # the kernel store goes with the entries built from it
        _discard(root / KERNELS)
        removed.append(KERNELS)
    return removed


__all__ = [
    "ENV_VAR",
    "CacheEntryWarning",
    "cache_key",
    "clear",
    "compile_graphs",
    "default_cache_dir",
    "inspect_entry",
    "kernel_store",
    "list_entries",
    "resolve_cache",
]
