"""The options of ``neuronfx bench engines`` (:mod:`neuronfx.bench.engines`): the engines it
knows, its arguments, and their checks, all before anything loads."""

from __future__ import annotations

import argparse

import attrs

from neuronfx.bench.options import add_model, add_threads, check_at_least
from neuronfx.config.inference import BACKENDS, DEFAULT_BACKEND, InferenceConfig
from neuronfx.errors import ConfigError, InputError
from neuronfx.io import checkpoints


@attrs.frozen(kw_only=True)
class NeuronfxFormat:
    """One neuronfx engine: the weights, activations and KV cache of its plans (dtype float32)."""

    weight_format: str
    activation_format: str
    kv_cache_dtype: str = "auto"


NEURONFX = {"neuronfx-fp32": NeuronfxFormat(weight_format="float", activation_format="float"),
            "neuronfx-int8": NeuronfxFormat(weight_format="int8", activation_format="float"),
            "neuronfx-int8-auto": NeuronfxFormat(weight_format="int8", activation_format="auto"),
            "neuronfx-int8-auto-kv8": NeuronfxFormat(weight_format="int8", activation_format="auto", kv_cache_dtype="int8"),
            "neuronfx-gguf": NeuronfxFormat(weight_format="gguf", activation_format="float"),
            "neuronfx-gguf-auto": NeuronfxFormat(weight_format="gguf", activation_format="auto"),
            "neuronfx-gguf-auto-kv8": NeuronfxFormat(weight_format="gguf", activation_format="auto", kv_cache_dtype="int8")}
OPENVINO = {"openvino-fp32": "float", "openvino-int8": "int8", "openvino-int4": "int4"}  # -> neuronfx's --weight-format it stands for
ENGINES = (*NEURONFX, "transformers", "llama.cpp", *OPENVINO)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --engines, --backend, --batch-sizes, --prompt-len, --long-prompt-len, --gen-len, --agreement-tokens, --rounds, --threads."""
    add_model(p)
    p.add_argument("--engines", nargs="+", default=list(ENGINES), metavar="ENGINE",
                   help=f"of {', '.join(ENGINES)} (default: all; the gguf engines and llama.cpp need a .gguf --model)")
    p.add_argument("--backend", choices=BACKENDS, default=DEFAULT_BACKEND, help=f"neuronfx's backend (default {DEFAULT_BACKEND})")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of the decode cases (default 128)")
    p.add_argument("--long-prompt-len", type=int, default=1024, help="prompt tokens of the batch-1 TTFT case (default 1024; 0: none)")
    p.add_argument("--gen-len", type=int, default=128, help="new tokens per row of the decode cases (default 128)")
    p.add_argument("--agreement-tokens", type=int, default=24, help="greedy tokens compared with transformers' (default 24)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per case, the engines' order alternating (default 3)")
    add_threads(p)


@attrs.frozen(kw_only=True)
class EnginesSpec:
    """The checked options of a run."""

    engines: tuple[str, ...]
    model: str
    backend: str
    batch_sizes: tuple[int, ...]
    prompt_len: int
    long_prompt_len: int
    gen_len: int
    agreement_tokens: int
    rounds: int
    agreement_prompt_len: int = 0  # the longest token-agreement prompt, tokens (0: no agreement); known once tokenized


def batch1_sizes(spec: EnginesSpec) -> tuple[int, int]:
    """(prompt tokens, new tokens) batch 1 must hold: its decode case, the long prompt, the token agreement."""
    return max(spec.prompt_len, spec.long_prompt_len, spec.agreement_prompt_len), max(spec.gen_len, spec.agreement_tokens)


def check_positions(spec: EnginesSpec, max_positions: int) -> None:
    """InputError naming each part of the run whose rows (prompt + new tokens) pass the model's
    ``max_position_embeddings``: positions it was not trained for (transformers only warns)."""
    need = [("--prompt-len + --gen-len", spec.prompt_len + spec.gen_len)]
    need += [("--long-prompt-len + its 2 new tokens", spec.long_prompt_len + 2)] if spec.long_prompt_len else []
    need += [(f"the longest agreement prompt ({spec.agreement_prompt_len} tokens) + --agreement-tokens",
              spec.agreement_prompt_len + spec.agreement_tokens)] if spec.agreement_prompt_len else []
    over = [f"{what} = {n}" for what, n in need if n > max_positions]
    if over:
        raise InputError(f"{'; '.join(over)} positions: past the model's max_position_embeddings {max_positions}; lower them to fit.")


def check_options(args: argparse.Namespace) -> EnginesSpec:
    """The spec, checked before anything loads. InputError for an unknown or repeated engine,
    sizes out of range (:func:`check_sizes`), a gguf engine or llama.cpp without a .gguf --model,
    a neuronfx engine --backend cannot run; BackendUnavailableError (naming the extra) when
    llama-cpp-python or the OpenVINO packages are missing for the engines asked for."""
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown or len(set(args.engines)) != len(args.engines):
        raise InputError(f"--engines {' '.join(args.engines)}: each of {', '.join(ENGINES)}, once "
                         f"({'unknown: ' + ', '.join(unknown) if unknown else 'one is repeated'}).")
    check_sizes(args)
    model = str(args.model or checkpoints.default_model_path())
    needs_gguf = [e for e in args.engines if e == "llama.cpp" or (e in NEURONFX and NEURONFX[e].weight_format == "gguf")]
    if needs_gguf and not model.endswith(".gguf"):
        raise InputError(f"--engines {' '.join(needs_gguf)} run a .gguf's blocks: --model must be a .gguf file, not {model!r} "
                         "(the default is SmolLM2's Q4_1 .gguf), or leave them out of --engines.")
    check_backend([e for e in args.engines if e in NEURONFX], args.backend)
    check_packages(args.engines)
    return EnginesSpec(engines=tuple(args.engines), model=model, backend=args.backend, batch_sizes=tuple(args.batch_sizes),
                       prompt_len=args.prompt_len, long_prompt_len=args.long_prompt_len, gen_len=args.gen_len,
                       agreement_tokens=args.agreement_tokens, rounds=args.rounds)


def check_sizes(args: argparse.Namespace) -> None:
    """InputError for a size below its least value, a repeated batch size (its rows would be
    one case twice), or a long prompt not longer than --prompt-len (the table tells the cases
    apart by batch size and prompt length)."""
    check_at_least("batch_sizes", args.batch_sizes, 1)
    check_at_least("prompt_len", args.prompt_len, 1)
    check_at_least("long_prompt_len", args.long_prompt_len, 0)
    check_at_least("gen_len", args.gen_len, 2)
    check_at_least("agreement_tokens", args.agreement_tokens, 1)
    check_at_least("rounds", args.rounds, 1)
    if len(set(args.batch_sizes)) != len(args.batch_sizes):
        raise InputError(f"--batch-sizes {' '.join(map(str, args.batch_sizes))} repeats a size; give each once.")
    if 0 < args.long_prompt_len <= args.prompt_len:
        raise InputError(f"--long-prompt-len {args.long_prompt_len} must be longer than --prompt-len {args.prompt_len} "
                         "(its TTFT is the long prompt's); raise it, or pass 0 to skip the long prompt.")


def check_backend(engines: list[str], backend: str) -> None:
    """InputError naming the neuronfx engine whose formats --backend cannot compile (int8
    activations, the -auto engines, are the inductor backend's kernels)."""
    for name in engines:
        fmt = NEURONFX[name]
        try:
            InferenceConfig(backend=backend, weight_format=fmt.weight_format, activation_format=fmt.activation_format,
                            kv_cache_dtype=fmt.kv_cache_dtype)
        except ConfigError as exc:
            raise InputError(f"--engines {name} with --backend {backend}: {exc} Here: pick that --backend, or leave {name} out of --engines.") from exc


def check_packages(engines: list[str]) -> None:
    """BackendUnavailableError (naming the extra) when an engine's package is not installed."""
    if "llama.cpp" in engines:
        from neuronfx.bench.llama_cpp import import_llama_cpp

        import_llama_cpp()
    if any(e in OPENVINO for e in engines):
        from neuronfx.bench.openvino import import_genai
        from neuronfx.bench.openvino_export import check_exporter

        import_genai()
        check_exporter()
