"""InferenceConfig: the static capacities and options every graph of a plan is compiled for."""

from __future__ import annotations

import re

import attrs

from neuronfx.config import inference_checks as checks
from neuronfx.config.dtypes import FLOAT_DTYPES
from neuronfx.config.kv import KV_CACHE_DTYPES, KV_LAYOUTS, canonical_kv_cache_dtype
from neuronfx.config.kv_blocks import block_size_field
from neuronfx.config.validators import boolean, non_negative_int, one_of, positive_int
from neuronfx.errors import ConfigError

BACKENDS = ("eager", "export", "inductor", "neuron")
"""Names of the backends (``neuronfx.graphs.backends.BACKENDS`` holds their records)."""
DEFAULT_BACKEND = "inductor"
WEIGHT_FORMATS = ("float", "int8", "int4", "gguf")
"""Weight formats a plan may store its linear weights in (``config/quantization.py``)."""
ACTIVATION_FORMATS = ("float", "int8", "auto")
"""What the quantized products multiply the weights with (``config/quantization.py``)."""
WEIGHT_GROUP_SIZES = (32, 64, 128)
"""int4 group sizes (weights sharing one scale and offset along the input dim)."""
DEVICES = ("cpu", "cuda", "cuda:N")
"""Devices a plan may run on: the CPU, "cuda" (GPU 0; GPU r for tensor-parallel rank r) or GPU N (torch's names)."""
_DEVICE_PATTERN = re.compile(r"cpu|cuda(:(0|[1-9][0-9]*))?")
TASKS = ("generate", "embed")
"""What a plan's graphs do (vLLM's ``task`` / ``--runner``): generate tokens, or embed prompts."""
POOLINGS = ("last", "mean")
"""How an embed graph pools a prompt's hidden states: its last real token's, or their mean."""
SPECULATIVE_METHODS = ("ngram",)
"""Draft methods besides a draft model or self-speculation (vLLM's ``speculative_config.method``):
"ngram", prompt lookup (``runtime/ngram.py``)."""


def _device(inst: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str) or not _DEVICE_PATTERN.fullmatch(value):
        raise ConfigError(
            f"InferenceConfig.device={value!r} is not a device neuronfx runs on; pass 'cpu', 'cuda' (GPU 0, or GPU r "
            "for tensor-parallel rank r) or 'cuda:N' (GPU N, e.g. 'cuda:1')."
        )


def _group_size(inst: object, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or value not in WEIGHT_GROUP_SIZES:
        raise ConfigError(
            f"InferenceConfig.weight_group_size={value!r} is not one of {WEIGHT_GROUP_SIZES}; pick one "
            "(smaller groups: closer to the float weights, more bytes per weight)."
        )


def _chunk_size(inst: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(
            f"InferenceConfig.prefill_chunk_size={value!r} must be None (prefill whole prompts) or an int >= 1 "
            "(tokens per chunk); pass e.g. 128."
        )


def prefill_limit(inference: InferenceConfig) -> int:
    """Longest prompt one prefill graph takes, tokens: ``max_context_length``, or
    ``prefill_chunk_size`` when that is smaller (longer prompts are prefilled in chunks)."""
    chunk = inference.prefill_chunk_size
    return inference.max_context_length if chunk is None else min(chunk, inference.max_context_length)


def _buckets(value: object) -> object:
    """None, or a list/tuple of bucket sizes as a tuple; anything else is left for the check."""
    return tuple(value) if isinstance(value, (list, tuple, range)) else value


def _check_bucket_list(field: str, buckets: tuple[int, ...] | None, limit_field: str, limit: int) -> None:
    if buckets is None:
        return
    if not isinstance(buckets, tuple):
        raise ConfigError(f"{field}={buckets!r} must be a list of bucket sizes, e.g. [{buckets!r}], or None to derive them.")
    if not buckets:
        raise ConfigError(f"{field}=() is empty; give at least one bucket or None to derive them.")
    for b in buckets:
        if not isinstance(b, int) or isinstance(b, bool) or b <= 0:
            raise ConfigError(f"{field} contains {b!r}; buckets are positive ints (tokens, or rows for batch_buckets).")
    if list(buckets) != sorted(set(buckets)):
        raise ConfigError(f"{field}={buckets} must be strictly increasing; sort it and drop duplicates.")
    if buckets[-1] > limit:
        raise ConfigError(
            f"{field} has bucket {buckets[-1]} > {limit_field}={limit}; drop it or raise {limit_field}."
        )
    if buckets[-1] != limit:
        # Otherwise a length the config accepts could find no bucket at run time.
        raise ConfigError(
            f"{field} ends at {buckets[-1]} < {limit_field}={limit}; the largest bucket must equal "
            f"{limit_field}: append {limit} or lower {limit_field}."
        )


PREFIX_CACHING_CHUNK = 128
"""The ``prefill_chunk_size`` that ``enable_prefix_caching=True`` gets when none is given (at
most ``max_context_length``, a multiple of ``prefix_block_size``): the rest of a prompt after
a cached prefix is prefilled in chunk graphs of this many tokens, so a small chunk wastes
little on a short rest while a long prompt still runs in few passes (optimum-neuron picks a
chunk size itself too: 1024 for sequences over 1024 tokens)."""


def prefix_caching_chunk(max_context_length: int, prefix_block_size: int) -> int:
    """The chunk size prefix caching uses when none is given: :data:`PREFIX_CACHING_CHUNK`, or
    ``max_context_length`` when smaller, rounded down to whole ``prefix_block_size`` blocks
    (at least one block)."""
    limit = min(PREFIX_CACHING_CHUNK, max_context_length)
    return max(limit - limit % prefix_block_size, prefix_block_size)


@attrs.frozen(kw_only=True, cache_hash=True)  # hashed on every step (state/plan check)
class InferenceConfig:
    """Static options of a compiled runtime (the scope of NxD's ``NeuronConfig`` neuronfx covers).

    - ``batch_size``: KV-cache slots, i.e. requests held at once (vLLM's ``max_num_seqs``), and
      the largest batch a graph runs.
    - ``batch_buckets``: compiled batch sizes (rows per graph), strictly increasing and ending at
      ``batch_size``; a step over n rows runs in the smallest one >= n. Derived when None:
      1, 2, 4, ... below ``batch_size``, then ``batch_size`` (only ``batch_size`` without bucketing).
    - ``max_context_length``: longest prompt, tokens (largest prefill bucket unless
      ``prefill_chunk_size`` is smaller).
    - ``sequence_length``: KV-cache length per slot, tokens (prompt + generated).
    - ``enable_bucketing``: derive power-of-two bucket ladders; otherwise one bucket per phase.
    - ``prefill_buckets`` / ``decode_buckets``: explicit ladders (tokens), override derivation.
    - ``dtype``: weights, activations and KV cache ("float32", "bfloat16", "float16").
    - ``kv_cache_dtype``: what the KV cache stores (vLLM's ``kv_cache_dtype``): "auto" (default:
      ``dtype``, token-exact), "bf16" / "bfloat16", "int8" (one fp32 scale per token and KV head,
      stored after its values: about half the bytes of bf16) or "fp8" / "fp8_e4m3" (torch's
      float8_e4m3fn, saturated at +-448). The attention kernels read them directly; prefill
      attends its own fresh K/V, later steps read the stored ones (``config/kv.py``).
    - ``kv_layout``: "slots" (default: one ``sequence_length`` row per request slot) or
      "blocks" (paged: blocks of ``kv_block_size`` positions, default 16, handed to requests as
      they grow; ``config/kv_blocks.py``). ``num_kv_blocks`` or ``kv_cache_memory`` (bytes) bound
      the blocks (default: what the slots layout would hold); blocks layout only.
    - ``on_device_sampling``: graphs return sampled tokens; ``max_topk`` caps top_k in the graph.
    - ``max_logprobs``: most top logprobs a request may ask for (vLLM's ``max_logprobs``, default
      20); 0 compiles no logprob outputs.
    - ``output_logits``: graphs also return fp32 logits of the last position [B, vocab].
    - ``greedy_graphs``: with ``on_device_sampling``, also compile "greedy" graphs beside the
      decode graphs (the same prologue and layers, sharing their compiled parts, and an
      epilogue that only takes the argmax of the logits; their record has no sampler inputs):
      a decode step whose rows are all greedy with no penalty, ``logit_bias``, pending
      ``min_tokens``, logprobs or grammar runs them instead (vLLM's all-greedy sampler path),
      the same tokens without the sampler's passes over the vocabulary (about 1 ms of a 10 ms
      SmolLM2 step at batch 8). Default True.
    - ``enable_prompt_logprobs``: prefill and chunk graphs also return, at every prompt
      position, the raw logprob of the next prompt token and the top ``max_logprobs``
      alternatives (the LM head runs over the prompt in blocks: ``graphs/phases/prompt_logprobs.py``),
      so requests may ask for vLLM's ``SamplingParams.prompt_logprobs`` (OpenAI ``echo`` with
      ``logprobs``). Off by default: it costs the LM head over every prompt token. Not with
      ``enable_prefix_caching`` (a cached prefix has no logits).
    - ``speculation_length``: k >= 2 compiles "speculate" graphs that verify k tokens per row in
      one pass (k - 1 drafted plus the last accepted token); 0 = no speculation.
    - ``draft_layers``: N > 0 compiles "draft" graphs: decode through the first N layers plus
      the final norm and LM head (self-speculation, weights and KV shared with the target).
    - ``speculative_method``: None (default: the draft is ``draft_layers`` or a runtime attached
      with ``neuronfx.with_draft``) or "ngram": prompt lookup, vLLM's ``method="ngram"`` (no draft
      graphs: the drafts are the tokens that followed the latest n-gram's earliest match in the
      sequence, ``runtime/ngram.py``); needs ``speculation_length`` >= 2 and ``draft_layers`` 0.
    - ``fused_speculation``: a speculate step runs its k - 1 draft passes, the verify pass and
      the acceptance as one call with no host step between them (NxDI's
      ``enable_fused_speculation``; ``runtime/fused.py``); the same tokens as unfused
      speculation. Needs ``speculation_length`` >= 2 and a draft (``draft_layers`` or a draft
      runtime), not "ngram"; rows with structured outputs speculate unfused.
    - ``prompt_lookup_min`` / ``prompt_lookup_max``: the n-gram lengths "ngram" tries, longest
      first (vLLM's names; 1 <= min <= max). Defaults 3 and 4, measured: on SmolLM2 (kept GGUF
      blocks, 4 drafts, ``neuronfx bench prompt-lookup``, 2026-12-04) min 1 made decoding 0.88x
      plain (matches of one token, 38% of drafts accepted), min 2 1.15x, min 3 1.18x (66%
      accepted). vLLM's defaults are 5 and 5.
    - ``backend``: "eager" (reference), "export" (torch.export per graph), "inductor"
      (torch.compile per graph part), "neuron" (optional extra).
    - ``tp_degree``: tensor-parallel ranks (processes) the weights are split over
      (``config/sharding.py``); 1 = one process. Ranks run under torchrun or
      :func:`neuronfx.launch`.
    - ``sequence_parallel``: prefill runs norms and residuals on sequence shards (NxD's
      ``sequence_parallel_enabled``); needs ``tp_degree >= 2``.
    - ``weight_format``: "float" (weights in ``dtype``), "int8" (per output channel), "int4"
      (groups of ``weight_group_size``), or "gguf" (a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks kept
      as they are): weight-only quantization of the decoder layers' linear weights (and of the
      LM head when ``quantize_lm_head``); which weights, and why, in ``config/quantization.py``.
    - ``weight_group_size``: int4 group size, 32, 64 or 128 (ignored by other formats).
    - ``activation_format``: "float" (default: the quantized products take x in the plan's
      dtype and accumulate in fp32: token-exact), "int8" (x rounded to int8: int8 weights
      per row through an integer GEMM, decode products of 4-bit weights per 32 values as
      llama.cpp; ``config/quantization.py``) or "auto" (int8 where it measured faster on this
      machine, ``graphs/kernels/activation_choice.py``). Needs weight_format "int8", "int4" or
      "gguf" and the inductor backend.
    - ``quantize_lm_head``: quantize the LM head too (int8 for int8 and int4 plans).
    - ``device``: where weights, KV cache and step inputs live: "cpu" (default), "cuda" (cuda:0;
      rank r of a tensor-parallel plan takes cuda:r) or "cuda:N" (one rank only). CUDA plans
      run the eager or inductor backend (inductor replays each graph as a CUDA graph) with float
      weights; whether the device exists is checked when the runtime is compiled or loaded
      (``graphs/phases/device.py``), not here (a plan is a pure value, written anywhere).
    - ``prefill_chunk_size``: C >= 1 prefills a prompt longer than C in chunks of at most C
      tokens ("chunk" graphs: C new tokens per row against the slot's cache, one per batch bucket
      and decode bucket >= C); the prefill buckets then stop at C (:func:`prefill_limit`), so
      ``max_context_length`` may reach ``sequence_length`` without a prefill graph that long.
      None (default): whole prompts, one prefill pass. Not with speculation (a draft's cache
      would have to follow every chunk).
    - ``enable_prefix_caching``: reuse the KV of prompt prefixes already computed (vLLM's
      automatic prefix caching): full ``prefix_block_size``-token blocks of prompts are kept in
      a pool of ``max_prefix_blocks`` blocks (``runtime/prefix_store.py``); a new prompt starting
      with cached blocks gets them copied into its slot and only the rest is prefilled from that
      offset (the chunked-prefill graphs). Without a ``prefill_chunk_size`` it gets one:
      :func:`prefix_caching_chunk` (128 tokens, or less for shorter prompts), which the config
      then holds (``repr`` and the plan's JSON show it).
    - ``prefix_block_size``: tokens per cached block (vLLM's ``block_size``, default 16); must
      divide ``prefill_chunk_size``.
    - ``max_prefix_blocks``: the cache's memory bound, blocks (bytes: ``runtime.prefix_pool.pool_nbytes``);
      None derives ``batch_size * max_context_length // prefix_block_size`` (every slot's longest prompt).
    - ``task``: "generate" (default: prefill, decode and the other generation graphs) or "embed"
      (vLLM's ``task="embed"``): only "embed" graphs per (batch bucket, prefill bucket), which
      return each prompt's pooled final hidden state (``neuronfx.embed``); no generation.
    - ``pooling``: an embed graph's pooling, "last" (the last real token's hidden state,
      Qwen3-Embedding's) or "mean" (over the real tokens); ``normalize``: L2-normalise the
      pooled vector. The sentence-transformers config of a checkpoint gives both
      (``io/sentence_transformers.py``); ignored by generation plans.

    Cross-field violations raise :class:`ConfigError` naming the field, value and limit.
    """

    batch_size: int = attrs.field(default=1, validator=positive_int)
    max_context_length: int = attrs.field(default=256, validator=positive_int)
    sequence_length: int = attrs.field(default=512, validator=positive_int)
    enable_bucketing: bool = attrs.field(default=True, validator=boolean)
    batch_buckets: tuple[int, ...] | None = attrs.field(default=None, converter=_buckets)
    prefill_buckets: tuple[int, ...] | None = attrs.field(default=None, converter=_buckets)
    decode_buckets: tuple[int, ...] | None = attrs.field(default=None, converter=_buckets)
    dtype: str = attrs.field(default="float32", validator=one_of(FLOAT_DTYPES))
    kv_cache_dtype: str = attrs.field(default="auto", converter=canonical_kv_cache_dtype, validator=one_of(KV_CACHE_DTYPES))
    kv_layout: str = attrs.field(default="slots", validator=one_of(KV_LAYOUTS))
    kv_block_size: int | None = attrs.field(default=None, validator=block_size_field)
    num_kv_blocks: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive_int))
    kv_cache_memory: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive_int))
    on_device_sampling: bool = attrs.field(default=True, validator=boolean)
    max_topk: int = attrs.field(default=256, validator=positive_int)
    max_logprobs: int = attrs.field(default=20, validator=non_negative_int)
    output_logits: bool = attrs.field(default=False, validator=boolean)
    greedy_graphs: bool = attrs.field(default=True, validator=boolean)
    enable_prompt_logprobs: bool = attrs.field(default=False, validator=boolean)
    backend: str = attrs.field(default=DEFAULT_BACKEND, validator=one_of(BACKENDS))
    speculation_length: int = attrs.field(default=0, validator=non_negative_int)
    draft_layers: int = attrs.field(default=0, validator=non_negative_int)
    speculative_method: str | None = attrs.field(default=None, validator=one_of((None, *SPECULATIVE_METHODS)))
    fused_speculation: bool = attrs.field(default=False, validator=boolean)
    prompt_lookup_min: int = attrs.field(default=3, validator=positive_int)
    prompt_lookup_max: int = attrs.field(default=4, validator=positive_int)
    tp_degree: int = attrs.field(default=1, validator=positive_int)
    sequence_parallel: bool = attrs.field(default=False, validator=boolean)
    weight_format: str = attrs.field(default="float", validator=one_of(WEIGHT_FORMATS))
    weight_group_size: int = attrs.field(default=32, validator=_group_size)
    activation_format: str = attrs.field(default="float", validator=one_of(ACTIVATION_FORMATS))
    quantize_lm_head: bool = attrs.field(default=True, validator=boolean)
    device: str = attrs.field(default="cpu", validator=_device)
    prefill_chunk_size: int | None = attrs.field(default=None, validator=_chunk_size)
    enable_prefix_caching: bool = attrs.field(default=False, validator=boolean)
    prefix_block_size: int = attrs.field(default=16, validator=positive_int)
    max_prefix_blocks: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive_int))
    task: str = attrs.field(default="generate", validator=one_of(TASKS))
    pooling: str = attrs.field(default="last", validator=one_of(POOLINGS))
    normalize: bool = attrs.field(default=True, validator=boolean)

    def __attrs_post_init__(self) -> None:
        self._derive_prefix_chunk()
        if self.max_context_length > self.sequence_length:
            raise ConfigError(
                f"max_context_length={self.max_context_length} > sequence_length={self.sequence_length}; "
                "a prompt must fit in the KV cache: lower max_context_length or raise sequence_length."
            )
        _check_bucket_list("batch_buckets", self.batch_buckets, "batch_size", self.batch_size)
        checks.check_chunking(self)
        limit_field = "max_context_length" if self.prefill_chunk_size is None else "prefill_chunk_size"  # <= max_context_length
        _check_bucket_list("prefill_buckets", self.prefill_buckets, limit_field, prefill_limit(self))
        _check_bucket_list("decode_buckets", self.decode_buckets, "sequence_length", self.sequence_length)
        if self.speculation_length == 1 or self.speculation_length >= self.sequence_length:
            raise ConfigError(
                f"speculation_length={self.speculation_length} must be 0 (off) or in [2, sequence_length - 1 = "
                f"{self.sequence_length - 1}]: it counts the verified tokens (drafted + 1), written after at least one cached token."
            )
        checks.check_speculation(self)
        if self.sequence_parallel and self.tp_degree < 2:
            raise ConfigError("sequence_parallel=True needs tp_degree >= 2 (it splits prefill over the ranks); "
                              "set tp_degree or drop sequence_parallel.")
        checks.check_weights(self)
        checks.check_activations(self)
        checks.check_cuda(self)
        checks.check_embed(self)
        checks.check_kv_layout(self)
        checks.check_prefix_caching(self)
        if not self.on_device_sampling and not self.output_logits:
            raise ConfigError(
                "on_device_sampling=False and output_logits=False leaves the graphs with no output; "
                "set one of them to True."
            )

    def _derive_prefix_chunk(self) -> None:
        """Give prefix caching its chunk size when none was given (:func:`prefix_caching_chunk`):
        a derived default, set once while the value is built, before it is hashed or shared."""
        if not self.enable_prefix_caching or self.prefill_chunk_size is not None or self.prefix_block_size >= self.max_context_length:
            return  # nothing to derive, or check_prefix_caching names the block size
        if self.speculation_length:
            raise ConfigError(
                f"enable_prefix_caching=True with speculation_length={self.speculation_length}: a cached prefix is continued "
                "by chunked prefill, which does not drive a draft (its cache would have to follow every chunk); drop one of them."
            )
        object.__setattr__(self, "prefill_chunk_size", prefix_caching_chunk(self.max_context_length, self.prefix_block_size))
