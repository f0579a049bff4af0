"""Alternating rounds and their report, shared by every benchmark that compares two runners.

This machine's speed drifts by 10-30% between runs a minute apart (one case moved by 2x), and
the second of two back-to-back runs measured up to 5% slower. So two runners are compared in
rounds: each round runs both, the order alternating, and only same-round ratios are compared;
a runner's figure is its median round."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from neuronfx.bench.timing import BenchResult, percentile, time_neuronfx
from neuronfx.memory import frozen_heap
from neuronfx.runtime.runtime import Runtime


def alternate(runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[Any]]:
    """Call every run ``rounds`` times, round i in the order of ``runs`` (reversed on odd i, so
    no runner always goes first); returns each run's results in round order. The rounds run with
    the heap frozen (``memory.frozen_heap``), as ``neuronfx chat`` and ``serve`` decode: a full
    garbage collection (about 0.2 s after a compile) could otherwise land in one round."""
    out: dict[str, list[Any]] = {name: [] for name in runs}
    with frozen_heap():
        for i in range(rounds):
            for name in list(runs) if i % 2 == 0 else list(runs)[::-1]:
                out[name].append(runs[name]())
    return out


def paired_ratio(per_round: Sequence[float]) -> float:
    """The summary of A/B rounds whose order alternates (:func:`alternate`): the median, over
    the pairs of rounds (0, 1), (2, 3), ..., of each pair's geometric mean ratio. A constant
    penalty for going first in a round cancels within a pair (this tree against itself at batch
    8, 7 rounds: 0.94-1.01x in rounds it went first, 1.02-1.06x in the others, 2026-12-04). One
    round: its ratio; of an odd count the last round is left out. ValueError for no rounds."""
    if not per_round:
        raise ValueError("paired_ratio: no rounds; run at least one.")
    if len(per_round) == 1:
        return per_round[0]
    return median([(per_round[i] * per_round[i + 1]) ** 0.5 for i in range(0, len(per_round) - 1, 2)])


def median(values: Sequence[float]) -> float:
    """The median (the mean of the middle two of an even count); nan for no values."""
    return percentile(values, 50)


def ab_rounds(runtimes: dict[str, Runtime], prompts: list[list[int]], gen_len: int, rounds: int) -> dict[str, list[float]]:
    """Each runtime's ITL p50 (seconds) per round of greedy decoding of ``prompts``, the
    runtimes alternating (:func:`alternate`)."""
    timed = alternate({name: functools.partial(time_neuronfx, rt, prompts, gen_len) for name, rt in runtimes.items()}, rounds)
    return {name: [percentile(itl, 50) for _, itl in runs] for name, runs in timed.items()}


def format_ab(label: str, itl: dict[str, list[float]], slow: str, fast: str) -> list[str]:
    """Lines: each runner's ITL p50 per round and median (ms), then ``slow`` / ``fast`` per
    round and the median of those ratios (only same-round ratios compare on a drifting machine)."""
    lines = [f"{label} {name:8s} ITL p50 per round (ms): " + " ".join(f"{v * 1e3:.2f}" for v in values)
             + f"; median {median(values) * 1e3:.2f}" for name, values in itl.items()]
    ratios = [a / b for a, b in zip(itl[slow], itl[fast], strict=True)]
    lines.append(f"{label} {slow} / {fast} per round: " + " ".join(f"{r:.3f}" for r in ratios) + f"; median {median(ratios):.3f}x")
    return lines


def median_round(rounds: Sequence[BenchResult]) -> BenchResult:
    """The round with the median decode tok/s (the upper one of an even count)."""
    return sorted(rounds, key=lambda r: r.decode_tok_s)[len(rounds) // 2]


def round_ratios(ours: Sequence[BenchResult], theirs: Sequence[BenchResult]) -> dict[str, Any]:
    """One case's per-round decode tok/s ratios (neuronfx / the other engine, same round) and
    their median (the upper middle value of an even count)."""
    values = [a.decode_tok_s / b.decode_tok_s for a, b in zip(ours, theirs, strict=True)]
    r = ours[0]
    return {"reference": theirs[0].engine, "batch_size": r.batch_size, "prompt_len": r.prompt_len, "gen_len": r.gen_len,
            "decode_tok_s_ratios": values, "median": sorted(values)[len(values) // 2]}


def format_rounds(row: dict[str, Any]) -> str:
    """One line: a case's per-round decode tok/s ratios and their median."""
    return (f"B={row['batch_size']} prompt={row['prompt_len']} gen={row['gen_len']}: decode tok/s neuronfx / "
            f"{row['reference']} per round " + " ".join(f"{v:.2f}" for v in row["decode_tok_s_ratios"])
            + f"; median {row['median']:.2f}x")


def ratios(results: Sequence[BenchResult], reference: str) -> list[dict[str, Any]]:
    """neuronfx / ``reference`` engine per case: decode and output tok/s ratios (higher is
    better) and the TTFT ratio (neuronfx / reference, lower is better)."""
    ref = {(r.batch_size, r.prompt_len, r.gen_len): r for r in results if r.engine == reference}
    out = []
    for r in results:
        t = ref.get((r.batch_size, r.prompt_len, r.gen_len))
        if r.engine != "neuronfx" or t is None:
            continue
        out.append({
            "reference": reference, "batch_size": r.batch_size, "prompt_len": r.prompt_len, "gen_len": r.gen_len,
            "decode_tok_s_ratio": r.decode_tok_s / t.decode_tok_s,
            "output_tok_s_ratio": r.output_tok_s / t.output_tok_s,
            "ttft_ratio": r.ttft_s / t.ttft_s,
        })
    return out


COMPARED = (  # (label, BenchResult field, scale, higher is better)
    ("decode tok/s", "decode_tok_s", 1.0, True),
    ("TTFT ms", "ttft_s", 1e3, False),
    ("TPOT ms", "tpot_s", 1e3, False),
    ("ITL p50 ms", "itl_p50_s", 1e3, False),  # the median step: what a shared machine's bursts disturb least
    ("output tok/s", "output_tok_s", 1.0, True),
)


def comparison_table(results: Sequence[BenchResult], reference: str) -> list[str]:
    """neuronfx's and ``reference``'s figures side by side per case, with neuronfx / reference
    (a ratio above 1 is better for tok/s, below 1 for times). Empty when no case has both."""
    ref = {(r.batch_size, r.prompt_len, r.gen_len): r for r in results if r.engine == reference}
    pairs = [(r, ref[k]) for r in results if r.engine == "neuronfx" and (k := (r.batch_size, r.prompt_len, r.gen_len)) in ref]
    if not pairs:
        return []
    ours, theirs = pairs[0]
    lines = [f"neuronfx ({ours.backend}, {ours.dtype}) vs {reference} ({theirs.backend}, {theirs.dtype})",
             f"{'case':24s} {'metric':13s} {'neuronfx':>10s} {reference:>12s} {'ratio':>7s}"]
    for ours, theirs in pairs:
        case = f"B={ours.batch_size} prompt={ours.prompt_len} gen={ours.gen_len}"
        for label, field, scale, higher in COMPARED:
            a, b = getattr(ours, field), getattr(theirs, field)
            better = "higher is better" if higher else "lower is better"
            lines.append(f"{case:24s} {label:13s} {a * scale:10.1f} {b * scale:12.1f} {a / b:6.2f}x  ({better})")
    return lines
