"""Which way a 16-bit plan multiplies prefill-sized products on this CPU, decided by measurement.

A bf16 (or fp16) linear of many rows can run as a 16-bit GEMM (``F.linear`` on the 16-bit
tensors: oneDNN) or widened (both operands cast to fp32, an fp32 GEMM, the result cast back).
Which is faster depends on the CPU and on the oneDNN build, and a capability flag guesses it
wrong: torch's ``_is_mkldnn_bf16_supported`` is true on any AVX-512 CPU (avx512bw/vl/dq),
where oneDNN *emulates* bf16 without AVX512-BF16 and the 16-bit GEMM runs 3-7x slower than the
widened one (measured here with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE``; the same with ``AVX2``),
while with AVX512-BF16 (or AMX) the 16-bit GEMM is 2.5-3x faster than widening. So
:func:`prefill_choice` times both at a prefill-like size (:data:`PROBE_SHAPE`), once per
(dtype, CPU flags, torch version, ``ONEDNN_MAX_CPU_ISA``), and keeps the verdict in a small JSON
file next to the kernel builds (torch's extension build root, ``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``), so later processes read it instead of measuring again
(about 0.1-1 s on one thread). Delete the file to measure again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F

from neuronfx.graphs.kernels.library import cpu_flags

PROBE_SHAPE = (256, 1024, 1024)
"""(rows M, in K, out N) of the timed product: a prefill of 256 tokens through a 1024-wide
projection, large enough that oneDNN runs its blocked GEMM (about 0.5 GFLOP)."""
REPEATS = 5
"""Timed calls of each way, interleaved, after one warm-up call each; the best counts."""
MARGIN = 1.1
"""Widen only when it is this much faster: a near tie keeps the 16-bit GEMM (it reads half the
bytes and makes no fp32 copy of the weight)."""


@attrs.frozen(kw_only=True)
class PrefillChoice:
    """The verdict for one 16-bit dtype: ``widen`` (multiply in fp32) or not, with the best
    times (seconds) of each way at ``shape`` on ``threads`` threads and the file it is kept in."""

    dtype: str
    widen: bool
    native_s: float
    widened_s: float
    shape: tuple[int, int, int]
    threads: int
    path: str | None  # None when the verdict could not be written (read-only cache directory)
    measured: bool  # measured by this process (False: read from ``path``)

    def describe(self) -> str:
        """One line for logs and bench output."""
        way = "widened to fp32 GEMM" if self.widen else f"{self.dtype} GEMM"
        m, k, n = self.shape
        origin = "measured now" if self.measured else "cached"
        return (f"16-bit prefill products: {way} (measured {self.dtype} {self.native_s * 1e3:.1f} ms vs fp32-widened "
                f"{self.widened_s * 1e3:.1f} ms at {m}x{k}x{n}, {self.threads} threads; {origin}: {self.path})")


def decide(native_s: float, widened_s: float, margin: float = MARGIN) -> bool:
    """True (widen) when the widened product is more than ``margin`` times faster."""
    return widened_s * margin < native_s


def verdict_root() -> Path:
    """The directory of the kept verdicts: torch's extension build root, ``$TORCH_EXTENSIONS_DIR``
    where set (torch's ``get_default_build_root`` ignores it: with a read-only home the verdicts
    were then never kept and measured again in every process), else ``~/.cache/torch_extensions``."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def cache_file(dtype: str, root: Path | None = None) -> Path:
    """Where the verdict of ``dtype`` for this CPU, torch and oneDNN ISA cap is kept (``root``:
    default :func:`verdict_root`)."""
    root = verdict_root() if root is None else root
    key = "\n".join([dtype, cpu_flags(), torch.__version__, os.environ.get("ONEDNN_MAX_CPU_ISA", "")])
    return root / f"neuronfx_prefill16_{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"


def measure(dtype: str, shape: tuple[int, int, int] = PROBE_SHAPE, repeats: int = REPEATS) -> tuple[float, float]:
    """Best seconds of (16-bit ``F.linear``, widened ``F.linear``) on x (M, K) and w (N, K) of
    ``dtype``; the widened way includes both casts, as :func:`neuronfx.graphs.ops.cpu_linear` does."""
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(getattr(torch, dtype))
    w = torch.randn(n, k, generator=g).to(getattr(torch, dtype))

    def native() -> None:
        F.linear(x, w)

    def widened() -> None:
        F.linear(x.float(), w.float()).to(x.dtype)

    best = {native: float("inf"), widened: float("inf")}
    with torch.no_grad():
        for i in range(repeats + 1):
            for way in (native, widened):  # interleaved: a burst of load from elsewhere hits both
                t0 = time.perf_counter()
                way()
                if i:  # the first call of each is a warm-up (oneDNN primitive creation)
                    best[way] = min(best[way], time.perf_counter() - t0)
    return best[native], best[widened]


def _read(path: Path, dtype: str) -> PrefillChoice | None:
    try:
        data = json.loads(path.read_text())
        return PrefillChoice(dtype=dtype, widen=bool(data["widen"]), native_s=float(data["native_s"]),
                             widened_s=float(data["widened_s"]), shape=tuple(data["shape"]), threads=int(data["threads"]),
                             path=str(path), measured=False)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or unreadable: measure again


def write_verdict(path: Path, data: dict) -> bool:
    """Write ``data`` as JSON to ``path`` atomically (temp file + rename: parallel test workers
    may race); False if it cannot (a read-only cache directory: measure again next time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.stem}-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
        return True
    except OSError:
        return False


def _write(path: Path, choice: PrefillChoice) -> bool:
    return write_verdict(path, {"widen": choice.widen, "native_s": choice.native_s, "widened_s": choice.widened_s,
                                "shape": list(choice.shape), "threads": choice.threads, "dtype": choice.dtype})


def prefill_choice(dtype: str, root: Path | None = None) -> PrefillChoice:
    """The kept verdict for 16-bit ``dtype`` ("bfloat16" or "float16") on this machine, or a new
    measurement (then kept). ``root``: the directory of the verdict files (default: torch's
    extension build root)."""
    path = cache_file(dtype, root)
    kept = _read(path, dtype)
    if kept is not None:
        return kept
    native_s, widened_s = measure(dtype)
    choice = PrefillChoice(dtype=dtype, widen=decide(native_s, widened_s), native_s=native_s, widened_s=widened_s,
                           shape=PROBE_SHAPE, threads=torch.get_num_threads(), path=str(path), measured=True)
    return choice if _write(path, choice) else attrs.evolve(choice, path=None)


@functools.cache
def widen_16bit_prefill(dtype: str) -> bool:
    """Whether 16-bit ``dtype`` products of many rows run faster widened to fp32 on this CPU
    (read once per process; see :func:`prefill_choice`)."""
    return prefill_choice(dtype).widen
