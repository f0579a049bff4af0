"""Saved runtimes: ``save(runtime, dir)`` / ``load(dir)``.

A directory holds ``plan.json`` (the cattrs form of the plan's sources), ``weights.safetensors``
(each shared tensor once; tied names listed in the manifest), the backend's graph files, and
``manifest.json``: format version, versions of neuronfx and torch, backend, machine, plan hash
and a sha256 per file. ``load`` checks the manifest before anything runs.

Graph files per backend: ``export`` saves each (phase, batch, bucket) ExportedProgram
(``torch.export.save``), loaded without tracing; ``inductor`` saves torch's compile-cache
artifacts (``torch.compiler.save_cache_artifacts``: inductor's compiled kernels), so loading
re-traces with dynamo but compiles nothing; ``eager`` has no graph files.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

import neuronfx
from neuronfx.config.serialization import plan_from_json, plan_to_json
from neuronfx.errors import ArtifactError
from neuronfx.graphs.backends import ExportedGraph, build_graph
from neuronfx.graphs.weights import nest
from neuronfx.runtime.runtime import Runtime
from neuronfx.runtime.state import empty_state

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"
WEIGHTS = "weights.safetensors"
INDUCTOR_CACHE = "inductor_cache.bin"


def _graph_file(key: tuple[str, int, int]) -> str:
    phase, batch, bucket = key
    return f"graphs/{phase}-b{batch}-t{bucket}.pt2"


def environment(backend: str) -> dict[str, str]:
    """What an artifact's compiled files depend on (compared on load)."""
    return {"neuronfx": neuronfx.__version__, "torch": torch.__version__, "backend": backend, "machine": platform.machine()}


def flatten_weights(weights: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(unique tensors by neuronfx name, aliases name -> name): tied tensors are stored once."""
    named = {k: t for k, t in weights.items() if k != "layers"}
    for i, lw in enumerate(weights["layers"]):
        named |= {f"layers.{i}.{k}": t for k, t in lw.items()}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    owner: dict[int, str] = {}
    for name, t in named.items():
        if t.data_ptr() in owner:
            aliases[name] = owner[t.data_ptr()]
        else:
            owner[t.data_ptr()] = name
            unique[name] = t.contiguous()
    return unique, aliases


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save(runtime: Runtime, directory: str | os.PathLike) -> Path:
    """Write ``runtime`` to ``directory`` (created; existing files of the same names are
    replaced). Returns the directory. Sizes: the weights once (bytes of the unique tensors) plus
    the graph files."""
    out = Path(directory)
    (out / "graphs").mkdir(parents=True, exist_ok=True)
    plan = runtime.plan
    (out / PLAN).write_text(plan_to_json(plan))
    unique, aliases = flatten_weights(runtime.weights)
    save_file(unique, str(out / WEIGHTS))
    files = [PLAN, WEIGHTS]
    if plan.inference.backend == "export":
        for key, graph in runtime.graphs.items():
            torch.export.save(graph.program, str(out / _graph_file(key)))
            files.append(_graph_file(key))
    elif plan.inference.backend == "inductor":
        artifacts = torch.compiler.save_cache_artifacts()
        (out / INDUCTOR_CACHE).write_bytes(artifacts[0] if artifacts else b"")
        files.append(INDUCTOR_CACHE)
    manifest = {
        "format": FORMAT_VERSION,
        "environment": environment(plan.inference.backend),
        "plan_sha256": hashlib.sha256(plan_to_json(plan).encode()).hexdigest(),
        "aliases": aliases,
        "files": {f: sha256(out / f) for f in files},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return out


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest, checked: format, environment, every file present with its sha256. Raises
    ArtifactError naming what was expected, what was found and how to rebuild."""
    path = directory / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{str(directory)!r} has no {MANIFEST}; it is not a saved neuronfx runtime (neuronfx.save / neuronfx compile).")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path} does not parse ({exc}); re-save the runtime.") from exc
    if manifest.get("format") != FORMAT_VERSION:
        raise ArtifactError(f"{path}: format {manifest.get('format')!r}, this neuronfx reads format {FORMAT_VERSION}; rebuild it with neuronfx.save.")
    found = manifest.get("environment", {})
    want = environment(found.get("backend", ""))
    for key in ("neuronfx", "torch", "machine"):
        if found.get(key) != want[key]:
            raise ArtifactError(
                f"{directory} was built with {key} {found.get(key)!r}, this process has {want[key]!r}; its compiled "
                "graphs may not load: rebuild it here with neuronfx.save(neuronfx.compile(plan, state_dict), dir)."
            )
    for name, digest in manifest.get("files", {}).items():
        file = directory / name
        if not file.is_file():
            raise ArtifactError(f"{directory}: {name} is missing; re-save the runtime.")
        if sha256(file) != digest:
            raise ArtifactError(f"{directory}: {name} is corrupt (sha256 differs from the manifest); re-save the runtime.")
    return manifest


def load(directory: str | os.PathLike, progress: bool = False) -> Runtime:
    """Load a runtime saved by :func:`save`. Every file is verified before anything runs;
    raises ArtifactError (missing/corrupt file, other versions or machine) or ConfigError (a
    plan.json that does not structure, e.g. an unknown key)."""
    src = Path(directory)
    manifest = read_manifest(src)
    plan = plan_from_json((src / PLAN).read_text())
    if hashlib.sha256(plan_to_json(plan).encode()).hexdigest() != manifest["plan_sha256"]:
        raise ArtifactError(f"{src / PLAN} does not match the manifest's plan hash; re-save the runtime.")
    flat = load_file(str(src / WEIGHTS))
    for name, target in manifest["aliases"].items():
        flat[name] = flat[target]
    weights = nest(flat, plan.model.num_hidden_layers)
    graphs: dict = {}
    if plan.inference.backend == "export":
        for spec in plan.graphs:
            program = torch.export.load(str(src / _graph_file(spec.key)))
            graphs[spec.key] = ExportedGraph(program=program, module=program.module())
    else:
        if plan.inference.backend == "inductor":
            data = (src / INDUCTOR_CACHE).read_bytes()
            if data:
                torch.compiler.load_cache_artifacts(data)
        kv = list(empty_state(plan).kv)
        graphs = {spec.key: build_graph(plan, spec, weights, kv) for spec in plan.graphs}
    return Runtime(plan=plan, weights=weights, graphs=graphs, compile_s={k: 0.0 for k in graphs})


__all__ = ["ArtifactError", "load", "read_manifest", "save"]
