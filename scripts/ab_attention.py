"""A/B of the decode attention kernel (``neuronfx::cached_attention``, csrc/small_gemm.cpp) between
this tree and a git revision, or between compile flags, in one process.

Usage: .venv/bin/python scripts/ab_attention.py --against HEAD [--kv-dtype int8] [--batch-size 8]
       [--positions 1950] [--rounds 40] [--flags="-DNAME=1 ..." ...]

Whole decode steps on the 2-core machines move by up to 40% between runs minutes apart, so a
kernel change of a few percent cannot be read from two processes. Here each variant is built
under its own op namespace (``-Dneuronfx=...`` renames the ``TORCH_LIBRARY`` namespace, as
scripts/check_quant_paths.py does), every round calls each variant once over SmolLM2's 30
layers (batch x 9 query heads over 3 KV heads of head dim 64, one slot per row, each layer its
own cache so it comes from memory as in a step), the order rotating, and the script prints each
variant's best and median round and the median over rounds of its time over the first variant's
in the same round (paired). It also prints each variant's largest difference from the first's
output on one layer. Variants: this tree's source, then ``--against`` revisions' (``git show``),
then this tree's source with each ``--flags`` string's flags added to the compiler's.
Each variant's first build takes about 40 s (the extension cache keeps it).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "neuronfx" / "graphs" / "kernels" / "csrc"
SOURCE = "neuronfx/graphs/kernels/csrc/small_gemm.cpp"
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30  # SmolLM2-135M's attention


def build(name: str, source: str, flags: list[str]):
    """``source`` (small_gemm.cpp's text) built with ``flags`` under op namespace ``name`` (its
    sources in a directory of that name under the temp dir, so a second run finds the build up
    to date); its ``cached_attention`` op."""
    d = Path(tempfile.gettempdir()) / "neuronfx-ab" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "small_gemm.cpp").write_text(source)
    (d / "exp16.h").write_text((CSRC / "exp16.h").read_text())
    load(name=name, sources=[str(d / "small_gemm.cpp")], extra_cflags=["-O3", "-march=native", "-fopenmp", f"-Dneuronfx={name}", *flags],
         is_python_module=False, verbose=False)
    return getattr(torch.ops, name).cached_attention


def variants(args: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """(label, source text, extra flags) per variant, the working tree's first."""
    tree = (ROOT / SOURCE).read_text()
    out = [("this tree", tree, [])]
    for rev in args.against:
        shown = subprocess.run(["git", "show", f"{rev}:{SOURCE}"], cwd=ROOT, capture_output=True, text=True)
        if shown.returncode != 0:
            raise SystemExit(f"ab_attention.py: --against {rev!r}: git show found no {SOURCE} there ({shown.stderr.strip()})")
        out.append((f"--against {rev}", shown.stdout, []))
    out += [(f"--flags {f!r}", tree, f.split()) for f in args.flags]
    return out


def caches(kv_dtype: str, batch: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V caches (batch, KV heads, slots, W): int8 rows with their fp32 scale
    (W = 68), or bf16 / fp32 rows (W = 64), random."""
    shape = (batch, KV_HEADS, slots, HEAD_DIM)
    if kv_dtype != "int8":
        dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[kv_dtype]
        return torch.randn(shape).to(dt), torch.randn(shape).to(dt)
    rows = []
    for _ in range(2):
        t = torch.randint(-127, 128, (*shape[:3], HEAD_DIM + 4), dtype=torch.int8)
        t[..., HEAD_DIM:] = torch.rand(*shape[:3], 1).mul(0.02).view(torch.int8)
        rows.append(t)
    return rows[0], rows[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", nargs="*", default=[], help="git revisions whose small_gemm.cpp to compare")
    p.add_argument("--flags", action="append", default=[],
                   help="extra compiler flags for one more variant of this tree, as --flags=\"-DNAME=1 ...\" (repeatable)")
    p.add_argument("--kv-dtype", choices=("int8", "bf16", "fp32"), default="int8")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--positions", type=int, default=1950, help="live positions per row (the slots hold the next power of two)")
    p.add_argument("--rounds", type=int, default=40)
    args = p.parse_args()
    if args.positions < 1 or args.batch_size < 1 or args.rounds < 1:
        p.error(f"--positions, --batch-size and --rounds must be >= 1 (got {args.positions}, {args.batch_size}, {args.rounds})")
    specs = variants(args)
    if len(specs) < 2:
        p.error("nothing to compare: give --against REV or --flags FLAGS")
    slots = 1 << (args.positions - 1).bit_length()
    torch.manual_seed(0)
    q = torch.randn(args.batch_size, HEADS, 1, HEAD_DIM)
    mask = torch.zeros(args.batch_size, 1, 1, slots, dtype=torch.bool)
    mask[..., : args.positions] = True
    table = torch.arange(args.batch_size, dtype=torch.int32)[:, None]
    layers = [caches(args.kv_dtype, args.batch_size, slots) for _ in range(LAYERS)]
    ops = []
    for label, text, flags in specs:
        name = "nfxab_" + hashlib.sha256((text + " ".join(flags)).encode()).hexdigest()[:10]
        ops.append((label, build(name, text, flags)))
    first = ops[0][1](q, *layers[0], table, mask)
    for label, op in ops:
        print(f"{label}: largest |difference| from the first's output {(op(q, *layers[0], table, mask) - first).abs().max().item():.3g}")
    times: dict[str, list[float]] = {label: [] for label, _ in ops}
    for r in range(args.rounds):
        for label, op in ops[r % len(ops):] + ops[: r % len(ops)]:
            t = time.perf_counter()
            for k, v in layers:
                op(q, k, v, table, mask)
            times[label].append(time.perf_counter() - t)
    base = times[ops[0][0]]
    print(f"{args.kv_dtype} KV, batch {args.batch_size} x {args.positions} positions, {LAYERS} layers, {args.rounds} rounds, "
          f"{torch.get_num_threads()} threads")
    for label, ts in times.items():
        paired = statistics.median(a / b for a, b in zip(ts, base))
        print(f"  {label:40s} best {min(ts) * 1e3:7.2f} ms  median {statistics.median(ts) * 1e3:7.2f} ms  x{paired:.3f} of the first (paired median)")


if __name__ == "__main__":
    sys.exit(main())
