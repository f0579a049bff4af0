"""GGUF checkpoints: read by ``neuronfx.io.gguf_file``, mapped with transformers' own tables
(``modeling_gguf_pytorch_utils.load_gguf_checkpoint``, ``integrations/ggml.py``,
``integrations/gguf/``), so the tensors equal what transformers loads from the same file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from neuronfx.config.families import SUPPORTED_MODEL_TYPES, unsupported_model_type
from neuronfx.config.model import ModelConfig
from neuronfx.errors import CheckpointError, UnsupportedModelError
from neuronfx.graphs.models import family_math
from neuronfx.graphs.models.moe import STACKED_NAMES
from neuronfx.graphs.models.quant import FORMAT_NAMES, Q4_0Blocks, Q4_1Blocks, Q8_0Blocks, QuantizedWeight
from neuronfx.io import gguf_file
from neuronfx.io.checkpoint_record import Checkpoint, check_keys
from neuronfx.io.weights import expand_key_map


def load_gguf(file: Path, dtype: torch.dtype, gguf_blocks: bool = False) -> Checkpoint:
    gf = _read_gguf(file)
    architecture, config_dict = _gguf_config_dict(gf, file)
    hf_config = _gguf_hf_config(config_dict, file)
    config = ModelConfig.from_hf(hf_config)
    names = _gguf_hf_names(architecture, config)
    # No trim_heap here: the dequantizer's temporaries are 1 MB chunks (gguf_file.DEQUANT_CHUNK),
    # and its gc.collect would cost 0.2 s of the load for about 25 MB.
    state_dict, kept = _gguf_tensors(gf, names, architecture, config_dict, dtype, gguf_blocks)
    check_keys(state_dict, config, file, kept)
    return Checkpoint(config=config, state_dict=state_dict, source=str(file), hf_config=hf_config, kept_blocks=kept,
                      gguf_types={names[n]: t.ggml_type.name for n, t in gf.tensors.items() if n in names})


def _read_gguf(file: Path) -> gguf_file.GGUFFile:
    try:
        return gguf_file.read_gguf(file)
    except (OSError, ValueError) as exc:  # GGUFFormatError is a ValueError; mmap of an empty file too
        raise CheckpointError(f"cannot read GGUF file {str(file)!r}: {exc}; copy the file again (or convert the model again).") from exc


def _gguf_config_dict(gf: gguf_file.GGUFFile, file: Path) -> tuple[str, dict[str, Any]]:
    """(the file's ``general.architecture``, the transformers config dict): what
    ``load_gguf_checkpoint(path, return_tensors=False)["config"]`` builds from GGUFReader's
    fields, step for step, for the architectures neuronfx runs (the t5 / stablelm / lfm2 /
    gpt-oss / minimax steps are left out: those model types are refused here)."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, GGUF_TO_TRANSFORMERS_MAPPING

    metadata = gf.metadata
    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, str):
        raise CheckpointError(f"{str(file)!r} has no string general.architecture in its metadata; it is not a model GGUF.")
    updated = _gguf_architecture(architecture, metadata.get("general.name"))
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES and updated not in GGUF_SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {architecture!r} of {str(file)!r} has no transformers config mapping; "
            f"neuronfx reads GGUF files of {', '.join(SUPPORTED_MODEL_TYPES)} models."
        )
    parsed: dict[str, dict[str, Any]] = {"config": {}, "tokenizer": {}}
    parsed["config"]["tie_word_embeddings"] = "output.weight" not in gf.tensors or architecture in ("falcon", "bloom")
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {}).items():
        parsed["config"].setdefault(key, value)
    for gguf_key, raw in metadata.items():
        prefix, _, config_key = gguf_key.replace(architecture, updated).partition(".")
        value = raw[0] if isinstance(raw, list) and len(raw) == 1 else raw  # transformers unwraps one-element lists
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, updated)
        for parameter in parsed:
            renames = GGUF_TO_TRANSFORMERS_MAPPING[parameter]
            renamed = renames.get(prefix, {}).get(config_key)  # absent, None and -1: not a config field
            if renamed is not None and renamed != -1:
                parsed[parameter][renamed] = value
    config = parsed["config"]
    if config.get("model_type") == "gemma3":  # the file holds the text model only
        config["model_type"] = "gemma3_text"
    if "vocab_size" not in config and "tokens" in parsed["tokenizer"]:
        config["vocab_size"] = len(parsed["tokenizer"]["tokens"])
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise unsupported_model_type(str(config.get("model_type")), f" (GGUF architecture {architecture!r} of {str(file)!r})")
    return architecture, config


def _gguf_architecture(architecture: str, name: object) -> str:
    """transformers' name for a GGUF architecture (load_gguf_checkpoint's renames): llama.cpp
    writes mistral models as "llama" (transformers tells them by ``general.name == "mistral"``)
    and spells some MoE architectures without the underscore."""
    if "llama" in architecture and name == "mistral":
        return "mistral"
    return next((new for old, new in _GGUF_ARCH_RENAMES.items() if old in architecture), architecture)


_GGUF_ARCH_RENAMES = {"qwen2moe": "qwen2_moe", "gpt_oss": "gpt_oss", "gpt-oss": "gpt_oss", "qwen3moe": "qwen3_moe", "minimax-m2": "minimax_m2"}


def _gguf_hf_config(config_dict: dict[str, Any], file: Path) -> Any:
    """The transformers config ``AutoConfig.from_pretrained(dir, gguf_file=name)`` makes of
    ``config_dict`` (its class's ``from_dict``, ``name_or_path`` the file's directory)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[config_dict["model_type"]].from_dict(dict(config_dict), name_or_path=str(file.parent))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"transformers cannot make a config of the metadata of {str(file)!r}: {exc}; the file is corrupt.") from exc


def _gguf_hf_names(architecture: str, config: ModelConfig) -> dict[str, str]:
    """GGUF tensor name -> HF name: transformers' ``get_gguf_hf_weights_map`` over the HF names
    neuronfx expects (``graphs.weights.expand_key_map``; for MoE families the fused expert
    names transformers' model holds instead of neuronfx's stacked ones), with one gguf-py
    ``TensorNameMap`` (transformers builds one per module of a meta model, the slow part) and
    the architecture's tensor processor hooks (``preprocess_name``, fallback mapping)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise UnsupportedModelError(f"GGUF architecture {architecture!r} has no tensor name map in the installed gguf package; upgrade gguf.")
    name_map = get_tensor_name_map(arch, config.num_hidden_layers)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)()
    out: dict[str, str] = {}
    for hf_name in _hf_names(config):
        hf_name = processor.preprocess_name(hf_name)
        base, suffix = hf_name, ""
        if hf_name.endswith((".weight", ".bias")):
            base, suffix = hf_name.rsplit(".", 1)
            suffix = "." + suffix
        gguf_name = name_map.get_name(base)
        if gguf_name is None:
            processor.perform_fallback_tensor_mapping(out, suffix, "", hf_name)
        else:
            out[gguf_name + suffix] = hf_name
    return out


def _hf_names(config: ModelConfig) -> list[str]:
    """The HF names of ``config``'s weights as transformers' model names them."""
    names = list(expand_key_map(config))
    if not config.num_experts:
        return names
    sources = family_math(config.model_type).expert_sources
    stacked = {STACKED_NAMES[part].format(i=i) for part in ("gate", "up") for i in range(config.num_hidden_layers)}
    return [n for n in names if n not in stacked] + [sources.fused_gate_up.format(i=i) for i in range(config.num_hidden_layers)]


def _gguf_tensors(
    gf: gguf_file.GGUFFile, names: dict[str, str], architecture: str, config_dict: dict[str, Any], dtype: torch.dtype, gguf_blocks: bool
) -> tuple[dict[str, Any], dict[str, str]]:
    """(HF name -> tensor in ``dtype`` or block record, HF name -> kept block format): the
    tensor loop of ``load_gguf_checkpoint(return_tensors=True)`` (dequantize, the
    architecture's ``TensorProcessor.process``, skip what no HF name claims), with
    ``gguf_file.dequantize`` for gguf's; with ``gguf_blocks`` every 2-D Q4_0 / Q4_1 / Q8_0
    tensor the processor only reorders the rows of is kept as :mod:`graphs.quant` blocks."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config_dict)
    parsed: dict[str, dict[str, Any]] = {"tensors": {}}
    kept: dict[str, str] = {}
    for name, tensor in gf.tensors.items():
        blocks = _gguf_blocks(tensor, processor) if gguf_blocks and name in names else None
        if blocks is not None:
            parsed["tensors"][names[name]] = blocks
            kept[names[name]] = FORMAT_NAMES[type(blocks)]
            continue
        try:
            weights = gguf_file.dequantize(tensor)
        except ValueError as exc:
            raise CheckpointError(f"cannot read tensor {name!r} of {gf.path!r}: {exc}.") from exc
        result = processor.process(weights=weights, name=name, tensor_key_mapping=names, parsed_parameters=parsed)
        if result.name in names:
            parsed["tensors"][names[result.name]] = torch.from_numpy(np.ascontiguousarray(result.weights)).to(dtype)
    tensors = parsed["tensors"]
    return {n: t if n in kept else t.to(dtype) for n, t in tensors.items()}, kept


def _gguf_blocks(tensor: gguf_file.GGUFTensor, processor: Any) -> QuantizedWeight | None:
    """``tensor``'s blocks as a Q4_0Blocks / Q4_1Blocks / Q8_0Blocks of uint8 (N, K / 32 *
    block bytes), a view of the file's bytes, or None when it is not a 2-D tensor of those
    types or the processor does more than reorder its rows. The processor is asked what it
    does to row indices (llama's Q/K un-permutation, ``LlamaTensorProcessor``, is a row
    permutation; blocks never cross rows, so reordering rows of blocks is exact)."""
    record = _BLOCK_RECORDS.get(tensor.ggml_type)
    if record is None or len(tensor.shape) != 2:
        return None
    n = tensor.shape[0]
    probe = processor.process(weights=np.arange(n).reshape(n, 1), name=tensor.name)
    order = np.asarray(probe.weights)
    if probe.name != tensor.name or order.shape != (n, 1) or not np.array_equal(np.sort(order[:, 0]), np.arange(n)):
        return None
    data = gguf_file.rows(tensor)
    if not np.array_equal(order[:, 0], np.arange(n)):
        data = data[order[:, 0]]  # a copy: only the rows the processor reorders
    return record(torch.from_numpy(data))


_BLOCK_RECORDS = {
    gguf_file.T.Q4_0: Q4_0Blocks,
    gguf_file.T.Q4_1: Q4_1Blocks,
    gguf_file.T.Q8_0: Q8_0Blocks,
}


def gguf_tokenizer(file: Path) -> Any:
    """The tokenizer ``AutoTokenizer.from_pretrained(dir, gguf_file=name)`` returns: the class
    it picks for the file's model type (``TOKENIZER_MAPPING``, else ``TokenizersBackend``)
    loaded with ``gguf_file`` (transformers' fast metadata reader and GGUF tokenizer
    converters), without AutoTokenizer's detour through the legacy config reader."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    model_type = _gguf_config_dict(_read_gguf(file), file)[1]["model_type"]
    tokenizer_class = TOKENIZER_MAPPING.get(CONFIG_MAPPING[model_type], None) or TokenizersBackend
    try:
        return tokenizer_class.from_pretrained(str(file.parent), gguf_file=file.name, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"transformers cannot build the tokenizer of {str(file)!r} from its metadata: {exc}; the file's "
            "tokenizer.ggml.* keys are missing or of a tokenizer type transformers does not convert."
        ) from exc


