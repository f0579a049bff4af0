"""``neuronfx bench latency --plot FILE.png``: decode tok/s against batch size."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from neuronfx.errors import BackendUnavailableError, InputError


def check_plot_path(path: str) -> None:
    """Before the benchmark runs: InputError when ``path``'s directory does not exist or cannot
    be written, or ``path`` is a directory; BackendUnavailableError without matplotlib."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise InputError(f"--plot {path!r} is a directory; give a file name, e.g. --plot {target / 'latency.png'}.")
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise InputError(f"--plot {path!r}: the directory {str(folder)!r} does not exist or cannot be written; create it or "
                         "give a path in a writable one.")
    if importlib.util.find_spec("matplotlib") is None:
        raise BackendUnavailableError("--plot needs matplotlib: pip install 'neuronfx[bench]' (or pip install matplotlib).")


def plot(data: dict[str, Any], path: str) -> None:
    """Decode tok/s vs batch size of a latency run's ``data``, one line per engine / prompt /
    generation length, written to ``path`` (PNG). Raises BackendUnavailableError without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: write the file only
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BackendUnavailableError("--plot needs matplotlib: pip install 'neuronfx[bench]' (or pip install matplotlib).") from exc
    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[tuple, list[tuple[int, float]]] = {}
    for r in data["results"]:
        key = (r["engine"], r["backend"], r["dtype"], r["prompt_len"], r["gen_len"])
        series.setdefault(key, []).append((r["batch_size"], r["decode_tok_s"]))
    for (engine, backend, dtype, p, g), pts in sorted(series.items()):
        pts.sort()
        ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", label=f"{engine} ({backend}, {dtype}) p={p} g={g}")
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s (generated only)")
    ax.set_title("neuronfx decode throughput")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
