"""HF ``model_type`` -> the flat file implementing its math, ``neuronfx/graphs/<model_type>.py``.

The supported types are the registry ``neuronfx.config.families.FAMILIES``; each family file
provides ``key_map(cfg)`` (HF checkpoint name -> neuronfx weight name), ``layer_shapes(cfg)``
(per-layer weight shapes) and ``decoder_layer(cfg, ops, lw, h, cos, sin, attend)``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from neuronfx.config.families import SUPPORTED_MODEL_TYPES, unsupported_model_type


def model_module(model_type: str) -> ModuleType:
    """The family file of ``model_type``; raises UnsupportedModelError for a type outside the
    registry."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise unsupported_model_type(model_type)
    # The registry names the file: a new family is its registry entry plus graphs/<model_type>.py.
    return importlib.import_module(f"neuronfx.graphs.{model_type}")
