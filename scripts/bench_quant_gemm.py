"""Decode products per weight format against this machine's memory read bandwidth, in one run.

Usage: .venv/bin/python scripts/bench_quant_gemm.py [--threads 2] [--reps 5] [--formats fp32 int8 q4_1]

For each format, every linear product of one SmolLM2-135M decode step (30 layers of q 576x576,
k and v 192x576, o 576x576, gate and up 1536x576, down 576x1536, then the 49152x576 LM head:
134.5M weights, so the weights stream from memory as in a real step, not from cache) at 1 and 8
rows of x: fp32 and bf16 weights through ``small_gemm``, the quantized formats through
``quant_gemm`` (see :data:`FORMATS` for the int8-activation rows and SmolLM2's own mix). Prints the best of ``--reps`` step times and the effective weight bytes/s next
to the read bandwidth of a large ``torch.sum`` at the same thread count. The weights are random
(speed does not depend on their values); about 40 s and 0.6 GB of memory.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from neuronfx.graphs import kernels
from neuronfx.graphs import quant as Q

LAYERS = 30
LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
LM_HEAD = (49152, 576)
FORMATS = ["fp32", "bf16", "int8", "int4-g32", "int4-g128", "q4_0", "q4_1", "q8_0", "int4-g32-int8x", "q4_0-int8x", "q4_1-int8x",
           "q4_1+q8_0", "q4_1+q8_0-int8x"]
"""A suffix "-int8x" runs the 4-bit products with int8 activations (``activation_format="int8"``);
"q4_1+q8_0" is SmolLM2's GGUF as the kept blocks hold it: Q4_1 layers and a Q8_0 LM head, the
products of exactly one decode step of that plan."""


def read_bandwidth(reps: int = 3) -> float:
    """GB/s of ``torch.sum`` over 1 GiB of fp32 (far beyond the caches), best of ``reps``."""
    big = torch.ones(2**28)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t)
    return big.numel() * 4 / best / 1e9


def _gguf_blocks(fmt: str, n: int, k: int) -> Q.QuantizedWeight:
    """Random GGUF blocks with a finite fp16 d (and m): random bytes would hold NaN / inf headers."""
    size, blocks = Q.GGUF_BLOCK_BYTES[fmt], k // Q.GGUF_BLOCK
    data = torch.randint(0, 256, (n, blocks, size), dtype=torch.uint8)
    data[..., 0:2] = torch.full((n, blocks, 1), 0.01, dtype=torch.float16).view(torch.uint8)
    if fmt == "q4_1":
        data[..., 2:4] = torch.full((n, blocks, 1), -0.08, dtype=torch.float16).view(torch.uint8)
    return {"q4_0": Q.Q4_0Blocks, "q4_1": Q.Q4_1Blocks, "q8_0": Q.Q8_0Blocks}[fmt](data.view(n, blocks * size))


def make_weight(fmt: str, n: int, k: int) -> torch.Tensor | Q.QuantizedWeight:
    """A random (n, k) weight in ``fmt``, built directly in its layout (quantizing 134M weights
    would dominate the run)."""
    if fmt in ("fp32", "bf16"):
        return torch.rand(n, k, dtype=torch.float32 if fmt == "fp32" else torch.bfloat16)
    if fmt == "int8":
        return Q.Int8Weight(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) / 100)
    if fmt.startswith("int4"):
        group = int(fmt.split("-g")[1])
        groups = -(-k // group)
        data = torch.randint(0, 256, (n, groups * group // 2), dtype=torch.uint8)
        return Q.Int4Weight(data, torch.rand(n, groups) / 100, -torch.rand(n, groups) / 10)
    return _gguf_blocks(fmt, n, k)


def nbytes(w: torch.Tensor | Q.QuantizedWeight) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else Q.weight_bytes(w)


def step_weights(fmt: str) -> list:
    """(weight, K) of every product of one decode step in ``fmt`` (without its "-int8x")."""
    layer_fmt, _, head_fmt = fmt.partition("+")
    return [(make_weight(layer_fmt, n, k), k) for n, k in LAYER_SHAPES * LAYERS] + [(make_weight(head_fmt or layer_fmt, *LM_HEAD), LM_HEAD[1])]


def step_seconds(weights: list, rows: int, reps: int, int8_x: bool = False) -> float:
    """Best wall time of all products of one decode step at ``rows`` rows of fp32 x (``int8_x``:
    the 4-bit products with int8 activations)."""
    xs = {k: torch.randn(rows, k) for k in (576, 1536)}
    quant = functools.partial(kernels.quant_gemm, int8_x=int8_x)
    calls = [(kernels.small_gemm if isinstance(w, torch.Tensor) else quant, xs[w_k], w) for w, w_k in weights]
    best = float("inf")
    for _ in range(reps + 1):  # the first pass warms up
        t = time.perf_counter()
        for fn, x, w in calls:
            fn(x, w)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.small_gemm_available():
        raise SystemExit("the neuronfx kernels did not build on this machine")
    bandwidth = read_bandwidth()
    shapes = LAYER_SHAPES * LAYERS + [LM_HEAD]
    print(f"threads {args.threads}; SIMD path of quant_gemm: {kernels.quant_isa()}, with int8 activations "
          f"{kernels.quant_int8_x_isa()}; "
          f"memory read bandwidth (torch.sum of 1 GiB fp32): {bandwidth:.1f} GB/s")
    print(f"one SmolLM2-135M decode step: {len(shapes)} products, {sum(n * k for n, k in shapes) / 1e6:.1f}M weights")
    print(f"{'format':16s} {'MB':>6s} " + "  ".join(f"{'rows ' + str(r):>26s}" for r in (1, 8)))
    for fmt in args.formats:
        weights = step_weights(fmt.removesuffix("-int8x"))
        total = sum(nbytes(w) for w, _ in weights)
        cells = []
        for rows in (1, 8):
            s = step_seconds(weights, rows, args.reps, fmt.endswith("-int8x"))
            gbs = total / s / 1e9
            cells.append(f"{s * 1e3:7.2f} ms {gbs:5.1f} GB/s ({gbs / bandwidth:4.0%})")
        print(f"{fmt:16s} {total / 1e6:6.0f} " + "  ".join(f"{c:>26s}" for c in cells))
        del weights


if __name__ == "__main__":
    main()
