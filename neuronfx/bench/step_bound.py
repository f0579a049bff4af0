"""``neuronfx bench step-bound``: a batch-1 decode step against its products alone, per weight
format (issue 34's step bound: the step's wall time at most 1.10x its products alone).

For each format of --weight-formats (float32, bfloat16: float weights in that dtype; int8, int4:
quantized at load; gguf: the kept Q4_0/Q4_1/Q8_0 blocks of a .gguf --model) the batch-1 plan of
the model (default: SmolLM2-135M-Instruct) is compiled on --backend (default inductor), then two
runners alternate for --rounds rounds after one warm-up each:

- ``step``: greedy decoding of one --prompt-len prompt through the step functions, the median
  inter-token latency of --gen-len tokens (``bench/timing.py``'s ``time_neuronfx``);
- ``products``: only the kernel calls the compiled CPU graph makes for the products of one
  decode step (per layer Q/K/V, o_proj, gate/up, down; then the LM head), on the runtime's own
  weights, the kernel chosen by the plan's ops bundle (``bench/step_products.py``), the median
  of --gen-len - 1 passes.

Reported per format (median rounds): step ms, products ms, the rest (step - products: norms,
RoPE, attention, the argmax of the greedy graphs these greedy rows run, host), the median
same-round ratio step / products (the bound: at most 1.10), the weight bytes a step reads and
the products' bytes, each over its time in GB/s, beside this machine's read bandwidth (a large ``torch.sum``). The products are called from
Python, a couple of us of dispatch each (about 120 calls a SmolLM2 step), which a compiled
graph does not pay: the products-alone time is slightly high, so the ratio slightly flatters the
step. The products are those of the CPU kernel ops whatever --backend runs the step (eager and
export run plain torch: their ratio compares them with the kernels). --activation-format int8
gives the quantized formats int8 activations (inductor only; "auto": where they measured faster)."""

from __future__ import annotations

import argparse
import gc
import time
from collections import Counter
from typing import Any

import attrs
import torch

import neuronfx
from neuronfx.api import check_weight_source
from neuronfx.bench.bandwidth import decode_weight_bytes, format_read_bandwidth, read_bandwidth
from neuronfx.bench.options import add_model, add_threads, check_at_least, logger, set_threads
from neuronfx.bench.rounds import alternate, median
from neuronfx.bench.step_products import check_dense, kernel_calls, products_bytes, step_products, time_calls
from neuronfx.bench.timing import random_prompts, time_neuronfx
from neuronfx.bench.types import Benchmark
from neuronfx.config.dtypes import torch_dtype
from neuronfx.config.inference import ACTIVATION_FORMATS, BACKENDS, InferenceConfig
from neuronfx.config.plan import make_plan
from neuronfx.errors import BackendUnavailableError, InputError
from neuronfx.graphs.kernels import library as kernels
from neuronfx.graphs.kernels.activation_choice import plan_int8_paths
from neuronfx.graphs.kernels.bundles import cpu_kernel_ops
from neuronfx.io import checkpoints

TARGET_RATIO = 1.10
"""Issue 34's bound: a batch-1 decode step's wall time over its products alone."""


@attrs.frozen(kw_only=True)
class StepFormat:
    """One --weight-formats value: the plan's dtype and weight format."""

    dtype: str
    weight_format: str


FORMATS = {"float32": StepFormat(dtype="float32", weight_format="float"),
           "bfloat16": StepFormat(dtype="bfloat16", weight_format="float"),
           "int8": StepFormat(dtype="float32", weight_format="int8"),
           "int4": StepFormat(dtype="float32", weight_format="int4"),
           "gguf": StepFormat(dtype="float32", weight_format="gguf")}
DEFAULT_FORMATS = ("float32", "bfloat16", "int8", "gguf")
QUANTIZED = ("int8", "int4", "gguf")  # the weight formats whose products take int8 activations


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --weight-formats, --activation-format, --backend, --threads, --prompt-len, --gen-len, --rounds."""
    add_model(p)
    p.add_argument("--weight-formats", nargs="+", default=list(DEFAULT_FORMATS), metavar="FORMAT",
                   help=f"of {', '.join(FORMATS)} (default: {' '.join(DEFAULT_FORMATS)}; gguf needs a .gguf --model)")
    p.add_argument("--activation-format", default="float", choices=ACTIVATION_FORMATS,
                   help="int8: the quantized formats take int8 activations; auto: where measured faster (inductor only; default float)")
    p.add_argument("--backend", choices=BACKENDS, default="inductor", help="(default inductor)")
    add_threads(p)
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens before the timed steps (default 128)")
    p.add_argument("--gen-len", type=int, default=64, help="tokens per step round; products passes per round: one fewer (default 64)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds of step and products per format (default 5)")


def inference_of(fmt: str, args: argparse.Namespace) -> InferenceConfig:
    """The batch-1 InferenceConfig of ``fmt``, with the latency bench's capacities
    (``timing.bench_plan``'s, raised to fit the prompt and the tokens), checked now: ConfigError
    for a combination it refuses (int8 activations off inductor)."""
    f = FORMATS[fmt]
    act = args.activation_format if f.weight_format in QUANTIZED else "float"
    return InferenceConfig(batch_size=1, batch_buckets=(1,), max_context_length=max(256, args.prompt_len),
                           sequence_length=max(512, args.prompt_len + args.gen_len), dtype=f.dtype, backend=args.backend,
                           weight_format=f.weight_format, activation_format=act)


def check_options(args: argparse.Namespace, model: str) -> None:
    """Every option, before anything loads: InputError for an unknown format or a count below
    its minimum, ConfigError for gguf without a .gguf model or int8 activations off inductor,
    BackendUnavailableError when the kernel library did not build (no products to time)."""
    bad = [f for f in args.weight_formats if f not in FORMATS]
    if bad:
        raise InputError(f"--weight-formats has {', '.join(map(repr, bad))}; the formats are {', '.join(FORMATS)}.")
    check_at_least("prompt_len", args.prompt_len, 1)
    check_at_least("gen_len", args.gen_len, 2)
    check_at_least("rounds", args.rounds, 1)
    for fmt in args.weight_formats:
        check_weight_source(inference_of(fmt, args), model)
    if not kernels.small_gemm_available():
        raise BackendUnavailableError("the neuronfx kernel library did not build on this machine (a C++ compiler and torch's "
                                      "headers are needed, NEURONFX_KERNELS unset); a step's kernel products cannot be timed.")


def measure(model: str, fmt: str, args: argparse.Namespace) -> dict[str, Any]:
    """Compile ``fmt``'s batch-1 plan, list its step's kernel calls, warm both runners up and
    alternate them; the format's figures (see :func:`figures`)."""
    f, inference = FORMATS[fmt], inference_of(fmt, args)
    ckpt = checkpoints.load_checkpoint(model, dtype=torch_dtype(f.dtype), gguf_blocks=f.weight_format == "gguf")
    check_dense(ckpt.config)
    plan = make_plan(ckpt.config, inference)
    t0 = time.perf_counter()
    runtime = neuronfx.compile(plan, ckpt.state_dict, progress=False)
    compile_s = time.perf_counter() - t0
    prompts = random_prompts(ckpt.config.vocab_size, 1, args.prompt_len)
    del ckpt
    gc.collect()
    products = step_products(runtime.weights, plan.model)
    calls = kernel_calls(products, cpu_kernel_ops(f.dtype, plan_int8_paths(plan)), torch_dtype(f.dtype))
    runs = {"step": lambda: median(time_neuronfx(runtime, prompts, args.gen_len)[1]),
            "products": lambda: time_calls(calls, args.gen_len - 1)}
    for run_once in runs.values():
        run_once()  # warm-up
    timed = alternate(runs, args.rounds)
    sizes = {"step_bytes": decode_weight_bytes(runtime.weights, 1), "products_bytes": products_bytes(products)}
    return figures(fmt, inference, timed, sizes) | {"compile_s": compile_s, "products": len(calls),
                                                     "ops": dict(Counter(c.name for c in calls))}


def figures(fmt: str, inference: InferenceConfig, timed: dict[str, list[float]], sizes: dict[str, int]) -> dict[str, Any]:
    """One format's JSON-able figures from its rounds (seconds per runner) and byte counts:
    median ms of each runner, the rest, the median same-round ratio step / products, GB/s."""
    step, products = median(timed["step"]), median(timed["products"])
    ratios = [s / p for s, p in zip(timed["step"], timed["products"], strict=True)]
    return {"format": fmt, "dtype": inference.dtype, "weight_format": inference.weight_format,
            "activation_format": inference.activation_format, "step_ms": step * 1e3, "products_ms": products * 1e3,
            "rest_ms": (step - products) * 1e3, "ratio": median(ratios), "round_ratios": ratios,
            "step_rounds_ms": [s * 1e3 for s in timed["step"]], "products_rounds_ms": [p * 1e3 for p in timed["products"]],
            **sizes, "step_gb_s": sizes["step_bytes"] / step / 1e9, "products_gb_s": sizes["products_bytes"] / products / 1e9,
            "within_bound": median(ratios) <= TARGET_RATIO}


def table(rows: list[dict[str, Any]], read_gb_s: float) -> list[str]:
    """Markdown lines: per format, step / products / rest ms, the ratio against the bound,
    MB per step and of the products, GB/s of each and the products' share of ``read_gb_s``."""
    lines = [f"| format | step ms | products ms | rest ms | step / products (<= {TARGET_RATIO:.2f}) | step MB | products MB | "
             "step GB/s | products GB/s | products / read bandwidth |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        name = r["format"] + {"float": "", "int8": "-int8x", "auto": "-auto"}[r["activation_format"]]
        mark = "" if r["within_bound"] else " (over)"
        lines.append(f"| {name} | {r['step_ms']:.2f} | {r['products_ms']:.2f} | {r['rest_ms']:.2f} | {r['ratio']:.3f}x{mark} | "
                     f"{r['step_bytes'] / 1e6:.1f} | {r['products_bytes'] / 1e6:.1f} | {r['step_gb_s']:.2f} | "
                     f"{r['products_gb_s']:.2f} | {r['products_gb_s'] / read_gb_s:.0%} |")
    return lines


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Check every option, measure the read bandwidth, then each format in turn; print the table."""
    model = str(args.model or checkpoints.default_model_path())
    check_options(args, model)
    set_threads(args.threads)
    bandwidth = read_bandwidth()
    log = logger(args)
    log(format_read_bandwidth(bandwidth))
    log(f"{model}, {args.backend}, batch 1, prompt {args.prompt_len}, {args.gen_len} tokens per round, {args.rounds} rounds, "
        f"{torch.get_num_threads()} threads; quantized kernels {kernels.quant_isa()}, int8 activations {kernels.quant_int8_x_isa()}")
    rows = []
    for fmt in args.weight_formats:
        rows.append(measure(model, fmt, args))
        r = rows[-1]
        log(f"{fmt}: step ms per round " + " ".join(f"{v:.2f}" for v in r["step_rounds_ms"]) + "; products "
            + " ".join(f"{v:.2f}" for v in r["products_rounds_ms"]) + f" ({r['products']} kernel calls)")
        gc.collect()
    for line in table(rows, bandwidth["bytes_per_s"] / 1e9):
        log(line)
    return {"model": model, "backend": args.backend, "threads": torch.get_num_threads(), "prompt_len": args.prompt_len,
            "gen_len": args.gen_len, "rounds": args.rounds, "target_ratio": TARGET_RATIO, "read_bandwidth": bandwidth, "formats": rows}


BENCHMARK = Benchmark(name="step-bound", help="a batch-1 decode step against its products alone, per weight format (the step "
                      "bound: at most 1.10x)", description=__doc__, add_arguments=add_arguments, run=run)
