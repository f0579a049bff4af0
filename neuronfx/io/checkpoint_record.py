"""A checkpoint as read: the :class:`Checkpoint` record, :class:`LazyTensor` handles, the
checks both formats share, and the file names of an HF directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import safetensors
import torch

from neuronfx.config.model import ModelConfig
from neuronfx.errors import CheckpointError, ConfigError
from neuronfx.io.weights import check_state_dict

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
GGUF_SUFFIX = ".gguf"
# Non-persistent RoPE buffers that transformers < 4.31 wrote into checkpoints; never weights.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)



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


def check_keys(state_dict: dict[str, Any], config: ModelConfig, source: Path, kept: dict[str, str] | None = None) -> None:
    """Drop ignorable buffers in place, then the one checkpoint check
    (``graphs.weights.check_state_dict``): CheckpointError for missing, extra or mis-shaped
    tensors (``lm_head.weight`` may be absent when the embeddings are tied). Block records
    are checked by their logical (N, K) ``shape`` (``graphs.quant``)."""
    for name in [n for n in state_dict if n.endswith(IGNORED_SUFFIXES)]:
        del state_dict[name]
    check_state_dict(state_dict, config, source=repr(str(source)))


def check_dtype(dtype: torch.dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype={dtype!r} is not a floating torch.dtype; pass e.g. torch.float32 or torch.bfloat16.")


def read_json(file: Path) -> Any:
    """The JSON value of ``file``; CheckpointError when it cannot be read or parsed."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read JSON file {str(file)!r}: {exc}; fix or regenerate it.") from exc
