"""Decode speed, TTFT, bandwidth and resident memory of every weight format in one run, with
llama.cpp on the same GGUF: ``neuronfx bench`` once per format (fp32, int8, int4, the GGUF's
kept Q4_1 blocks), then one table of ratios (each format vs fp32, the kept blocks vs llama.cpp).

    python scripts/bench_weight_formats.py [--model FILE.gguf] [--batch-sizes 1 8]
        [--prompt-len 128] [--gen-len 64] [--backend inductor] [--no-llama-cpp] [--json]

llama.cpp runs through llama-cpp-python (the ``[bench]`` extra) on ``torch.get_num_threads()``
threads, as ``neuronfx bench --compare llama.cpp`` does. Memory is the RSS of this process
after each format's compile (formats run one after another, so later rows carry what earlier
ones left behind: compare each against its own bound, 1.3 x (weights + KV) + 400 MiB).
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from neuronfx.bench import format_bandwidth, run_bench
from neuronfx.io.checkpoints import default_model_path, load_checkpoint

FORMATS = ("float", "int8", "int4", "gguf")


def measure(model: str, fmt: str, args: argparse.Namespace) -> dict:
    """``run_bench`` of one weight format (llama.cpp along with the kept blocks)."""
    ckpt = load_checkpoint(model, dtype=torch.float32, gguf_blocks=fmt == "gguf")
    llama_cpp = model if fmt == "gguf" and not args.no_llama_cpp else None
    data = run_bench(ckpt, args.backend, "float32", args.batch_sizes, [args.prompt_len], [args.gen_len],
                     compare_transformers=False, log=lambda line: None, compare_llama_cpp=llama_cpp, weight_format=fmt)
    del ckpt
    gc.collect()
    return data


def table(runs: dict[str, dict]) -> list[str]:
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
            name = "llama.cpp Q4_1" if engine == "llama.cpp" else {"float": "fp32", "gguf": "Q4_1 blocks"}.get(fmt, fmt)
            vs_cpp = f"{r['decode_tok_s'] / cpp[0]['decode_tok_s']:.2f}x" if cpp and engine != "llama.cpp" else ""
            lines.append(f"| {name} | {batch} | {r['decode_tok_s']:.1f} | {r['decode_tok_s'] / fp32:.2f}x | {vs_cpp} | "
                         f"{r['ttft_s'] * 1e3:.0f} | {bw['bytes_per_s'] / 1e9:.2f} | {bw['share_of_read_bandwidth'] * 100:.0f}% |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file with Q4_0/Q4_1/Q8_0 blocks (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp (llama-cpp-python not installed)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model = args.model or default_model_path()
    runs = {}
    for fmt in args.formats:
        runs[fmt] = measure(model, fmt, args)
        if not args.json:
            for bw in runs[fmt]["bandwidth"]:
                print(format_bandwidth(bw))
            for m in runs[fmt]["memory"]:
                bound = 1.3 * (m["weights_bytes"] + m["kv_bytes"]) + 400 * 2**20
                print(f"memory {fmt} B={m['batch_size']}: RSS {m['rss_bytes'] / 2**20:.0f} MiB; weights "
                      f"{m['weights_bytes'] / 2**20:.0f} MiB + KV {m['kv_bytes'] / 2**20:.0f} MiB; bound {bound / 2**20:.0f} MiB")
    if args.json:
        print(json.dumps(runs))
        return
    print(f"\n{model}, {args.backend}, prompt {args.prompt_len}, {args.gen_len} new tokens, {torch.get_num_threads()} threads")
    print("\n".join(table(runs)))


if __name__ == "__main__":
    main()
