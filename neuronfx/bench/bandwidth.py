"""Memory figures of a benchmark: resident memory, the weight bytes one decode step reads, and
this machine's read bandwidth, so a decode step's speed can be read as a share of what the
memory can deliver (a batch-1 decode step streams every weight once)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from neuronfx.bench.timing import BenchResult
from neuronfx.graphs.models import quant as Q

READ_PROBE_BYTES = 128 * 2**20
"""Size of the tensor :func:`read_bandwidth` sums: several times any CPU's last-level cache
(32 MiB here), so the sum streams from memory."""


def rss_bytes() -> int:
    """Resident set size of this process, bytes (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def unique_tensors(weights: Any) -> list[torch.Tensor]:
    """Every tensor leaf of the nested weights (dicts, lists, quantized-weight NamedTuples),
    each storage once (a tied LM head is the embedding tensor)."""
    seen, out = set(), []
    for t in tree_leaves(weights):
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out.append(t)
    return out


def decode_weight_bytes(weights: Any, batch_size: int) -> int:
    """Bytes of weights one decode step of ``batch_size`` rows reads: every tensor leaf of the
    nested weights (all layers, the final norm, the LM head; quantized formats by their
    ``.nbytes`` of data, scales and offsets), each storage once, except the embedding, of which
    a step reads only ``batch_size`` rows (all of it when it is also the LM head, tied). A
    packed int8 weight counts its packed data and scales, not the row-major copy prefill reads
    (``quant.read_tensors``)."""
    weights = tree_map(lambda w: Q.read_tensors(w) if isinstance(w, Q.Int8Packed) else w, weights,
                       is_leaf=lambda w: isinstance(w, Q.QUANTIZED_TYPES))
    embed_leaves = [t for t in tree_leaves(weights["embed"]) if isinstance(t, torch.Tensor)]
    rest = unique_tensors({k: v for k, v in weights.items() if k != "embed"})
    shared = {t.data_ptr() for t in rest}
    rows = sum(t.nbytes * min(batch_size, t.shape[0]) // t.shape[0] for t in embed_leaves if t.data_ptr() not in shared)
    return sum(t.nbytes for t in rest) + rows


def read_bandwidth(nbytes: int | None = None, repeats: int = 5) -> dict[str, Any]:
    """This machine's memory read bandwidth as the bench's threads see it: the best of
    ``repeats`` ``torch.sum`` calls over an fp32 tensor of ``nbytes`` (default
    :data:`READ_PROBE_BYTES`), after one warm-up call. A sum reads each byte once and writes
    nothing, as a decode step reads its weights (``torch.mv`` over the same bytes measured the
    same here). ``{"bytes_per_s", "nbytes", "threads", "repeats_s"}``."""
    x = torch.ones((nbytes or READ_PROBE_BYTES) // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return {"bytes_per_s": x.nbytes / min(times), "nbytes": x.nbytes, "threads": torch.get_num_threads(), "repeats_s": times}


def format_read_bandwidth(bw: dict[str, Any]) -> str:
    """One line: the best read bandwidth (GB/s) and the spread of the runs."""
    spread = f"{bw['nbytes'] / min(bw['repeats_s']) / 1e9:.1f}-{bw['nbytes'] / max(bw['repeats_s']) / 1e9:.1f}"
    return (f"memory read bandwidth: {bw['bytes_per_s'] / 1e9:.1f} GB/s (best of {len(bw['repeats_s'])} sums of "
            f"{bw['nbytes'] / 2**20:.0f} MiB fp32 on {bw['threads']} threads; runs {spread} GB/s)")


def bandwidth_rows(results: Sequence[BenchResult], step_bytes: dict[tuple[str, int], int], read_bytes_s: float) -> list[dict[str, Any]]:
    """Per result whose engine and batch size have a byte count in ``step_bytes``: weight bytes
    per decode step, that over TPOT (bytes/s), and its share of ``read_bytes_s``."""
    out = []
    for r in results:
        n = step_bytes.get((r.engine, r.batch_size))
        if n is None or not r.tpot_s > 0:
            continue
        out.append({"engine": r.engine, "dtype": r.dtype, "batch_size": r.batch_size, "prompt_len": r.prompt_len,
                    "gen_len": r.gen_len, "weight_bytes_per_step": n, "tpot_s": r.tpot_s, "bytes_per_s": n / r.tpot_s,
                    "share_of_read_bandwidth": n / r.tpot_s / read_bytes_s})
    return out


def format_bandwidth(row: dict[str, Any]) -> str:
    """One line of :func:`bandwidth_rows`: MiB per step, GB/s and share of the read bandwidth."""
    return (f"weights read per decode step: {row['engine']:12s} {row['dtype']:8s} B={row['batch_size']:<3d} "
            f"{row['weight_bytes_per_step'] / 2**20:7.1f} MiB / TPOT {row['tpot_s'] * 1e3:6.1f} ms = "
            f"{row['bytes_per_s'] / 1e9:5.2f} GB/s, {row['share_of_read_bandwidth'] * 100:3.0f}% of the read bandwidth")


def format_memory(m: dict[str, Any], label: str = "") -> str:
    """One line: RSS after a compile against the bound 1.3 x (weights + KV) + 400 MiB."""
    bound = 1.3 * (m["weights_bytes"] + m["kv_bytes"]) + 400 * 2**20
    return (f"memory {label}B={m['batch_size']}: RSS {m['rss_bytes'] / 2**20:.0f} MiB; weights {m['weights_bytes'] / 2**20:.0f} MiB "
            f"+ KV {m['kv_bytes'] / 2**20:.0f} MiB; bound 1.3x(w+kv)+400 MiB = {bound / 2**20:.0f} MiB")
