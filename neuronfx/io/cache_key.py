"""The compile cache's key: what it hashes (:func:`key_components`), the hash
(:func:`cache_key`), and why a plan missed (:func:`explain`: the key components that differ
from the nearest entry of the same plan)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from neuronfx.config.plan import Plan
from neuronfx.config.serialization import unstructure
from neuronfx.graphs.backends import get_backend
from neuronfx.io.artifacts import environment

KEY_FILE = "key.json"
"""An entry's key components (:func:`key_components`) and how long its compile took."""


def key_components(plan: Plan) -> dict[str, Any]:
    """What :func:`cache_key` hashes, as JSON values: model config, inference config,
    tensor-parallel rank, environment (:func:`neuronfx.io.artifacts.environment`: versions, source
    fingerprint, machine) and what the backend bakes in here (``Backend.choices``: inductor's
    thread count, as its compiled code guards on it and refuses to run under another, and its
    16-bit prefill path). ``plan.checkpoint`` is left out: entries hold no weights."""
    content = {
        "model": unstructure(plan.model),
        "inference": unstructure(plan.inference),
        "rank": plan.rank,
        "environment": environment(plan.inference.backend),
        "choices": get_backend(plan.inference.backend).choices(plan),
    }
    return json.loads(canonical(content))  # tuples as lists: what key.json reads back


def canonical(content: object) -> str:
    return json.dumps(content, sort_keys=True, separators=(",", ":"))


def cache_key(plan: Plan) -> str:
    """sha256 hex of the canonical JSON of :func:`key_components`."""
    return digest(key_components(plan))


def digest(components: dict[str, Any]) -> str:
    return hashlib.sha256(canonical(components).encode()).hexdigest()


PLAN_PARTS = ("model", "inference", "rank")
"""The key components that make the plan; the others say where and how it was compiled."""


def spread(components: dict[str, Any]) -> dict[str, object]:
    """``components`` with the environment and the backend's choices spread into one item each
    (``environment.torch``, ``choices.num_threads``), so a difference names the one that differs."""
    out = {part: components[part] for part in PLAN_PARTS}
    for part in ("environment", "choices"):
        out |= {f"{part}.{name}": value for name, value in components[part].items()}
    return out


def shown(name: str, value: object) -> str:
    """One key component for a person: "2 threads", "torch 2.13.0", "no widen_16bit"."""
    short = name.rsplit(".", 1)[-1]
    if value is None:
        return f"no {short}"
    if name == "choices.num_threads":
        return f"{value} thread{'' if value == 1 else 's'}"
    if name == "environment.neuronfx_source":
        return f"neuronfx source {str(value)[:12]}"
    return f"{short} {value}"


def explain(entries: list[Path], components: dict[str, Any]) -> str | None:
    """Why the plan whose key components are ``components`` has none of ``entries`` (compile-cache
    entry directories), naming what differs from the nearest entry of the same plan (see
    ``neuronfx.io.cache.explain_miss``); None when no entry is of the same plan."""
    ours = spread(components)
    best: tuple[list[str], Path, dict, dict] | None = None
    for entry in entries:
        try:
            recorded = json.loads((entry / KEY_FILE).read_text())
            theirs = spread(recorded["components"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if any(theirs[part] != ours[part] for part in PLAN_PARTS):
            continue
        differ = sorted(n for n in ours.keys() | theirs.keys() if ours.get(n) != theirs.get(n))
        if differ and (best is None or len(differ) < len(best[0])):
            best = (differ, entry, recorded, theirs)
    if best is None:
        return None
    differ, entry, recorded, theirs = best
    hints = []
    if "choices.num_threads" in differ:
        hints.append(f"run with OMP_NUM_THREADS={theirs['choices.num_threads']} to use it")
    if "environment.neuronfx_source" in differ:
        hints.append("another checkout or an edit of neuronfx/graphs or neuronfx/config")
    if isinstance(recorded.get("compile_s"), (int, float)):
        hints.append(f"entry {entry.name[:16]}, compiled in {recorded['compile_s']:.0f} s")
    else:
        hints.append(f"entry {entry.name[:16]}")
    return (f"no entry for this plan with {', '.join(shown(n, ours.get(n)) for n in differ)}; an entry exists for "
            f"{', '.join(shown(n, theirs.get(n)) for n in differ)} ({'; '.join(hints)})")
