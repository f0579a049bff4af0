"""Decoder checkpoints saved as embedders: the sentence-transformers pooling config of a model
directory and the base-model tensor layout (Qwen3-Embedding's).

sentence-transformers lists a model's modules in ``modules.json`` (the transformer, a
``Pooling`` module whose ``config.json`` sets ``pooling_mode_lasttoken`` or
``pooling_mode_mean_tokens``, optionally ``Normalize``); :func:`pooling_config` reads them into
``InferenceConfig``'s ``pooling`` and ``normalize``. Embedders are often saved as the bare
decoder (transformers' ``Qwen3Model``: ``embed_tokens.weight``, ``layers.*``, ``norm.weight``,
no ``model.`` prefix and no LM head); :func:`causal_lm_layout` renames them to the causal-LM
names the loader checks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from neuronfx.errors import CheckpointError, UnsupportedModelError

MODULES_NAME = "modules.json"
POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}
"""sentence-transformers' pooling flags neuronfx's embed graphs compute, -> ``InferenceConfig.pooling``."""


def _read(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {str(path)!r}: {exc}; fix or regenerate the sentence-transformers config.") from exc


def pooling_config(directory: str | os.PathLike) -> dict[str, object] | None:
    """``{"pooling": "last" | "mean", "normalize": bool}`` from ``directory``'s
    sentence-transformers config (``modules.json`` and its Pooling module's ``config.json``), or
    None when it has none (not a directory, no ``modules.json``, no Pooling module). Raises
    CheckpointError for an unreadable file, UnsupportedModelError for a pooling mode other than
    last-token or mean (cls, max, weighted mean)."""
    root = Path(directory)
    if not (root / MODULES_NAME).is_file():
        return None
    modules = _read(root / MODULES_NAME)
    if not isinstance(modules, list):
        raise CheckpointError(f"{str(root / MODULES_NAME)!r} is not a list of modules; regenerate it with sentence-transformers.")
    types = [str(m.get("type", "")) if isinstance(m, dict) else "" for m in modules]
    pooling = [m for m, t in zip(modules, types) if t.endswith("Pooling")]
    if not pooling:
        return None
    config = _read(root / str(pooling[0].get("path", "")) / "config.json")
    modes = [POOLING_MODES.get(k, k) for k, v in (config.items() if isinstance(config, dict) else ()) if k.startswith("pooling_mode") and v]
    if len(modes) != 1 or modes[0] not in POOLING_MODES.values():
        raise UnsupportedModelError(f"the sentence-transformers pooling of {str(root)!r} is {modes}; neuronfx pools by the last token "
                                    "(pooling_mode_lasttoken) or the mean (pooling_mode_mean_tokens): pass --pooling last or mean.")
    return {"pooling": modes[0], "normalize": any(t.endswith("Normalize") for t in types)}


def causal_lm_layout(state_dict: Mapping[str, object], tie_word_embeddings: bool) -> dict[str, object]:
    """``state_dict`` under causal-LM names: a bare decoder's tensors (``embed_tokens.weight`` and
    no ``model.`` key) get the ``model.`` prefix; a bare decoder of an untied model has no LM
    head, so ``lm_head.weight`` is its embedding (a placeholder: embed graphs never read it, and
    such a model is for embeddings, not generation). Any other state dict is returned as it is."""
    if "embed_tokens.weight" not in state_dict or any(k.startswith("model.") for k in state_dict):
        return dict(state_dict)
    out = {(k if k == "lm_head.weight" else f"model.{k}"): v for k, v in state_dict.items()}
    if not tie_word_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
