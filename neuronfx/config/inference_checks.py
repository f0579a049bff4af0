"""InferenceConfig's cross-field checks (``InferenceConfig.__attrs_post_init__`` runs them in
order): each takes the ``InferenceConfig`` being built (typed ``Any``: this module is imported
by ``config/inference.py``, so it cannot import the class back) and raises :class:`ConfigError`
naming the fields, their values and a fix before any plan exists."""

from __future__ import annotations

from typing import Any

from neuronfx.config.kv_blocks import DEFAULT_KV_BLOCK_SIZE, check_block_options
from neuronfx.errors import ConfigError

CUDA_BACKENDS = ("eager", "inductor")
"""Backends that run on a CUDA device (inductor replays its graphs as CUDA graphs there)."""


def is_cuda(device: str) -> bool:
    """Whether ``device`` (a valid ``InferenceConfig.device``) names a CUDA device."""
    return device.startswith("cuda")


def check_speculation(inf: Any) -> None:
    """The draft options: draft_layers needs speculation_length; "ngram" needs
    speculation_length and no draft_layers; fused speculation needs speculation_length and
    a draft model; prompt_lookup_min <= prompt_lookup_max."""
    if inf.draft_layers and not inf.speculation_length:
        raise ConfigError(f"draft_layers={inf.draft_layers} needs speculation_length >= 2; set both or neither.")
    if inf.prompt_lookup_min > inf.prompt_lookup_max:
        raise ConfigError(f"prompt_lookup_min={inf.prompt_lookup_min} > prompt_lookup_max={inf.prompt_lookup_max}: the "
                          "n-gram lengths tried are min..max; lower prompt_lookup_min or raise prompt_lookup_max.")
    if inf.speculative_method == "ngram" and not inf.speculation_length:
        raise ConfigError("speculative_method='ngram' needs speculation_length=k >= 2 (k - 1 drafts per step); set it.")
    if inf.fused_speculation and (inf.speculation_length < 2 or inf.speculative_method is not None):
        raise ConfigError(f"fused_speculation=True fuses a draft model's passes with the verify pass: it needs "
                          f"speculation_length >= 2 (got {inf.speculation_length}) and speculative_method=None (got "
                          f"{inf.speculative_method!r}); set them, or drop fused_speculation.")
    if inf.speculative_method == "ngram" and inf.draft_layers:
        raise ConfigError(f"speculative_method='ngram' with draft_layers={inf.draft_layers}: prompt lookup drafts "
                          "without a model; drop draft_layers (or speculative_method).")

def check_weights(inf: Any) -> None:
    """Quantized weights: one rank, a CPU backend."""
    if inf.weight_format != "float" and inf.tp_degree > 1:
        raise ConfigError(
            f"weight_format={inf.weight_format!r} with tp_degree={inf.tp_degree}: quantized weights are not "
            "sharded over tensor-parallel ranks yet; use tp_degree=1 or weight_format='float'."
        )
    if inf.kv_cache_dtype != "auto" and inf.backend == "neuron":
        raise ConfigError(
            f"kv_cache_dtype={inf.kv_cache_dtype!r} with backend='neuron': the neuron backend keeps the KV cache "
            "in the plan's dtype; use kv_cache_dtype='auto' (or dtype='bfloat16' for a 16-bit cache)."
        )
    if inf.weight_format != "float" and inf.backend == "neuron":
        raise ConfigError(
            f"weight_format={inf.weight_format!r} runs on the CPU backends (eager, export, inductor) only; "
            "the neuron backend takes weight_format='float'."
        )

def check_embed(inf: Any) -> None:
    """An embedding plan (``task="embed"``) holds embed graphs only: no option of generation."""
    if inf.task != "embed":
        return
    given = [f"{name}={getattr(inf, name)!r}" for name, off in (
        ("speculation_length", 0), ("prefill_chunk_size", None), ("enable_prefix_caching", False),
        ("enable_prompt_logprobs", False), ("tp_degree", 1), ("kv_cache_dtype", "auto")) if getattr(inf, name) != off]
    if given:
        raise ConfigError(f"task='embed' with {', '.join(given)}: an embedding plan runs whole prompts through embed graphs "
                          "on one rank, without generation options; drop them or use task='generate'.")

def check_kv_layout(inf: Any) -> None:
    """The blocks layout's options (``config.kv_blocks.check_block_options``), what it does
    not run with yet (the neuron backend, embedding plans), and prefix blocks the size of
    its KV blocks (a cached block is a KV block)."""
    check_block_options(inf.kv_layout, inf.kv_block_size, inf.num_kv_blocks, inf.kv_cache_memory)
    if inf.kv_layout != "blocks":
        return
    given = [f"{name}={getattr(inf, name)!r}" for name, on in (("backend", "neuron"), ("task", "embed")) if getattr(inf, name) == on]
    if given:
        raise ConfigError(f"kv_layout='blocks' with {', '.join(given)}: the blocks layout does not run with it yet; "
                          "use kv_layout='slots' for it.")
    block = inf.kv_block_size or DEFAULT_KV_BLOCK_SIZE
    if inf.enable_prefix_caching and inf.prefix_block_size != block:
        raise ConfigError(f"prefix_block_size={inf.prefix_block_size} with kv_block_size={block}: the blocks layout caches "
                          "prefixes as its own KV blocks, shared by reference; give both the same size.")

def check_activations(inf: Any) -> None:
    """int8 activations exist only in the inductor backend's products of quantized weights."""
    if inf.activation_format == "float":
        return
    if inf.weight_format not in ("int8", "int4", "gguf"):
        raise ConfigError(
            f"activation_format={inf.activation_format!r} with weight_format={inf.weight_format!r}: int8 "
            "activations serve quantized weights only; use weight_format='int8', 'int4' or 'gguf', or activation_format='float'."
        )
    if inf.backend != "inductor":
        raise ConfigError(
            f"activation_format={inf.activation_format!r} with backend={inf.backend!r}: the int8 products are "
            "the inductor backend's CPU kernels; use backend='inductor', or activation_format='float'."
        )

def check_cuda(inf: Any) -> None:
    """What a CUDA device rules out: the export and neuron backends, quantized weights (their
    kernels are CPU code), and one device index for several tensor-parallel ranks."""
    if not is_cuda(inf.device):
        return
    if inf.backend not in CUDA_BACKENDS:
        raise ConfigError(
            f"device={inf.device!r} with backend={inf.backend!r}: CUDA plans run the backends {CUDA_BACKENDS} "
            "(inductor replays CUDA graphs); pick one of them, or device='cpu'."
        )
    if inf.weight_format != "float":
        raise ConfigError(
            f"device={inf.device!r} with weight_format={inf.weight_format!r}: the quantized weight formats run "
            "neuronfx's CPU kernels only; use weight_format='float' (with dtype='bfloat16' for half the bytes) "
            "on CUDA, or device='cpu'."
        )
    if inf.tp_degree > 1 and inf.device != "cuda":
        raise ConfigError(
            f"device={inf.device!r} with tp_degree={inf.tp_degree}: tensor-parallel ranks take one GPU each "
            "(rank r on cuda:r); pass device='cuda'."
        )

def check_chunking(inf: Any) -> None:
    """ConfigError for a ``prefill_chunk_size`` no prompt would be chunked with, or one combined
    with an option chunked prefill does not support."""
    chunk = inf.prefill_chunk_size
    if chunk is None:
        return
    if chunk > inf.max_context_length:
        raise ConfigError(
            f"prefill_chunk_size={chunk} > max_context_length={inf.max_context_length}: no prompt would be chunked "
            f"and the chunk graphs would be larger than any prompt; lower prefill_chunk_size or drop it."
        )
    if inf.speculation_length:
        raise ConfigError(
            f"prefill_chunk_size={chunk} with speculation_length={inf.speculation_length}: chunked prefill does not "
            "drive a draft (a draft model's cache would have to follow every chunk); drop one of them."
        )


def check_prefix_caching(inf: Any) -> None:
    """The prefix-cache options fit the plan: a cached prefix is continued by the chunked-prefill
    (prefill at an offset) graphs, whose chunks cover whole blocks."""
    b = inf.prefix_block_size
    if not inf.enable_prefix_caching:
        return
    if inf.enable_prompt_logprobs:
        raise ConfigError("enable_prompt_logprobs=True with enable_prefix_caching=True: a prompt prefix taken from the cache "
                          "has no logits to score; drop one of them.")
    if b >= inf.max_context_length:
        raise ConfigError(
            f"prefix_block_size={b} >= max_context_length={inf.max_context_length}: no prompt could reuse a block (one "
            "token is always left to prefill); lower prefix_block_size (vLLM uses 16)."
        )
    chunk = inf.prefill_chunk_size
    if chunk % b:
        raise ConfigError(
            f"prefix_block_size={b} does not divide prefill_chunk_size={chunk}: a chunk must end on a block boundary "
            f"so that a prompt's cached and prefilled parts meet at whole blocks; pick a divisor of {chunk} (e.g. 16) "
            "or a chunk size that is a multiple of it."
        )
