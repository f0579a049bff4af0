"""HF state dict -> neuronfx weights: a declarative key map per model file plus one pure function."""

from __future__ import annotations

import torch

from neuronfx.config.model import ModelConfig
from neuronfx.errors import CheckpointError
from neuronfx.graphs.models import model_module

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every neuronfx weight name for ``cfg`` (HF layout: linear weights are (out, in))."""
    h, d, i_sz = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, h), "norm": (h,), "lm_head": (cfg.vocab_size, h)}
    per_layer = {
        "attn_norm": (h,), "mlp_norm": (h,), "wq": (q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q),
        "gate": (i_sz, h), "up": (i_sz, h), "down": (h, i_sz),
        "bq": (q,), "bk": (kv,), "bv": (kv,), "q_norm": (d,), "k_norm": (d,),
    }
    for layer in range(cfg.num_hidden_layers):
        shapes |= {f"layers.{layer}.{k}": s for k, s in per_layer.items()}
    return shapes


def expand_key_map(cfg: ModelConfig) -> dict[str, str]:
    """The model file's key map with ``{i}`` expanded over layers: HF name -> neuronfx name."""
    out = {}
    for hf, ours in model_module(cfg.model_type).key_map(cfg).items():
        if "{i}" in hf:
            out |= {hf.format(i=i): ours.format(i=i) for i in range(cfg.num_hidden_layers)}
        else:
            out[hf] = ours
    return out


def convert_hf_state_dict(state_dict: dict[str, torch.Tensor], cfg: ModelConfig, dtype: str) -> dict[str, torch.Tensor]:
    """Rename, check and cast an HF state dict into neuronfx weights in ``dtype``:
    ``{"embed", "norm", "lm_head": tensor, "layers": [{"wq": ..., "wk": ..., ...} per layer]}``.

    Tied embeddings reuse the embedding tensor as ``lm_head`` (no copy). Raises CheckpointError
    listing missing, unexpected or mis-shaped tensors (expected vs found shape).
    """
    names = expand_key_map(cfg)
    required = dict(names)
    if cfg.tie_word_embeddings:
        required.pop("lm_head.weight")
    # Tied checkpoints may still carry lm_head.weight (a copy); it is accepted and ignored.
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(set(required) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(names) - optional)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint tensors do not match model_type={cfg.model_type!r}: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}; "
            "check that the checkpoint and its config.json belong together."
        )
    shapes = expected_shapes(cfg)
    torch_dtype = DTYPES[dtype]
    flat = {}
    for hf, ours in required.items():
        t = state_dict[hf]
        if tuple(t.shape) != shapes[ours]:
            raise CheckpointError(
                f"tensor {hf!r} has shape {tuple(t.shape)}, expected {shapes[ours]} from the config; "
                "the checkpoint does not match its config.json."
            )
        flat[ours] = t.to(torch_dtype).contiguous()
    if cfg.tie_word_embeddings:
        flat["lm_head"] = flat["embed"]
    return nest(flat, cfg.num_hidden_layers)


def nest(flat: dict[str, torch.Tensor], num_layers: int) -> dict:
    """"layers.{i}.{name}" keys -> ``out["layers"][i][name]``; other keys stay at the top."""
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
    out: dict = {"layers": layers}
    for key, t in flat.items():
        if key.startswith("layers."):
            _, i, name = key.split(".", 2)
            layers[int(i)][name] = t
        else:
            out[key] = t
    return out
