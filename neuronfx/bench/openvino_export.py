"""The OpenVINO IR that ``neuronfx bench latency --compare openvino`` runs: the benchmark's own
weights exported once with optimum-intel and kept in neuronfx's cache directory.

Route: the checkpoint (a .gguf file is dequantized as ``neuronfx.io.checkpoints`` reads it, equal
to what transformers' GGUF loader holds) -> the transformers model of those weights in float32
(``neuronfx.bench.timing.transformers_model``, the benchmark's transformers reference) ->
``save_pretrained`` to a temporary HF directory -> ``optimum.intel.OVModelForCausalLM
.from_pretrained(dir, export=True, quantization_config=...)`` (optimum-intel's stateful
text-generation export; its weight compression runs nncf) -> ``save_pretrained`` of the IR. No
tokenizer is converted: the benchmark passes token ids.

Weights (:func:`ov_weights`, from neuronfx's ``--weight-format``):

- ``float``: fp32, uncompressed (``load_in_8bit=False``: optimum-intel's default int8 for models
  over 1B parameters is off);
- ``int8``: ``int8_asym`` per output channel (optimum-intel's int8 default, ``bits=8, sym=False``);
- ``int4``: ``int4_asym`` with ``--weight-group-size`` values per group; ``gguf``: ``int4_asym``
  group 32, as the Q4_1 blocks of SmolLM2's file (scale and offset per 32 values). Both with
  ``ratio=1.0`` (every matrix 4-bit), except what nncf keeps at its int8 backup precision:
  the embedding and LM head (one tied matrix in SmolLM2), ``int8_asym`` per channel.

Cache: ``<neuronfx cache dir>/openvino/<key>/`` (``$NEURONFX_CACHE_DIR``, default
``~/.cache/neuronfx``), the key a sha256 of :func:`export_key` (the source's bytes, the weight
format, the versions of optimum-intel, nncf, openvino, transformers and torch, and
:data:`RECIPE`), written to a temporary directory and renamed into place, so an entry is
complete or absent. ``key.json`` holds the key's components and the export's seconds.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import attrs

from neuronfx.bench.options import Log
from neuronfx.errors import BackendUnavailableError, InputError

EXTRA = "bench-openvino"
INSTALL_HINT = (f"pip install 'neuronfx[{EXTRA}]' (the OpenVINO benchmark extra: openvino-genai, optimum-intel[openvino], "
                "nncf; optimum-intel 2.2 pins transformers < 5.6, so pip may install an older transformers)")
EXPORTER_PACKAGES = ("optimum-intel", "nncf", "openvino", "transformers", "torch")
"""The distributions whose versions key an exported IR."""
RECIPE = 1
"""Bumped when the export route or its options change, so older entries are not reused."""
IR_FILE = "openvino_model.xml"
KEY_FILE = "key.json"


@attrs.frozen(kw_only=True)
class OVWeights:
    """How the exported IR stores its weights: ``bits`` None (fp32, uncompressed), 8 or 4;
    ``group_size`` values per scale and offset along the input dim, -1 per output channel."""

    bits: int | None
    group_size: int = -1

    @property
    def name(self) -> str:
        """"fp32", "int8_asym" or "int4_asym_g32": the label the engine's results carry."""
        if self.bits is None:
            return "fp32"
        return f"int{self.bits}_asym" + (f"_g{self.group_size}" if self.group_size > 0 else "")


def ov_weights(weight_format: str, group_size: int) -> OVWeights:
    """The IR weights that stand for neuronfx's ``weight_format`` (see the module docstring);
    ``group_size`` is ``--weight-group-size`` (used by int4 only). Raises InputError for an
    unknown format."""
    if weight_format == "float":
        return OVWeights(bits=None)
    if weight_format == "int8":
        return OVWeights(bits=8)
    if weight_format == "int4":
        return OVWeights(bits=4, group_size=group_size)
    if weight_format == "gguf":
        return OVWeights(bits=4, group_size=32)  # a GGUF Q4_0 / Q4_1 block is 32 values
    raise InputError(f"--weight-format {weight_format!r} has no OpenVINO counterpart; use float, int8, int4 or gguf.")


def check_exporter() -> None:
    """BackendUnavailableError naming the extra when optimum-intel or nncf is not installed
    (found without importing them: optimum-intel imports transformers and torch)."""
    missing = [name for name, module in (("optimum-intel", "optimum.intel"), ("nncf", "nncf")) if not _installed(module)]
    if missing:
        raise BackendUnavailableError(f"the OpenVINO engines (bench latency --compare openvino, bench engines --engines openvino-*) "
                                      f"need {' and '.join(missing)} to export the weights: "
                                      f"{INSTALL_HINT}.")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package (optimum) is absent
        return False


def import_exporter() -> tuple[Any, Any]:
    """``(OVModelForCausalLM, OVWeightQuantizationConfig)`` of optimum-intel. Raises
    BackendUnavailableError naming the extra when it is missing, and naming the installed
    transformers when optimum-intel is installed but cannot import with it (optimum-intel 2.2
    with transformers 5.25: a renamed qwen2_vl class)."""
    check_exporter()
    try:
        from optimum.intel import OVModelForCausalLM, OVWeightQuantizationConfig
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailableError(
            f"optimum-intel {_version('optimum-intel') or '(version unknown)'} cannot import with transformers {_version('transformers')}: "
            f"{type(exc).__name__}: {exc}. Install the versions pip resolves for the extra ({INSTALL_HINT}), e.g. in a "
            "virtual environment of its own.") from exc
    return OVModelForCausalLM, OVWeightQuantizationConfig


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def source_digest(source: Path) -> str:
    """sha256 hex over a checkpoint's bytes: a .gguf file, or a directory's config.json and
    safetensors files (names and contents, in name order)."""
    files = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.name == "config.json" or p.suffix == ".safetensors")
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode())
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def export_key(source: Path, weights: OVWeights) -> dict[str, Any]:
    """What keys an exported IR: the source's :func:`source_digest`, the weights, the exporter's
    versions (:data:`EXPORTER_PACKAGES`) and :data:`RECIPE`."""
    return {"source_sha256": source_digest(source), "weights": attrs.asdict(weights),
            "versions": {name: _version(name) for name in EXPORTER_PACKAGES}, "recipe": RECIPE}


def cached_ir(source: str, weights: OVWeights, root: Path, log: Log = print) -> Path:
    """The directory of the IR of ``source`` (checkpoint path) with ``weights`` under ``root``
    (the neuronfx cache directory): found, or exported now (:func:`export_ir`; SmolLM2-135M on 2
    shared cores: 36 s to int4, 83 s to fp32, measured once each). Raises
    BackendUnavailableError as :func:`import_exporter`; CheckpointError from reading ``source``."""
    components = export_key(Path(source), weights)
    key = hashlib.sha256(json.dumps(components, sort_keys=True).encode()).hexdigest()[:32]
    entry = root / "openvino" / key
    if (entry / IR_FILE).is_file():
        log(f"openvino: IR ({weights.name}) from the cache, {entry}")
        return entry
    log(f"openvino: exporting {source} to an OpenVINO IR ({weights.name}) with optimum-intel, once; cached at {entry}")
    tmp = entry.parent / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
    try:
        t0 = time.perf_counter()
        export_ir(source, weights, tmp)
        seconds = time.perf_counter() - t0
        (tmp / KEY_FILE).write_text(json.dumps({**components, "export_s": seconds}, indent=1, sort_keys=True))
        if not (entry / IR_FILE).is_file():  # another process may have finished the same entry first
            shutil.rmtree(entry, ignore_errors=True)
            tmp.rename(entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"openvino: exported in {seconds:.1f} s, {ir_bytes(entry) / 2**20:.1f} MiB")
    return entry


def ir_bytes(entry: Path) -> int:
    """Bytes of an IR directory's model files (``.xml`` and ``.bin``)."""
    return sum(p.stat().st_size for p in entry.iterdir() if p.suffix in (".xml", ".bin"))


def export_ir(source: str, weights: OVWeights, out: Path) -> None:
    """Export the checkpoint at ``source`` to an OpenVINO IR in ``out`` (see the module
    docstring for the route and the weights). Raises BackendUnavailableError as
    :func:`import_exporter`."""
    import torch

    from neuronfx.bench.timing import transformers_model
    from neuronfx.io import checkpoints

    model_cls, quant_cls = import_exporter()
    checkpoint = checkpoints.load_checkpoint(source, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as hf_dir:
        transformers_model(checkpoint, "float32").save_pretrained(hf_dir)
        del checkpoint
        gc.collect()
        quantization = None if weights.bits is None else quant_cls(bits=weights.bits, sym=False, group_size=weights.group_size,
                                                                   ratio=1.0)
        model = model_cls.from_pretrained(hf_dir, export=True, compile=False, load_in_8bit=False, quantization_config=quantization)
        model.save_pretrained(out)
    del model
    gc.collect()
