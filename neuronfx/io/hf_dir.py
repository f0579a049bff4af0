"""HF checkpoint directories: ``config.json``, ``generation_config.json`` and safetensors
(one file or shards listed by an index), read offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import safetensors
import torch

from neuronfx.config.families import SUPPORTED_MODEL_TYPES, unsupported_model_type
from neuronfx.config.model import ModelConfig
from neuronfx.errors import CheckpointError
from neuronfx.io.checkpoint_record import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    SAFETENSORS_INDEX_NAME,
    SAFETENSORS_NAME,
    Checkpoint,
    LazyTensor,
    check_keys,
    read_json,
)
from neuronfx.io.sentence_transformers import causal_lm_layout


def load_hf_dir(directory: Path, dtype: torch.dtype, lazy: bool = False) -> Checkpoint:
    hf_config = _read_hf_config(directory)
    generation_config = _read_generation_config(directory)
    config = ModelConfig.from_hf(hf_config, generation_config)
    state_dict = causal_lm_layout(_read_safetensors_dir(directory, dtype, lazy), config.tie_word_embeddings)  # Qwen3-Embedding's too
    check_keys(state_dict, config, directory)
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
    raw = read_json(config_file)
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
    index = read_json(index_file)
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


