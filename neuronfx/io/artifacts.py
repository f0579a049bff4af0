"""Saved runtimes: ``save(runtime, dir)`` / ``load(dir)``, and hub interop.

A directory holds ``plan.json`` (the cattrs form of the plan's sources), ``weights.safetensors``
(each shared tensor once; tied names listed in the manifest), the backend's graph files,
optionally ``tokenizer/`` (``save_pretrained``) and ``generation_config.json`` (eos ids), and
``manifest.json``: format version, versions of neuronfx, torch and Python, a fingerprint of
neuronfx's source, backend, machine, plan hash and a sha256 per file. ``load`` checks the
manifest and every file before anything runs.

The graph files are whatever the plan's backend record writes and reads
(``neuronfx.graphs.backends``): ``export`` one ExportedProgram per graph, ``inductor`` each
graph part's precompiled function and its kernel directory (so loading compiles nothing),
``eager`` none. A compile-cache entry (:mod:`neuronfx.io.cache`) is the same layout without
weights, tokenizer and generation config.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from neuronfx.config.plan import Plan
from neuronfx.config.serialization import plan_from_json, plan_to_json
from neuronfx.errors import ArtifactError, InputError
from neuronfx.graphs.backends import get_backend
from neuronfx.graphs.models.quant import QUANTIZED_TYPES
from neuronfx.graphs.phases.device import check_device, plan_device, to_device
from neuronfx.io.weights import nest
from neuronfx.runtime import distributed
from neuronfx.runtime.distributed import init_tensor_parallel
from neuronfx.runtime.runtime import Runtime, build_runtime
from neuronfx.version import __version__, source_fingerprint

FORMAT_VERSION = 9  # 9: speculate graphs return their argmax and finiteness; 8: greedy graphs take GreedyInputs; 7: "greedy" graphs; 6: weight_format fields, quantized weight records
"""3: graphs take the KV cache as (K, V) per layer and step-input records (2: a flat KV list)."""
MANIFEST = "manifest.json"
PLAN = "plan.json"
WEIGHTS = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"
GENERATION_CONFIG = "generation_config.json"
_SKIPPED_SUFFIXES = (".lock", ".pyc")

__all__ = ["ArtifactError", "load", "load_tokenizer", "push_to_hub", "read_manifest", "save"]


def environment(backend: str) -> dict[str, str]:
    """What an artifact's compiled files depend on (compared on load)."""
    return {
        "neuronfx": __version__, "neuronfx_source": source_fingerprint(), "torch": torch.__version__,
        "python": platform.python_version(), "backend": backend, "machine": platform.machine(),
    }


def plan_sha256(plan: Plan) -> str:
    """sha256 hex of the plan's JSON (what a manifest records of its plan)."""
    return hashlib.sha256(plan_to_json(plan).encode()).hexdigest()


def flatten_weights(weights: dict) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, str]]:
    """(unique tensors by neuronfx name, aliases name -> name, quantized name -> record class):
    tied weights are stored once; a quantized record (``graphs/quant.py``) named n is stored as
    its fields' tensors ``n.<field>`` and listed in the third dict. A field holding a tensor
    already stored (a packed LM head's row-major values are its tied embedding's) is an alias
    ``n.<field>`` -> that tensor's flat name."""
    named = {k: t for k, t in weights.items() if k != "layers"}
    for i, lw in enumerate(weights["layers"]):
        named |= {f"layers.{i}.{k}": t for k, t in lw.items()}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    quantized: dict[str, str] = {}
    owner: dict[int, str] = {}  # first tensor of a weight -> the weight's name
    stored: dict[tuple[int, tuple[int, ...], torch.dtype], str] = {}  # a stored tensor -> its flat name
    for name, t in named.items():
        first = t[0] if isinstance(t, QUANTIZED_TYPES) else t
        if first.data_ptr() in owner:
            aliases[name] = owner[first.data_ptr()]
            continue
        owner[first.data_ptr()] = name
        parts = {f"{name}.{field}": part for field, part in zip(t._fields, t)} if isinstance(t, QUANTIZED_TYPES) else {name: t}
        if isinstance(t, QUANTIZED_TYPES):
            quantized[name] = type(t).__name__
        for flat, part in parts.items():
            key = (part.data_ptr(), tuple(part.shape), part.dtype)
            if key in stored:
                aliases[flat] = stored[key]
                continue
            stored[key] = flat
            unique[flat] = part.contiguous()
    return unique, aliases, quantized


def unflatten_weights(flat: dict[str, torch.Tensor], aliases: Mapping[str, str], quantized: Mapping[str, str]) -> dict[str, object]:
    """Inverse of :func:`flatten_weights` on the flat names: field aliases resolved (one tensor
    shared again), records reassembled, aliases pointing at their target. Raises ArtifactError
    for an unknown record class or a missing part."""
    records = {cls.__name__: cls for cls in QUANTIZED_TYPES}
    fields = {name: target for name, target in aliases.items() if name.rpartition(".")[0] in quantized}
    missing = {t for t in fields.values() if t not in flat}
    if missing:
        raise ArtifactError(f"{MANIFEST} aliases weights {sorted(missing)} that {WEIGHTS} does not hold; re-save the runtime.")
    out: dict[str, object] = dict(flat) | {name: flat[target] for name, target in fields.items()}
    for name, cls_name in quantized.items():
        cls = records.get(cls_name)
        parts = [f"{name}.{field}" for field in (cls._fields if cls else ())]
        if cls is None or not all(p in out for p in parts):
            raise ArtifactError(f"quantized weight {name!r} ({cls_name!r}) is unknown or incomplete in {WEIGHTS}; re-save the runtime.")
        out[name] = cls(*(out.pop(p) for p in parts))
    aliases = {name: target for name, target in aliases.items() if name not in fields}
    unknown = {t for t in aliases.values() if t not in out}
    if unknown:
        raise ArtifactError(f"{MANIFEST} aliases weights {sorted(unknown)} that {WEIGHTS} does not hold; re-save the runtime.")
    for name, target in aliases.items():
        out[name] = out[target]
    return out


def sha256(path: Path) -> str:
    """sha256 hex of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _tree_files(directory: Path, prefix: str) -> list[str]:
    """Relative names of the plain files under ``directory`` (skipping locks and bytecode)."""
    return sorted(
        f"{prefix}/{p.relative_to(directory).as_posix()}" for p in directory.rglob("*")
        if p.is_file() and not p.name.endswith(_SKIPPED_SUFFIXES) and "__pycache__" not in p.parts
    )


def write_graph_files(runtime: Runtime, out: Path) -> list[str]:
    """Write the backend's graph files of ``runtime`` under ``out``; returns their relative
    names. Raises ArtifactError when the backend cannot (e.g. its compiled files are gone)."""
    plan = runtime.plan
    return get_backend(plan.inference.backend).save(plan, runtime.graphs, runtime.compiled_dir, out)


def write_manifest(out: Path, plan: Plan, files: list[str], aliases: Mapping[str, str] | None = None,
                   quantized: Mapping[str, str] | None = None) -> None:
    """Write ``out/manifest.json``: format, environment (:func:`environment`), plan hash, tied
    weight aliases, quantized weight records and the sha256 of each of ``files`` (relative to ``out``)."""
    manifest = {
        "format": FORMAT_VERSION,
        "environment": environment(plan.inference.backend),
        "plan_sha256": plan_sha256(plan),
        "aliases": dict(aliases or {}),
        "quantized": dict(quantized or {}),
        "files": {f: sha256(out / f) for f in files},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def save(runtime: Runtime, directory: str | os.PathLike, tokenizer: Any = None) -> Path:
    """Write ``runtime`` to ``directory`` (created; existing files of the same names are
    replaced). Returns the directory.

    ``tokenizer``: a transformers tokenizer, written with ``save_pretrained`` to ``tokenizer/``
    so the directory is all ``neuronfx generate --model DIR`` needs. Sizes: the weights once
    (bytes of the unique tensors) plus the graph files (inductor: its kernel cache, tens of MB).
    Everything is written to a temporary directory beside ``directory`` first and moved into
    place only when complete, so a failure leaves an existing saved runtime as it was.
    A tensor-parallel runtime (tp_degree > 1) is saved by every rank into
    ``directory/rank-<r>/`` (its plan, weight shard and graphs); :func:`load` on ``tp_degree``
    ranks reads them back. ``save`` returns on a rank only when every rank has written its
    part, so any rank may load the directory next.
    Raises InputError when ``runtime`` is not a Runtime; ArtifactError when ``directory`` is a
    file, holds files but no saved runtime, or cannot be written, an inductor runtime's compiled
    files were deleted, the tokenizer cannot be saved, or the runtime has a draft runtime attached
    (save each; attach again with ``with_draft``); TensorParallelError when the ranks were given different directories.
    """
    if not isinstance(runtime, Runtime):
        raise InputError(f"runtime is a {type(runtime).__name__}; pass the Runtime neuronfx.compile or neuronfx.load returned.")
    if runtime.draft is not None:
        raise ArtifactError("this runtime has a draft runtime attached; save each on its own (neuronfx.save(runtime.draft, dir2)) "
                            "and attach it again after loading with neuronfx.with_draft(runtime, draft).")
    out = Path(directory)
    if runtime.plan.tp_degree > 1:  # every rank saves its shard (and graphs) beside the others
        out = out / rank_dir_name(runtime.plan.rank)
    check_save_target(out)
    _write_then_move(runtime, out, tokenizer)
    if runtime.plan.tp_degree > 1:  # a barrier: no rank loads before every part is written, and all wrote to one place
        distributed.check_agreement("save directory", distributed.digest(str(Path(directory).resolve())))
    return out


def check_save_target(out: Path) -> None:
    """Raise ArtifactError when ``out`` is a file, or holds files but no saved runtime (a checkpoint, say)."""
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{str(out)!r} is a file; save to a directory (new, or one holding a saved runtime).")
    if out.is_dir() and not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise ArtifactError(f"{str(out)!r} holds files but no saved runtime (no {MANIFEST}); saving would overwrite them: use a new dir.")


def _write_then_move(runtime: Runtime, out: Path, tokenizer: Any) -> None:
    """Write every file into a temporary directory beside ``out``, then move them into ``out``,
    the manifest last: a failure leaves what ``out`` held as it was."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-saving-", dir=out.parent))
    except OSError as exc:
        raise ArtifactError(f"cannot write in {str(out.parent)!r} ({exc.strerror or exc}); save to a directory you can write.") from exc
    try:
        _write_all(runtime, tmp, tokenizer)
        out.mkdir(exist_ok=True)
        for item in sorted(tmp.iterdir(), key=lambda p: p.name == MANIFEST):
            target = out / item.name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(item, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_all(runtime: Runtime, out: Path, tokenizer: Any) -> None:
    """Every file of a saved runtime, into the empty directory ``out``."""
    plan = runtime.plan
    files = write_graph_files(runtime, out)
    (out / PLAN).write_text(plan_to_json(plan))
    unique, aliases, quantized = flatten_weights(runtime.weights)
    save_file(unique, str(out / WEIGHTS))
    generation = {"eos_token_id": list(plan.model.eos_token_ids), "max_length": plan.inference.sequence_length}
    (out / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2))
    files += [PLAN, WEIGHTS, GENERATION_CONFIG]
    if tokenizer is not None:
        try:
            tokenizer.save_pretrained(str(out / TOKENIZER_DIR))
        except (AttributeError, TypeError, OSError) as exc:
            raise ArtifactError(f"tokenizer={tokenizer!r:.60} could not be saved ({exc}); pass a transformers tokenizer.") from exc
        files += _tree_files(out / TOKENIZER_DIR, TOKENIZER_DIR)
    write_manifest(out, plan, files, aliases, quantized)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest, checked: format, environment, every file present with its sha256. Raises
    ArtifactError naming what was expected, what was found and how to rebuild."""
    path = directory / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{str(directory)!r} has no {MANIFEST}; it is not a saved neuronfx runtime (neuronfx.save / neuronfx compile).")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} does not parse ({exc}); re-save the runtime.") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        found = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise ArtifactError(f"{path}: format {found!r}, this neuronfx reads format {FORMAT_VERSION}; rebuild it with neuronfx.save.")
    shapes = {"environment": dict, "files": dict, "aliases": dict, "quantized": dict, "plan_sha256": str}
    for key, kind in shapes.items():
        if not isinstance(manifest.get(key), kind):
            raise ArtifactError(f"{path}: {key!r} is {manifest.get(key)!r:.60}, expected a {kind.__name__}; re-save the runtime.")
    if PLAN not in manifest["files"]:
        raise ArtifactError(f"{path} lists no sha256 for {PLAN}; re-save the runtime.")
    found = manifest["environment"]
    want = environment(found.get("backend", ""))
    for key in ("neuronfx", "torch", "python", "machine"):  # neuronfx_source: informative (cache keys use it)
        if found.get(key) != want[key]:
            raise ArtifactError(
                f"{directory} was built with {key} {found.get(key)!r}, this process has {want[key]!r}; its compiled "
                "graphs may not load: rebuild it here with neuronfx.save(neuronfx.compile(plan, state_dict), dir) "
                "or `neuronfx compile MODEL --out DIR`."
            )
    for name, digest in manifest["files"].items():
        file = directory / name
        if not file.is_file():
            raise ArtifactError(f"{directory}: {name} is missing; re-save the runtime.")
        if sha256(file) != digest:
            raise ArtifactError(f"{directory}: {name} is corrupt (sha256 differs from the manifest); re-save the runtime.")
    return manifest


def read_plan(directory: Path, manifest: Mapping[str, Any]) -> Plan:
    """plan.json, structured and checked against the manifest's plan hash."""
    plan = plan_from_json((directory / PLAN).read_text())
    if plan_sha256(plan) != manifest.get("plan_sha256"):
        raise ArtifactError(f"{directory / PLAN} does not match the manifest's plan hash; re-save the runtime.")
    return plan


def resolve(source: str | os.PathLike) -> Path:
    """A local directory, or a hub repo id ("owner/name", no such local path) fetched with
    ``huggingface_hub.snapshot_download`` (its cache; honours HF_HUB_OFFLINE and HF_HUB_CACHE).
    Raises ArtifactError when neither exists."""
    if not isinstance(source, (str, os.PathLike)):
        raise InputError(f"source={source!r:.60} must be a directory path or a hub repo id (a str).")
    path = Path(source)
    if path.exists() or not looks_like_repo_id(str(source)):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id=str(source)))
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        raise ArtifactError(
            f"{str(source)!r} is neither a local directory nor a hub repo that could be fetched ({type(exc).__name__}: {exc}); "
            "check the path or repo id (offline, with HF_HUB_OFFLINE=1, the repo must already be in the hub cache)."
        ) from exc


def looks_like_repo_id(text: str) -> bool:
    """"owner/name": two non-empty parts, not a relative or absolute path spelling."""
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/", "~"))


def load(source: str | os.PathLike) -> Runtime:
    """Load a runtime saved by :func:`save` from a directory or a hub repo id (see
    :func:`resolve`). Every file is verified before anything runs; raises ArtifactError
    (missing/corrupt file, a malformed manifest, other versions, source or machine, repo not
    found), ConfigError (a plan.json that does not structure, e.g. an unknown key; a
    tensor-parallel runtime loaded outside ``tp_degree`` ranks: it is not resharded; a CUDA
    device this machine lacks) or
    InputError (``source`` not a path or repo id)."""
    src = rank_dir(resolve(source))
    manifest = read_manifest(src)
    if WEIGHTS not in manifest["files"]:
        raise ArtifactError(f"{src / MANIFEST} lists no sha256 for {WEIGHTS}; it is a compile-cache entry or damaged: re-save the runtime.")
    plan = read_plan(src, manifest)
    check_device(plan.inference)  # before the weights are read
    flat = unflatten_weights(load_file(str(src / WEIGHTS)), manifest["aliases"], manifest["quantized"])
    weights = to_device(nest(flat, plan.model.num_hidden_layers), plan_device(plan))
    return build_runtime(plan, weights, get_backend(plan.inference.backend).load(plan, weights, src))


def rank_dir_name(rank: int) -> str:
    """Sub-directory of a tensor-parallel saved runtime holding rank ``rank``'s part."""
    return f"rank-{rank}"


def first_dir(src: Path) -> Path:
    """The directory holding a saved runtime's manifest: ``src``, or for a tensor-parallel
    runtime its rank 0 part (all ranks share the plan but the rank)."""
    if not (src / MANIFEST).is_file() and (src / rank_dir_name(0) / MANIFEST).is_file():
        return src / rank_dir_name(0)
    return src


def rank_dir(src: Path) -> Path:
    """The part of the saved runtime in ``src`` this process loads: ``src`` itself, or for a
    tensor-parallel runtime this rank's ``rank-<r>/`` after joining the process group of its
    ``tp_degree`` ranks (ConfigError when this process is not one of them)."""
    first = first_dir(src)
    if first == src:
        return src
    try:
        tp = plan_from_json((first / PLAN).read_text()).inference.tp_degree
    except OSError as exc:
        raise ArtifactError(f"cannot read {first / PLAN}: {exc}; re-save the runtime.") from exc
    missing = [rank_dir_name(r) for r in range(tp) if not (src / rank_dir_name(r) / MANIFEST).is_file()]
    if missing:
        raise ArtifactError(f"{src} is a tensor-parallel runtime of {tp} ranks but lacks {missing}; save it again from all ranks.")
    return src / rank_dir_name(init_tensor_parallel(tp))


def load_tokenizer(source: str | os.PathLike) -> Any:
    """The tokenizer saved with a runtime (``save(..., tokenizer=)``), from a directory or hub
    repo id. Raises ArtifactError when the artifact has none."""
    src = first_dir(resolve(source))
    if not (src / TOKENIZER_DIR).is_dir():
        raise ArtifactError(f"{src} has no {TOKENIZER_DIR}/; save the runtime with neuronfx.save(runtime, dir, tokenizer=tok).")
    from neuronfx.io.checkpoints import load_tokenizer as load_dir_tokenizer

    return load_dir_tokenizer(src / TOKENIZER_DIR)


def push_to_hub(directory: str | os.PathLike, repo_id: str, token: str | None = None, private: bool = False,
                commit_message: str = "neuronfx saved runtime") -> str:
    """Upload a saved runtime directory to the hub repo ``repo_id`` (created if missing) with
    ``huggingface_hub.HfApi.upload_folder``; returns the commit URL. The directory is verified
    first (raises ArtifactError when it is not a complete saved runtime)."""
    src = Path(directory)
    read_manifest(src)
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id=repo_id, private=private, exist_ok=True)
    return str(api.upload_folder(folder_path=str(src), repo_id=repo_id, commit_message=commit_message))

