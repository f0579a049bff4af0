"""The one table of dtype names neuronfx accepts, with their torch dtypes.

Configs, plans and step-input specs name dtypes by these strings (the torch attribute names);
everything that needs the torch dtype or its size reads it here.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
"""Dtypes of weights, activations and the KV cache (``InferenceConfig.dtype``)."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "int32": torch.int32, "bool": torch.bool, "int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn,
}
"""Every dtype name a config or a step-input spec may use -> its torch dtype."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (a key of :data:`DTYPES`); KeyError for others."""
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the spelling configs and error messages use."""
    return str(dtype).removeprefix("torch.")


def dtype_bytes(name: str) -> int:
    """Bytes per element of the dtype named ``name``."""
    return DTYPES[name].itemsize
