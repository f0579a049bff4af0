"""``neuronfx bench kernels``: the decode products of one SmolLM2-135M step per weight format,
against this machine's memory read bandwidth.

For each format, every linear product of one decode step (--layers layers of q 576x576, k and v
192x576, o 576x576, gate and up 1536x576, down 576x1536, then the 49152x576 LM head: 134.5M
weights at 30 layers, so the weights stream from memory as in a real step) at 1 and 8 rows of
x: fp32 and bf16 weights through ``small_gemm``, the quantized formats through ``quant_gemm``.
A suffix "-int8x" runs the 4-bit products with int8 activations (``activation_format="int8"``);
"q4_1+q8_0" is SmolLM2's GGUF as the kept blocks hold it (Q4_1 layers, a Q8_0 LM head).
Reported: the best of --reps step times and the effective weight bytes/s next to the read
bandwidth of a large ``torch.sum``. The weights are random (speed does not depend on their
values); about 40 s and 0.6 GB of memory at 30 layers."""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import torch

from neuronfx.bench.bandwidth import read_bandwidth
from neuronfx.bench.options import add_threads, check_at_least, logger, set_threads
from neuronfx.bench.types import Benchmark
from neuronfx.errors import BackendUnavailableError
from neuronfx.graphs.kernels import library as kernels
from neuronfx.graphs.models import quant as Q

LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
LM_HEAD = (49152, 576)
FORMATS = ("fp32", "bf16", "int8", "int4-g32", "int4-g128", "q4_0", "q4_1", "q8_0", "int4-g32-int8x", "q4_0-int8x", "q4_1-int8x",
           "q4_1+q8_0", "q4_1+q8_0-int8x")
ROWS = (1, 8)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--threads, --reps, --formats and --layers."""
    add_threads(p)
    p.add_argument("--reps", type=int, default=5, help="timed passes per figure, the best reported (default 5)")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--layers", type=int, default=30, help="decoder layers of the step (default 30, SmolLM2-135M's)")


def gguf_blocks(fmt: str, n: int, k: int) -> Q.QuantizedWeight:
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
    return gguf_blocks(fmt, n, k)


def nbytes(w: torch.Tensor | Q.QuantizedWeight) -> int:
    """Bytes of a weight: a tensor's, or a quantized weight's data, scales and offsets."""
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else Q.weight_bytes(w)


def step_weights(fmt: str, layers: int) -> list[tuple[Any, int]]:
    """(weight, K) of every product of one decode step in ``fmt`` (without its "-int8x")."""
    layer_fmt, _, head_fmt = fmt.partition("+")
    return ([(make_weight(layer_fmt, n, k), k) for n, k in LAYER_SHAPES * layers]
            + [(make_weight(head_fmt or layer_fmt, *LM_HEAD), LM_HEAD[1])])


def step_seconds(weights: list[tuple[Any, int]], rows: int, reps: int, int8_x: bool = False) -> float:
    """Best wall time of all products of one decode step at ``rows`` rows of fp32 x (``int8_x``:
    the 4-bit products with int8 activations); the first pass warms up."""
    xs = {k: torch.randn(rows, k) for k in (576, 1536)}
    quant = functools.partial(kernels.quant_gemm, int8_x=int8_x)
    calls = [(kernels.small_gemm if isinstance(w, torch.Tensor) else quant, xs[k], w) for w, k in weights]
    best = float("inf")
    for _ in range(reps + 1):
        t = time.perf_counter()
        for fn, x, w in calls:
            fn(x, w)
        best = min(best, time.perf_counter() - t)
    return best


def format_row(fmt: str, total: int, cells: dict[int, dict[str, float]], bandwidth: float) -> str:
    """One line: a format's MB and, per row count, ms, GB/s and share of ``bandwidth`` (GB/s)."""
    text = "  ".join(f"{c['ms']:7.2f} ms {c['gb_s']:5.1f} GB/s ({c['gb_s'] / bandwidth:4.0%})" for c in cells.values())
    return f"{fmt:16s} {total / 1e6:6.0f} MB  {text}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every format at 1 and 8 rows. BackendUnavailableError when the kernels did not build."""
    check_at_least("reps", args.reps, 1)
    check_at_least("layers", args.layers, 1)
    set_threads(args.threads)
    if not kernels.small_gemm_available():
        raise BackendUnavailableError("the neuronfx kernel library did not build on this machine (a C++ compiler and torch's "
                                      "headers are needed); the products cannot be measured.")
    bandwidth = read_bandwidth()["bytes_per_s"] / 1e9
    log = logger(args)
    log(f"threads {torch.get_num_threads()}; SIMD path of quant_gemm: {kernels.quant_isa()}, with int8 activations "
        f"{kernels.quant_int8_x_isa()}; memory read bandwidth: {bandwidth:.1f} GB/s; {args.layers} layers + LM head, rows "
        + " / ".join(map(str, ROWS)))
    out: dict[str, Any] = {"read_bandwidth_gb_s": bandwidth, "isa": kernels.quant_isa(), "formats": {}}
    for fmt in args.formats:
        weights = step_weights(fmt.removesuffix("-int8x"), args.layers)
        total = sum(nbytes(w) for w, _ in weights)
        cells = {}
        for rows in ROWS:
            s = step_seconds(weights, rows, args.reps, fmt.endswith("-int8x"))
            cells[rows] = {"ms": s * 1e3, "gb_s": total / s / 1e9}
        out["formats"][fmt] = {"bytes": total, "rows": cells}
        log(format_row(fmt, total, cells, bandwidth))
    return out


BENCHMARK = Benchmark(name="kernels", help="one decode step's products per weight format at 1 and 8 rows, against the read "
                      "bandwidth", description=__doc__, add_arguments=add_arguments, run=run)
