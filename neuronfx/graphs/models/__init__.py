"""Model math: one flat file per HF ``model_type`` (or, for a type whose math is another's, the
file ``config.families.MODEL_REMAPPING`` names), the shared layer math (``layers.py``), the
mixture-of-experts MLP (``moe.py``), the quantized weight records (``quant.py``) and the ops
bundle's type (``ops.py``).

The supported types are the registry ``neuronfx.config.families.FAMILIES``; each family file
ends with ``MATH``, a :class:`~neuronfx.graphs.models.family.FamilyMath` record (key map,
layer shapes, decoder layer and the hooks the phases call), which :func:`family_math` returns.
"""

from __future__ import annotations

import importlib

from neuronfx.config.families import math_file
from neuronfx.graphs.models.family import FamilyMath


def family_math(model_type: str) -> FamilyMath:
    """The math of ``model_type``: ``MATH`` of ``graphs/models/<file>.py``, the file named by the
    type or by ``MODEL_REMAPPING`` (mlx-lm's lookup); UnsupportedModelError for a type outside
    the registry."""
    # The registry names the file: a new family is its registry entry plus models/<model_type>.py.
    return importlib.import_module(f"neuronfx.graphs.models.{math_file(model_type)}").MATH
