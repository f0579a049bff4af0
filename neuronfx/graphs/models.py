"""Registry: HF ``model_type`` -> the flat model file implementing it."""

from __future__ import annotations

from types import ModuleType

from neuronfx.errors import UnsupportedModelError
from neuronfx.graphs import llama, mistral, qwen2, qwen3

MODEL_FILES: dict[str, ModuleType] = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3}


def model_module(model_type: str) -> ModuleType:
    """The model file for ``model_type``; raises UnsupportedModelError for others."""
    if model_type not in MODEL_FILES:
        raise UnsupportedModelError(f"model_type={model_type!r} is not supported; supported: {sorted(MODEL_FILES)}.")
    return MODEL_FILES[model_type]
