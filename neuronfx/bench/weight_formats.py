"""``neuronfx bench weight-formats``: decode speed, TTFT, bandwidth and resident memory of every
weight format in one run, with llama.cpp on the same GGUF: the latency benchmark once per
format (fp32, int8, int4, the GGUF's kept Q4_0/Q4_1/Q8_0 blocks; llama.cpp beside the kept
blocks, on the same thread count), then one table of ratios (each format against fp32, the
kept blocks against llama.cpp). Memory is the RSS of this process after each format's compile
(formats run one after another, so later rows carry what earlier ones left behind: compare
each against its own bound, 1.3 x (weights + KV) + 400 MiB)."""

from __future__ import annotations

import argparse
import functools
import gc
from typing import Any

import torch

from neuronfx.api import check_weight_source
from neuronfx.bench.bandwidth import format_bandwidth, format_memory
from neuronfx.bench.latency_run import LatencySpec, run_bench
from neuronfx.bench.llama_cpp import import_llama_cpp, llama_cpp_engine
from neuronfx.bench.options import check_at_least
from neuronfx.bench.types import Benchmark
from neuronfx.config.inference import BACKENDS, InferenceConfig
from neuronfx.io import checkpoints

FORMATS = ("float", "int8", "int4", "gguf")
NAMES = {"float": "fp32", "gguf": "GGUF blocks"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--model (a .gguf), the case, --backend, --formats and --no-llama-cpp."""
    p.add_argument("--model", default=None, help="a .gguf file with Q4_0/Q4_1/Q8_0 blocks (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--backend", choices=BACKENDS, default="inductor")
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp (llama-cpp-python not installed)")


def measure(model: str, fmt: str, args: argparse.Namespace) -> dict[str, Any]:
    """The latency benchmark of one weight format (llama.cpp along with the kept blocks)."""
    ckpt = checkpoints.load_checkpoint(model, dtype=torch.float32, gguf_blocks=fmt == "gguf")
    spec = LatencySpec(backend=args.backend, dtype="float32", batch_sizes=tuple(args.batch_sizes), prompt_lens=(args.prompt_len,),
                       gen_lens=(args.gen_len,), weight_format=fmt)
    compare = functools.partial(llama_cpp_engine, model, torch.get_num_threads()) if fmt == "gguf" and not args.no_llama_cpp else None
    data = run_bench(ckpt, spec, compare, log=lambda line: None)
    del ckpt
    gc.collect()
    return data


def table(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows: per format and batch size, decode tok/s, TTFT, ratios, bandwidth share."""
    def row_of(data: dict, engine: str, batch: int) -> dict:
        return next(r for r in data["results"] if r["engine"] == engine and r["batch_size"] == batch)

    lines = ["| weights | batch | decode tok/s | vs fp32 | vs llama.cpp | TTFT ms | GB/s read | share of bandwidth |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for fmt, data in runs.items():
        for bw in data["bandwidth"]:
            batch, engine = bw["batch_size"], bw["engine"]
            r = row_of(data, engine, batch)
            fp32 = row_of(runs["float"], "neuronfx", batch)["decode_tok_s"] if "float" in runs else float("nan")
            cpp = [x for x in data["results"] if x["engine"] == "llama.cpp" and x["batch_size"] == batch]
            name = f"llama.cpp {r['dtype']}" if engine == "llama.cpp" else NAMES.get(fmt, fmt)
            vs_cpp = f"{r['decode_tok_s'] / cpp[0]['decode_tok_s']:.2f}x" if cpp and engine != "llama.cpp" else ""
            lines.append(f"| {name} | {batch} | {r['decode_tok_s']:.1f} | {r['decode_tok_s'] / fp32:.2f}x | {vs_cpp} | "
                         f"{r['ttft_s'] * 1e3:.0f} | {bw['bytes_per_s'] / 1e9:.2f} | {bw['share_of_read_bandwidth'] * 100:.0f}% |")
    return lines


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Check the options (the gguf format needs a .gguf --model; llama.cpp its package), measure
    each format in turn, print each one's bandwidth and memory lines and the table."""
    check_at_least("batch_sizes", args.batch_sizes, 1)
    check_at_least("prompt_len", args.prompt_len, 1)
    check_at_least("gen_len", args.gen_len, 2)
    model = str(args.model or checkpoints.default_model_path())
    for fmt in args.formats:
        check_weight_source(InferenceConfig(weight_format=fmt), model)
    if "gguf" in args.formats and not args.no_llama_cpp:
        import_llama_cpp()
    runs = {}
    for fmt in args.formats:
        runs[fmt] = measure(model, fmt, args)
        if not args.json:
            print("\n".join([format_bandwidth(bw) for bw in runs[fmt]["bandwidth"]]
                            + [format_memory(m, f"{fmt} ") for m in runs[fmt]["memory"]]))
    if not args.json:
        print(f"\n{model}, {args.backend}, prompt {args.prompt_len}, {args.gen_len} new tokens, {torch.get_num_threads()} threads")
        print("\n".join(table(runs)))
    return runs


BENCHMARK = Benchmark(name="weight-formats", help="every weight format (fp32, int8, int4, kept GGUF blocks) and llama.cpp on "
                      "the same GGUF, one table of ratios", description=__doc__, add_arguments=add_arguments, run=run)
