"""Where a quantized plan's products take int8 activations: ``activation_format`` "float",
"int8", or "auto" (measured once per machine and kept, as ``gemm_choice`` keeps its verdict).

A path is (weight kind, rows): the kind is "int8" (:class:`~neuronfx.graphs.models.quant.Int8Weight`)
or "4bit" (int4, Q4_0, Q4_1); rows are "one" (a decode of batch 1), "batch" (2 to
``SMALL_GEMM_MAX_ROWS`` rows: larger decode batches, speculation) or "prefill" (more). With int8
activations:

- int8 weights, any rows: x rounded per row and an integer GEMM, as torchao's and OpenVINO's
  dynamic quantization: decode rows through the kernel ``library.w8a8_gemm`` (VNNI or AVX2), more rows
  through ``int8_x.w8a8_linear`` (``torch._int_mm``: oneDNN's VNNI / AMX), the same bits;
- 4-bit weights: where both the plan's decode rows and prefill rows take int8 x, the layers'
  weights in groups of 32 are packed for ``vpdpbusd`` (:func:`pack_weights`) and every product
  rounds x per 32 values (``library.w4a8_packed``, as OpenVINO's int4 weights with dynamic
  quantization in groups of 32); otherwise (under "int8": int4 groups of 64 or more) decode
  rows take the kernel's per-32-values integer products (``quant_gemm``'s ``int8_x``, llama.cpp's
  ``q8_1`` rounding) and prefill keeps float x. "auto" times the packed kernel for the 4-bit
  paths, so a plan whose 4-bit weights do not pack keeps float x for them.

Which is faster depends on the CPU (VNNI, AMX, whether 4-bit unpacking or memory bounds a
product) and on the shapes, so "auto" times both ways of each path on the plan's own MLP shapes
(:func:`measure`) and turns on those where int8 is more than :data:`MARGIN` times faster. The
verdict is kept in a JSON file next to the kernel builds, keyed by the shapes, CPU flags, torch
version, thread count and ``ONEDNN_MAX_CPU_ISA``; delete it to measure again. int8 activations
are never token-exact (they add x's rounding error), which is why "float" is the default.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import torch

from neuronfx.config.plan import Plan
from neuronfx.graphs.kernels import library
from neuronfx.graphs.kernels.gemm_choice import verdict_root, write_verdict
from neuronfx.graphs.models import int8_x, quant
from neuronfx.graphs.models.layers import Weights

AVAILABLE = frozenset({("int8", "one"), ("int8", "batch"), ("int8", "prefill"), ("4bit", "one"), ("4bit", "batch"), ("4bit", "prefill")})
"""The (kind, rows) paths that have an int8-activation product."""
MARGIN = 1.1
"""int8 activations only where more than this much faster: a near tie keeps float x (exact)."""
PREFILL_ROWS = 128
"""Rows of the timed prefill product (a 128-token prompt)."""
MAX_PROBE_ROWS = 2048
"""Output rows of the timed weights at most: the time per weight row is what matters, and a
large model's MLP would make the probe slow to quantize."""
FLUSH_BYTES = 128 << 20
"""Bytes read between timed calls, more than a last-level cache (32 MiB on the EPYC measured):
a decode step reads each weight once per step, from memory, and a product timed on weights
still in cache favours the way that reads more bytes (measured: int8 weights at one row, 1.34x
faster hot with int8 x, a whole decode step 1.45x slower)."""
PROBE_LAYERS = 4
"""Copies of the probe's MLP weights timed back to back per call: a decode step streams every
layer's weights, and one cold pair alone (0.1 ms at one row) measured the packed 4-bit kernel
at 1.06x float x where 30 layers in a row gave 1.23x (SmolLM2, 2026-12-05)."""
REPEATS = 15
"""Timed calls of each way, interleaved, after a warm-up call each; the best counts."""


@attrs.frozen
class Int8Paths:
    """The (kind, rows) paths that take int8 activations (a subset of :data:`AVAILABLE`)."""

    enabled: frozenset[tuple[str, str]] = frozenset()

    def uses(self, weight: object, rows: int) -> bool:
        """Whether a product of ``weight`` (a float tensor or a quantized record) with x of
        ``rows`` rows takes int8 activations."""
        kind = weight_kind(weight)
        return kind is not None and (kind, row_class(rows)) in self.enabled

    def integer_gemm(self, weight: object, rows: int) -> bool:
        """Whether the product is int8 weights on an int8 path: an integer GEMM
        (``library.w8a8_packed`` for a packed weight, which every product of takes int8 x;
        ``library.w8a8_gemm`` for decode rows; else ``int8_x.w8a8_linear``), not ``quant_gemm``."""
        if isinstance(weight, quant.Int8Packed):
            return True
        return isinstance(weight, quant.Int8Weight) and self.uses(weight, rows)

    def packs_int8(self, batch_size: int) -> bool:
        """Whether int8 weights take int8 activations at prefill rows and at the decode rows of
        a plan of ``batch_size``: then the layers' int8 weights are packed for ``vpdpbusd``
        (:func:`pack_weights`) and every product of them takes int8 x, other row counts
        (speculation rows, smaller batch buckets) included."""
        return {("int8", "prefill"), ("int8", row_class(batch_size))} <= self.enabled

    def packs_int4(self, batch_size: int) -> bool:
        """Whether 4-bit weights take int8 activations at prefill rows and at the decode rows of
        a plan of ``batch_size``: then the layers' 4-bit weights in groups of 32 are packed
        (``quant.pack_int4``) and every product of them takes int8 x (``library.w4a8_packed``)."""
        return {("4bit", "prefill"), ("4bit", row_class(batch_size))} <= self.enabled

    def without(self, kind: str) -> Int8Paths:
        """These paths less those of weight ``kind`` ("int8" or "4bit")."""
        return Int8Paths(frozenset(p for p in self.enabled if p[0] != kind))

    def describe(self) -> str:
        """"none", or the paths as "int8/prefill, 4bit/one"."""
        return ", ".join(f"{k}/{r}" for k, r in sorted(self.enabled)) or "none"


FLOAT_PATHS = Int8Paths()
ALL_PATHS = Int8Paths(AVAILABLE)


def weight_kind(weight: object) -> str | None:
    """"int8", "4bit" (a format the kernel's int8_x serves), or None (float, Q8_0, other groups)."""
    if isinstance(weight, (quant.Int8Weight, quant.Int8Packed)):
        return "int8"
    if isinstance(weight, quant.Int4Packed):
        return "4bit"
    return "4bit" if isinstance(weight, quant.QUANTIZED_TYPES) and quant.int8_x_group_size(weight) else None


def row_class(rows: int) -> str:
    if rows == 1:
        return "one"
    return "batch" if rows <= library.SMALL_GEMM_MAX_ROWS else "prefill"


def _float_way(rows: int) -> Callable[[torch.Tensor, quant.QuantizedWeight], torch.Tensor]:
    if rows <= library.SMALL_GEMM_MAX_ROWS:
        return lambda x, q: library.quant_gemm(x, q)
    return lambda x, q: library.quant_prefill(x, q)  # tiles dequantized in cache, then fp32 GEMM


def _int8_way(kind: str, rows: int) -> Callable[[torch.Tensor, quant.QuantizedWeight], torch.Tensor]:
    if kind == "int8" and rows <= library.PACKED_KERNEL_MAX_ROWS:  # the packed weights' kernel, which rounds x itself
        return lambda x, q: library.w8a8_packed(x, q)
    if kind == "int8":  # x rounded beforehand: in a compiled graph the rounding and the scaling are fused passes
        return lambda x, q: torch._int_mm(x, q.rows.t()).float() * q.scale
    return lambda x, q: library.w4a8_packed(x, q)  # packed 4-bit weights, any rows


def _best(ways: list[Callable[[], object]], repeats: int, flush: torch.Tensor) -> list[float]:
    best = [float("inf")] * len(ways)
    for i in range(repeats + 1):
        for j, way in enumerate(ways):  # interleaved: a burst of load from elsewhere hits both
            flush.sum()  # the weights leave the caches, as a decode step finds them
            t0 = time.perf_counter()
            way()
            if i:  # the first call of each is a warm-up
                best[j] = min(best[j], time.perf_counter() - t0)
    return best


def measure(hidden: int, intermediate: int, batch_rows: int, repeats: int = REPEATS) -> dict[tuple[str, str], tuple[float, float]]:
    """Best seconds (float x, int8 x) of each path in :data:`AVAILABLE` on random weights of the
    MLP's shapes, gate (intermediate, hidden) and down (hidden, intermediate), :data:`PROBE_LAYERS`
    copies in a row, summed: int8 weights and GGUF Q4_1 (K and N rounded up to multiples of 32
    and 16: the time per weight row is what counts), the 4-bit int8 way packed
    (``library.w4a8_packed``). Rows: 1, ``batch_rows`` (skipped when 1) and :data:`PREFILL_ROWS`. The int8 weights' way: at decode rows the ``w8a8_gemm`` kernel (which
    rounds x itself); at prefill rows the integer GEMM and output scaling on x rounded beforehand
    (a compiled graph fuses x's rounding into the pass that makes x). Needs the kernel library."""
    g = torch.Generator().manual_seed(0)
    shapes = [(min(intermediate, MAX_PROBE_ROWS), hidden), (min(hidden, MAX_PROBE_ROWS), intermediate)]
    weights = {"int8": _copies([quant.quantize_int8(torch.randn(s, generator=g)) for s in shapes]),
               "4bit": _copies([_q4_1(torch.randn(-(-n // 16) * 16, -(-k // 32) * 32, generator=g)) for n, k in shapes])}
    sizes = {"one": 1, "batch": batch_rows, "prefill": PREFILL_ROWS}
    flush = torch.ones(FLUSH_BYTES // 4)
    with torch.no_grad():
        return {(kind, rows): _time_path(kind, weights[kind], sizes[rows], g, flush, repeats)
                for kind, rows in sorted(AVAILABLE) if not (rows == "batch" and batch_rows == 1)}


def _copies(weights: list[quant.QuantizedWeight]) -> list[quant.QuantizedWeight]:
    """:data:`PROBE_LAYERS` copies of ``weights`` in their own memory, one layer after another."""
    return [type(q)(*(t.clone() for t in q)) for _ in range(PROBE_LAYERS) for q in weights]


def _q4_1(w: torch.Tensor) -> quant.Q4_1Blocks:
    """GGUF Q4_1 blocks of ``w`` (the gguf package's reference quantizer): the 4-bit probe
    weights, fp16 scales as the kept GGUF blocks that 4-bit plans mostly run."""
    from gguf import GGMLQuantizationType, quants

    return quant.Q4_1Blocks(torch.from_numpy(quants.quantize(w.numpy(), GGMLQuantizationType.Q4_1)))


def _time_path(kind: str, weights: list[quant.QuantizedWeight], rows: int, g: torch.Generator, flush: torch.Tensor,
               repeats: int) -> tuple[float, float]:
    """Best seconds (float x, int8 x) of ``weights``' products with x of ``rows`` rows."""
    xs = [torch.randn(rows, q.data.shape[1] if kind == "int8" else q.shape[1], generator=g) for q in weights]
    packed = [quant.pack_int8(q) if kind == "int8" else quant.pack_int4(q) for q in weights]
    xi = [int8_x.int8_rows(x)[0] for x in xs] if kind == "int8" and rows > library.PACKED_KERNEL_MAX_ROWS else xs
    plain, int8 = _float_way(rows), _int8_way(kind, rows)
    ways = [lambda: [plain(x, q) for x, q in zip(xs, weights)], lambda: [int8(x, q) for x, q in zip(xi, packed)]]
    plain_s, int8_s = _best(ways, repeats, flush)
    return plain_s, int8_s


def decide(times: dict[tuple[str, str], tuple[float, float]], margin: float = MARGIN) -> Int8Paths:
    """The paths whose int8 way was more than ``margin`` times faster than float."""
    return Int8Paths(frozenset(path for path, (plain, int8) in times.items() if int8 * margin < plain))


def cache_file(hidden: int, intermediate: int, batch_rows: int, root: Path | None = None) -> Path:
    """Where the verdict for these shapes on this CPU, torch, thread count and oneDNN ISA cap is
    kept (``root``: default ``gemm_choice.verdict_root``, which honours ``$TORCH_EXTENSIONS_DIR``)."""
    root = verdict_root() if root is None else root
    # "avx2": the kernels' AVX2 paths; an AVX2 CPU's older verdicts timed their scalar code
    key = "\n".join(map(str, [f"w4a8_packed x{PROBE_LAYERS} avx2", hidden, intermediate, batch_rows, library.cpu_flags(), torch.__version__,
                              torch.get_num_threads(), os.environ.get("ONEDNN_MAX_CPU_ISA", "")]))
    return root / f"neuronfx_int8x_{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"


def _read(path: Path) -> Int8Paths | None:
    try:
        data = json.loads(path.read_text())
        enabled = frozenset((str(k), str(r)) for k, r in data["enabled"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or unreadable: measure again
    return Int8Paths(enabled & AVAILABLE)


def measured_paths(hidden: int, intermediate: int, batch_rows: int, root: Path | None = None) -> Int8Paths:
    """The kept verdict for these shapes on this machine, or a new measurement (then kept);
    :data:`FLOAT_PATHS` where the kernel library is unavailable (no int8 product exists)."""
    if not library.small_gemm_available():
        return FLOAT_PATHS
    path = cache_file(hidden, intermediate, batch_rows, root)
    kept = _read(path)
    return kept if kept is not None else _measure_once(path, hidden, intermediate, batch_rows)


@functools.cache
def _measure_once(path: Path, hidden: int, intermediate: int, batch_rows: int) -> Int8Paths:
    """A new verdict, written to ``path`` when it can be, and kept for this process either way:
    a compile asks once per graph, and where ``path`` cannot be written (a read-only cache) each
    ask measured again, slowly, and a near tie could give one plan's graphs different paths."""
    times = measure(hidden, intermediate, batch_rows)
    paths = decide(times)
    write_verdict(path, {"enabled": sorted(paths.enabled), "seconds": {f"{k}/{r}": list(t) for (k, r), t in sorted(times.items())}})
    return paths


def int8_paths(activation_format: str, hidden: int, intermediate: int, batch_rows: int) -> Int8Paths:
    """The paths of a plan's ``activation_format`` ("float": none, "int8": all of
    :data:`AVAILABLE`, "auto": :func:`measured_paths` on its MLP shapes and largest decode batch,
    at most ``SMALL_GEMM_MAX_ROWS``). ValueError for any other value."""
    if activation_format == "float":
        return FLOAT_PATHS
    if activation_format == "int8":
        return ALL_PATHS
    if activation_format == "auto":
        return measured_paths(hidden, intermediate, min(batch_rows, library.SMALL_GEMM_MAX_ROWS))
    raise ValueError(f"activation_format={activation_format!r}: expected 'float', 'int8' or 'auto'.")


def pack_weights(plan: Plan, weights: Weights) -> Weights:
    """``weights`` with the weights that always multiply int8 activations in ``plan`` packed for
    ``vpdpbusd``, when the kernel library builds (else ``weights`` unchanged):

    - int8 weights (N a multiple of 16 and K of 4; ``quant.pack_int8``), the layers' and an int8
      LM head's, when the plan's int8 weights take int8 x at its decode rows and at prefill rows
      (:meth:`Int8Paths.packs_int8`). The head's products then take int8 x (as OpenVINO's
      dynamic quantization does); a tied embedding keeps the row-major values its lookup reads.
      A packed weight keeps its row-major values too (prefill's integer GEMM, and the tied
      embedding's rows are the same tensor), so the layers' int8 weights take twice their bytes.
      Measured (SmolLM2's 210 layer products, weights from memory, 2 threads of the EPYC): 8
      rows 7.1-7.5 ms packed against 11.0-12.2 row-major.
    - the layers' 4-bit weights in groups of 32 (int4 of group 32, Q4_0, Q4_1; N a multiple of
      16; ``quant.pack_int4``) when 4-bit weights take int8 x at its decode rows and at prefill
      rows (:meth:`Int8Paths.packs_int4`); an LM head keeps its layout (a tied embedding reads
      it). SmolLM2's 210 Q4_1 layer products, one row, weights from memory: 3.1-3.3 ms packed,
      4.7 through ``quant_gemm``'s int8 x (docs/performance.md)."""
    inf = plan.inference
    if inf.device != "cpu" or not library.small_gemm_available():
        return weights
    paths = plan_int8_paths(plan)
    int8, four = paths.packs_int8(inf.batch_size), paths.packs_int4(inf.batch_size)

    def pack(w: object) -> object:
        if int8 and quant.packable(w):
            return quant.pack_int8(w)
        return quant.pack_int4(w) if four and quant.packable_int4(w) else w

    if not (int8 or four):
        return weights
    layers = [{k: pack(w) for k, w in lw.items()} for lw in weights["layers"]]
    head = weights["lm_head"]
    return weights | {"layers": layers, "lm_head": quant.pack_int8(head) if int8 and quant.packable(head) else head}


def plan_int8_paths(plan: Plan) -> Int8Paths:
    """:func:`int8_paths` of a plan: its ``activation_format``, MLP shapes and ``batch_size``;
    none on CUDA (the int8 products are CPU code)."""
    inf, model = plan.inference, plan.model
    if inf.device != "cpu":
        return FLOAT_PATHS
    paths = int8_paths(inf.activation_format, model.hidden_size, model.intermediate_size, inf.batch_size)
    if inf.activation_format == "auto" and not (packs_four_bit(plan) and paths.packs_int4(inf.batch_size)):
        # "auto" timed the packed kernel for the 4-bit paths, not quant_gemm's int8 x
        # (0.90-1.06x float x here): weights that stay unpacked keep float x
        return paths.without("4bit")
    return paths


def packs_four_bit(plan: Plan) -> bool:
    """Whether ``plan``'s 4-bit weights are of a packable kind (``quant.packable_int4``): a GGUF's
    kept Q4_0 / Q4_1 blocks, or int4 in groups of 32."""
    inf = plan.inference
    return inf.weight_format == "gguf" or (inf.weight_format == "int4" and inf.weight_group_size == quant.GGUF_BLOCK)
