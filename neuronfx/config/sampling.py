"""Per-request sampling parameters and their packing into the graphs' [B, 3] float32 tensor."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from neuronfx.errors import SamplingParamsError

GREEDY_TEMPERATURE = 1e-5
"""Temperatures at or below this mean greedy, as in vLLM ``SamplingParams`` (``_SAMPLING_EPS``)."""


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Sampling of one request, applied in the graph in the order top_k, temperature, top_p.

    - ``temperature``: >= 0; values <= 1e-5 mean greedy (argmax), as in vLLM.
    - ``top_k``: keep the k most likely tokens; 0 or -1 means off (then the graph's ``max_topk``
      width applies, as in NxD's on-device sampler).
    - ``top_p``: in (0, 1]; keep the smallest set of most likely tokens whose probability reaches
      ``top_p``, including the token that crosses it (transformers/vLLM rule).
    Greedy is the default. Raises SamplingParamsError (via :func:`check_sampling`) on bad values.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE or self.top_k == 1


def check_sampling(params: SamplingParams, max_topk: int) -> None:
    """Raise SamplingParamsError naming the field, value and limit if ``params`` is invalid."""
    t, k, p = params.temperature, params.top_k, params.top_p
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise SamplingParamsError(f"temperature={t!r} must be a finite number >= 0 (0 means greedy).")
    if isinstance(k, bool) or not isinstance(k, int) or k < -1:
        raise SamplingParamsError(f"top_k={k!r} must be an int >= 1, or 0/-1 to disable it.")
    if k > max_topk:
        raise SamplingParamsError(
            f"top_k={k} > max_topk={max_topk} compiled into the graphs; lower top_k or recompile "
            "with a larger max_topk."
        )
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 1:
        raise SamplingParamsError(f"top_p={p!r} must be in (0, 1].")


def pack_sampling(params: Sequence[SamplingParams], max_topk: int) -> list[list[float]]:
    """Rows of (top_k, top_p, temperature) as the graphs read them ([B, 3] float32).

    Greedy rows become (1, 1.0, 1.0); a disabled top_k becomes ``max_topk``.
    """
    rows = []
    for sp in params:
        check_sampling(sp, max_topk)
        if sp.greedy:
            rows.append([1.0, 1.0, 1.0])
        else:
            k = max_topk if sp.top_k in (0, -1) else sp.top_k
            rows.append([float(k), float(sp.top_p), float(sp.temperature)])
    return rows
