"""``neuronfx bench latency``: TTFT, TPOT, ITL percentiles and tok/s of neuronfx per (batch size,
prompt length, generation length), greedy, with compile time, resident memory and the weight
bytes a decode step reads against this machine's read bandwidth. ``--compare transformers``,
``--compare llama.cpp`` (the same .gguf, the ``[bench]`` extra) or ``--compare openvino``
(OpenVINO GenAI on an optimum-intel export of the same weights, the ``[bench-openvino]`` extra:
:mod:`neuronfx.bench.openvino`) runs another engine on the same prompts and thread count;
``--rounds N`` alternates the engines case by case. ``--against REF`` compares this tree with
another checkout instead (:mod:`neuronfx.bench.checkout_ab`)."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

import torch

from neuronfx.api import check_weight_source
from neuronfx.bench import checkout_ab
from neuronfx.bench.bandwidth import format_bandwidth, format_memory
from neuronfx.bench.latency_run import LatencySpec, OpenEngine, format_agreement, run_bench
from neuronfx.bench.llama_cpp import import_llama_cpp, llama_cpp_engine
from neuronfx.bench.openvino import PipelineSizes, import_genai, openvino_engine
from neuronfx.bench.openvino_export import cached_ir, check_exporter, ov_weights
from neuronfx.bench.options import Log, add_model, check_at_least, logger
from neuronfx.bench.plot import check_plot_path, plot
from neuronfx.bench.rounds import comparison_table, format_rounds
from neuronfx.bench.timing import BenchResult, transformers_engine
from neuronfx.bench.types import Benchmark
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
from neuronfx.config.kv import KV_CACHE_DTYPES, canonical_kv_cache_dtype
from neuronfx.errors import InputError
from neuronfx.graphs.phases.device import check_device
from neuronfx.io import checkpoints
from neuronfx.io.cache import default_cache_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The cases, the plans' options, the compared engine, --rounds, the A/B mode and --plot."""
    add_model(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[128], help="prompt tokens")
    p.add_argument("--gen-lens", type=int, nargs="+", default=[128], help="generated tokens")
    p.add_argument("--dtype", choices=FLOAT_DTYPES, default="float32")
    p.add_argument("--backend", choices=BACKENDS, default=DEFAULT_BACKEND)
    p.add_argument("--device", default="cpu", help=f"{', '.join(DEVICES)}: where neuronfx and the compared transformers model run "
                   "(default cpu)")
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="float",
                   help="weights of neuronfx's plans: float (in --dtype), int8, int4, gguf (the .gguf file's blocks kept)")
    p.add_argument("--weight-group-size", type=int, choices=WEIGHT_GROUP_SIZES, default=32, help="int4 group size")
    p.add_argument("--activation-format", choices=ACTIVATION_FORMATS, default="float",
                   help="float (default, token-exact); int8: int8 activations in the quantized products (int8 weights: "
                        "an integer GEMM; 4-bit decode: llama.cpp's); auto: where they measured faster here (inductor only)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, type=canonical_kv_cache_dtype, default="auto",
                   help="what neuronfx's KV cache stores: auto (--dtype), bf16, int8 (scaled per token and head), fp8")
    p.add_argument("--compare", choices=["transformers", "llama.cpp", "openvino"], default=None,
                   help="also run this engine in the same process; llama.cpp (llama-cpp-python, pip install 'neuronfx[bench]') "
                        "runs the same .gguf --model on the same prompts and thread count; openvino (OpenVINO GenAI, pip install "
                        "'neuronfx[bench-openvino]') runs an optimum-intel export of the same weights (exported once, cached): "
                        "fp32 for --weight-format float, int8_asym per channel for int8, int4_asym for int4 (group "
                        "--weight-group-size) and gguf (group 32), computing in --dtype")
    p.add_argument("--compare-dtype", choices=FLOAT_DTYPES, default=None, help="dtype of the compared transformers model (default: --dtype)")
    p.add_argument("--rounds", type=int, default=None, metavar="N",
                   help="with --compare or --against: run each case N times in both, alternating, and report each side's median "
                        "round and the per-round ratios (this machine's speed drifts between runs; default 1, with --against 5)")
    checkout_ab.add_arguments(p)
    p.add_argument("--plot", default=None, metavar="FILE.png", help="plot decode tok/s vs batch size")


def check_options(args: argparse.Namespace) -> LatencySpec:
    """The options checked before anything loads: the spec of the run. Raises InputError
    (sizes, --rounds, combinations, a --plot path that cannot be written), ConfigError (device,
    weight source) and BackendUnavailableError (llama-cpp-python missing for --compare
    llama.cpp, matplotlib for --plot)."""
    check_at_least("batch_sizes", args.batch_sizes, 1)
    check_at_least("prompt_lens", args.prompt_lens, 1)
    check_at_least("gen_lens", args.gen_lens, 2)
    rounds = args.rounds if args.rounds is not None else 5 if args.against else 1
    if rounds < 1 or (rounds > 1 and not (args.compare or args.against)):
        raise InputError(f"--rounds={rounds}: N >= 1, and N > 1 only with --compare or --against (the sides alternate case by "
                         "case); drop --rounds or add one of them.")
    if args.weight_format == "gguf" and args.compare == "transformers":
        raise InputError("--weight-format gguf with --compare transformers: transformers cannot run the kept blocks; compare "
                         "with --compare llama.cpp (same file), or run transformers with --weight-format float.")
    if args.device != "cpu" and args.compare in ("llama.cpp", "openvino"):
        raise InputError(f"--device {args.device} with --compare {args.compare}: {args.compare} runs on the CPU here; drop --device.")
    if args.compare == "openvino" and args.compare_dtype:
        raise InputError("--compare openvino takes no --compare-dtype: OpenVINO computes in --dtype, on the weights --weight-format "
                         "names (see --help of --compare).")
    check_device(InferenceConfig(device=args.device, backend=args.backend, weight_format=args.weight_format,
                                 activation_format=args.activation_format))
    check_weight_source(InferenceConfig(weight_format=args.weight_format), args.model or checkpoints.default_model_path())
    if args.plot:
        check_plot_path(args.plot)
    return LatencySpec(backend=args.backend, dtype=args.dtype, batch_sizes=tuple(args.batch_sizes), prompt_lens=tuple(args.prompt_lens),
                       gen_lens=tuple(args.gen_lens), weight_format=args.weight_format, weight_group_size=args.weight_group_size,
                       device=args.device, activation_format=args.activation_format, kv_cache_dtype=args.kv_cache_dtype, rounds=rounds,
                       agreement=args.compare == "openvino")


def compared_engine(args: argparse.Namespace, checkpoint: Any, spec: LatencySpec, ir: Path | None = None) -> OpenEngine | None:
    """The engine --compare asks for, opened later (after neuronfx's cases unless --rounds);
    ``ir``: the OpenVINO IR of --compare openvino (:func:`prepare_openvino`)."""
    if args.compare == "transformers":
        return functools.partial(transformers_engine, checkpoint, args.compare_dtype or args.dtype, args.device)
    if args.compare == "llama.cpp":
        return functools.partial(llama_cpp_engine, str(args.model or checkpoints.default_model_path()), torch.get_num_threads())
    if args.compare == "openvino":
        sizes = PipelineSizes(max_batch=max(spec.batch_sizes), max_prompt=max(spec.prompt_lens),
                              max_tokens=max(spec.prompt_lens) + max(spec.gen_lens))
        return functools.partial(openvino_engine, ir, ov_weights(args.weight_format, args.weight_group_size), args.dtype,
                                 torch.get_num_threads(), sizes)
    return None


def prepare_openvino(args: argparse.Namespace, log: Log) -> Path:
    """--compare openvino: the IR of --model's weights in the OpenVINO counterpart of
    --weight-format, from the cache or exported now (before neuronfx reads anything, so the
    export's memory is freed before any figure is taken). Raises BackendUnavailableError
    (naming the extra) when openvino-genai, optimum-intel or nncf is missing, before any work."""
    import_genai()
    check_exporter()
    weights = ov_weights(args.weight_format, args.weight_group_size)
    return cached_ir(str(args.model or checkpoints.default_model_path()), weights, default_cache_dir(), log)


def check_llama_cpp(args: argparse.Namespace) -> None:
    """--compare llama.cpp runs the same .gguf: InputError for another --model or --compare-dtype,
    BackendUnavailableError (naming the extra) when llama-cpp-python is missing."""
    model = str(args.model or checkpoints.default_model_path())
    if not model.endswith(".gguf"):
        raise InputError(f"--compare llama.cpp runs llama.cpp on the same weights: --model must be a .gguf file, not {model!r} "
                         "(the default is SmolLM2's Q4_1 .gguf).")
    if args.compare_dtype:
        raise InputError("--compare llama.cpp takes no --compare-dtype: llama.cpp runs the file's own types.")
    import_llama_cpp()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Check the options, read the checkpoint once (in the plans' dtype, so it and the runtimes
    share one copy of the weights), measure, print the report; returns the figures."""
    spec = check_options(args)
    log = logger(args)
    if args.against:
        checkout_ab.check_combination(args)
        return checkout_ab.run_against(args, spec, log)
    if args.compare == "llama.cpp":
        check_llama_cpp(args)
    ir = prepare_openvino(args, log) if args.compare == "openvino" else None
    ckpt = checkpoints.load_checkpoint(args.model or checkpoints.default_model_path(), dtype=torch_dtype(args.dtype),
                                       gguf_blocks=args.weight_format == "gguf")
    data = run_bench(ckpt, spec, compared_engine(args, ckpt, spec, ir), log)
    if not args.json:
        for line in report_lines(data, args.compare):
            print(line)
    if args.plot:
        plot(data, args.plot)
    return data


def report_lines(data: dict[str, Any], compare: str | None) -> list[str]:
    """The summary after the per-case lines: bandwidth, compile, memory, the comparison table."""
    lines = [format_bandwidth(row) for row in data["bandwidth"]]
    lines += [f"compile B={c['batch_size']}: {c['compile_s']:.1f} s for {c['graphs']} graphs" for c in data["compile"]]
    lines += [format_memory(m) for m in data["memory"]]
    if compare:
        lines.append(f"both engines on {data['threads']} threads")
        lines += comparison_table([BenchResult(**r) for r in data["results"]], compare)
        lines += [format_rounds(row) for row in data["rounds"]]  # each engine's row above is its median round
        lines += [format_agreement(row) for row in data["agreement"]]
    return lines


BENCHMARK = Benchmark(name="latency", help="TTFT, TPOT, ITL and tok/s per batch size, prompt and generation length; against "
                      "transformers, llama.cpp, OpenVINO GenAI or another checkout", description=__doc__, add_arguments=add_arguments, run=run)
