"""A/B of the decode attention kernel (``neuronfx::cached_attention``, csrc/small_gemm.cpp): this
tree's source against git revisions' and against other compile flags, in one process.

Usage: .venv/bin/python scripts/ab_attention.py [--against REV ...] [--flags="-DNAME=1 ..." ...]
       [--kv-dtype int8|bf16|fp32] [--batch-size 8] [--positions 1950] [--rounds 40]

Whole decode steps on the 2-core machines move by up to 40% between runs minutes apart, so a
kernel change of a few percent cannot be read from two processes. Here each variant is built
under its own op namespace (``-Dneuronfx=...`` renames the ``TORCH_LIBRARY`` namespace, as
scripts/check_quant_paths.py does), every round calls each variant once over SmolLM2's 30
layers (batch x 9 query heads over 3 KV heads of head dim 64, one slot per row, each layer its
own cache so it comes from memory as in a step), the order rotating, and the script prints each
variant's largest difference from the first variant's output on one layer, then its best and
median round and the median over rounds of its time over the first variant's in the same round
(paired). Variants: this tree's source, then each ``--against`` revision's (``git show``; the op
takes a block table from a447def on, so older revisions cannot be called), then this tree's
source with each ``--flags`` string's flags added. Every variant includes this tree's exp16.h.
Builds go to torch's extension directory under ``nfxab_<hash of the source, flags, CPU and torch
install>``; a variant identical to another shares its build, and a rerun loads it without
building (two first builds and 20 rounds took 31 s here).
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from neuronfx.graphs.kernels import library as kernels  # noqa: E402

SMALL_GEMM = next(s for s in kernels.SOURCES if s.name == "small_gemm.cpp")
CSRC = SMALL_GEMM.parent
SOURCE = SMALL_GEMM.relative_to(ROOT).as_posix()  # as git show names it
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30  # SmolLM2-135M's attention


def write_if_changed(path: Path, text: str) -> None:
    """``text`` into ``path`` unless it holds it already: a rewritten source is newer than its
    object file, and ninja would rebuild it."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def build_name(source: str, flags: list[str]) -> str:
    """The op namespace and extension name of a variant: a hash of its source, this tree's
    exp16.h, the flags, the CPU's features and the torch install (a -march=native build is only
    good on its own CPU, and torch's build files name the install's include paths)."""
    torch_dir = str(Path(torch.__file__).resolve().parent)
    key = "\0".join([source, (CSRC / "exp16.h").read_text(), " ".join(flags), kernels.cpu_flags(), torch.__version__, torch_dir])
    return "nfxab_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def build(label: str, source: str, flags: list[str]):
    """``source`` (small_gemm.cpp's text) built with ``flags`` under op namespace
    :func:`build_name`, its sources in a directory of that name under the temp dir; its
    ``cached_attention`` op. SystemExit naming the variant when it does not build."""
    name = build_name(source, flags)
    d = Path(tempfile.gettempdir()) / "neuronfx-ab" / name
    try:
        d.mkdir(parents=True, exist_ok=True)
        write_if_changed(d / "small_gemm.cpp", source)
        write_if_changed(d / "exp16.h", (CSRC / "exp16.h").read_text())
        with kernels.build_lock(name):
            load(name=name, sources=[str(d / "small_gemm.cpp")], extra_cflags=[*kernels.CFLAGS, f"-Dneuronfx={name}", *flags],
                 extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except (RuntimeError, OSError) as exc:
        raise SystemExit(f"ab_attention.py: {label}: the kernel did not build ({exc}); check the flags, or the revision's source") from None
    return getattr(torch.ops, name).cached_attention


def variants(args: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """(label, source text, extra flags) per variant, the working tree's first."""
    tree = SMALL_GEMM.read_text()
    out = [("this tree", tree, [])]
    for rev in args.against:
        try:
            shown = subprocess.run(["git", "show", f"{rev}:{SOURCE}"], cwd=ROOT, capture_output=True, text=True)
        except OSError as exc:
            raise SystemExit(f"ab_attention.py: --against {rev!r} needs git ({exc})") from None
        if shown.returncode != 0:
            raise SystemExit(f"ab_attention.py: --against {rev!r}: git show found no {SOURCE} there ({shown.stderr.strip()})")
        out.append((f"--against {rev}", shown.stdout, []))
    out += [(f"--flags {f!r}", tree, shlex.split(f)) for f in args.flags]
    labels = [label for label, _, _ in out]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise SystemExit(f"ab_attention.py: {', '.join(repeated)} given twice; give each revision and each flags string once")
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
    p = argparse.ArgumentParser(description="The decode attention kernel of this tree against git revisions and compile flags.")
    p.add_argument("--against", action="extend", nargs="+", default=[], help="git revisions whose small_gemm.cpp to compare (repeatable)")
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
    ops = [(label, build(label, text, flags)) for label, text, flags in specs]
    outputs = []
    for label, op in ops:
        try:
            outputs.append(op(q, *layers[0], table, mask))
        except RuntimeError as exc:
            raise SystemExit(f"ab_attention.py: {label}: the op did not run ({exc}); revisions before a447def take no block table") from None
    for (label, _), out in zip(ops, outputs):
        print(f"{label}: largest |difference| from the first's output {(out - outputs[0]).abs().max().item():.3g}")
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
        print(f"  {label:40s} best {min(ts) * 1e3:7.2f} ms  median {statistics.median(ts) * 1e3:7.2f} ms  "
              f"x{paired:.3f} of the first (paired median)")


if __name__ == "__main__":
    sys.exit(main())
