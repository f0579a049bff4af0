"""Where a batch-1 decode step of the kept Q4_1 blocks goes, against llama.cpp, in one run: the
step's products alone (the bound a zero-overhead step would reach) beside full neuronfx steps
and llama.cpp's, rounds alternating.

    PYTHONPATH=. .venv/bin/python scripts/bench_decode_bound.py [--rounds 7] [--gen-len 64]

Runners, each timed per round as the median over ``--gen-len`` steps (prompt 128, SmolLM2's
GGUF, 2 threads unless torch says otherwise):

- ``llama.cpp``: llama-cpp-python on the same file (``neuronfx.bench_llama_cpp``), ITL.
- ``neuronfx`` / ``neuronfx-int8x``: the bench's plan, ``activation_format`` "float" / "int8", ITL.
- ``products`` / ``products-int8x``: only the kernel calls of a step's products, on the
  runtime's own weights, as the compiled graph makes them (per layer Q/K/V as one
  ``quant_gemm_multi``, ``wo``, gate and up as one ``quant_glu``, ``down``; then the Q8_0 LM
  head), called from Python (about 2 us of call overhead each, so slightly above the kernels).

Printed per round and as medians: each runner's ms per step, and llama.cpp's step time over
each runner's (above 1: faster than llama.cpp). ``llama.cpp / products`` is the most a neuronfx
step could reach with nothing but its products. Needs the ``[bench]`` extra (llama-cpp-python).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

import neuronfx
from neuronfx.bench import alternate, bench_plan, random_prompts, time_neuronfx
from neuronfx.bench_llama_cpp import import_llama_cpp, load_model, time_llama_cpp
from neuronfx.graphs import kernels
from neuronfx.io.checkpoints import default_model_path, load_checkpoint


def products_step(weights: dict, int8_x: bool) -> None:
    """The products of one batch-1 decode step with ``weights`` (a runtime's), x random."""
    x, x_mlp = torch.randn(1, 1, 576), torch.randn(1, 1, 1536)
    for lw in weights["layers"]:
        kernels.quant_gemm_multi(x, [lw["wq"], lw["wk"], lw["wv"]], [None, None, None], int8_x)
        kernels.quant_gemm(x, lw["wo"], None, int8_x)
        kernels.quant_glu(x, lw["gate"], lw["up"], int8_x)
        kernels.quant_gemm(x_mlp, lw["down"], None, int8_x)
    kernels.quant_gemm(x, weights["lm_head"], None, int8_x)


def time_products(weights: dict, int8_x: bool, steps: int) -> float:
    """Median seconds of ``steps`` product-only steps."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        products_step(weights, int8_x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds of the five runners (default: 7)")
    ap.add_argument("--gen-len", type=int, default=64, help="decode steps per runner and round (default: 64)")
    args = ap.parse_args()
    lib = import_llama_cpp()
    path = default_model_path()
    ckpt = load_checkpoint(path, dtype=torch.float32, gguf_blocks=True)
    threads = torch.get_num_threads()
    runtimes = {act: neuronfx.compile(bench_plan(ckpt, "inductor", "float32", 1, 128, args.gen_len, weight_format="gguf",
                                                 activation_format=act), ckpt.state_dict, progress=False)
                for act in ("float", "int8")}
    weights = runtimes["float"].weights
    print(f"SmolLM2-135M Q4_1 blocks kept, batch 1, prompt 128, {args.gen_len} new tokens, {threads} threads; "
          f"kernels {kernels.quant_isa()} / int8 activations {kernels.quant_int8_x_isa()}")
    prompts = random_prompts(ckpt.config.vocab_size, 1, 128)
    with load_model(lib, path) as model:
        runs = {
            "llama.cpp": lambda: statistics.median(time_llama_cpp(lib, model, prompts, args.gen_len, threads)[1]),
            "neuronfx": lambda: statistics.median(time_neuronfx(runtimes["float"], prompts, args.gen_len)[1]),
            "neuronfx-int8x": lambda: statistics.median(time_neuronfx(runtimes["int8"], prompts, args.gen_len)[1]),
            "products": functools.partial(time_products, weights, False, args.gen_len),
            "products-int8x": functools.partial(time_products, weights, True, args.gen_len),
        }
        for run in runs.values():  # warm-up
            run()
        timed = alternate(runs, args.rounds)
    for name, values in timed.items():
        ratios = [a / b for a, b in zip(timed["llama.cpp"], values)]
        print(f"{name:15s} ms per step: " + " ".join(f"{v * 1e3:5.2f}" for v in values)
              + f"; median {statistics.median(values) * 1e3:5.2f}")
        if name != "llama.cpp":
            print(f"{'':15s} llama.cpp / {name} per round: " + " ".join(f"{r:.2f}" for r in ratios)
                  + f"; median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
