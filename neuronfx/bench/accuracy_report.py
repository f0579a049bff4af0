"""The report of ``neuronfx check-accuracy`` and the pure comparisons behind it: NxDI's
tolerance map over teacher-forced logits (:func:`position_errors`, :func:`compare_logits`) and
where greedy tokens first differ (:func:`first_divergence`). :mod:`neuronfx.bench.accuracy`
runs the engines and fills these records."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from neuronfx.errors import ConfigError, InputError

Tensor = torch.Tensor


@attrs.frozen
class Band:
    """One entry of a tolerance map: the ``top_k`` tokens by the reference's logits (None: every
    token) must satisfy ``max|ours - ref| - atol <= rtol * max|ref|`` over the band."""

    top_k: int | None
    atol: float
    rtol: float

    @property
    def name(self) -> str:
        return "all" if self.top_k is None else f"top {self.top_k}"


TOLERANCE_BANDS = (Band(5, 1e-5, 0.01), Band(50, 1e-5, 0.02), Band(1000, 1e-5, 0.03), Band(None, 1e-5, 0.05))
"""NxDI's default tolerance map (torch_neuronx ``DEFAULT_TOLERANCE_MAP``: ``{"5": (1e-5, 0.01),
"50": (1e-5, 0.02), "1000": (1e-5, 0.03), "all": (1e-5, 0.05)}`` as (atol, rtol))."""

DIVERGENCE_TOLERANCE = 0.001
"""NxDI's ``DEFAULT_DIVERGENCE_DIFFERENCE_TOLERANCE``: where neuronfx's top-1 token is not the
reference's, ``max(ours) - ours[reference top-1]`` must stay below it (a near tie)."""

FAIL_ON = ("never", "greedy", "tolerance")
"""What makes ``check-accuracy`` exit 1 (:meth:`AccuracyReport.failed`)."""


# --- the report ---------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Divergence:
    """Where greedy decoding first differs: generated token ``index`` (0 = the first)."""

    index: int
    ours: int | None  # neuronfx's token (None: neuronfx produced fewer tokens)
    theirs: int | None  # transformers' token (None: transformers produced fewer tokens)
    ours_text: str | None  # decoded, when a tokenizer was given
    theirs_text: str | None


@attrs.frozen(kw_only=True)
class PromptResult:
    """One prompt: its greedy comparison and its teacher-forced logits."""

    prompt_ids: tuple[int, ...]
    prompt_text: str | None
    num_tokens: int  # tokens each engine generated (max_new_tokens)
    divergence: Divergence | None  # None: identical greedy tokens
    max_abs_error: float  # max |ours - ref| over its positions and the vocabulary
    top1_agreement: float  # fraction of its positions where both engines' top-1 token agree


@attrs.frozen(kw_only=True)
class BandResult:
    """A tolerance band over every teacher-forced position: the worst relative error
    (``(max|ours - ref| - atol) / max|ref|`` over the band, after the shift is removed) and where."""

    band: Band
    worst_rel_error: float
    worst_prompt: int
    worst_token: int
    passed: bool  # worst_rel_error <= band.rtol


@attrs.frozen(kw_only=True)
class LogitsResult:
    """Teacher-forced logits over every prompt and position."""

    positions: int
    max_abs_error: float
    top1_agreement: float  # fraction of positions
    bands: tuple[BandResult, ...]
    worst_divergence: float  # max(ours) - ours[ref top-1] over positions where top-1 differs (0: none)
    divergence_passed: bool  # worst_divergence < DIVERGENCE_TOLERANCE

    @property
    def passed(self) -> bool:
        """NxDI's verdict: every band and every top-1 disagreement within tolerance."""
        return self.divergence_passed and all(b.passed for b in self.bands)


@attrs.frozen(kw_only=True)
class PerplexityResult:
    """exp(mean negative log-likelihood) of the same tokens under each engine."""

    tokens: int  # tokens read from the text
    predicted: int  # tokens scored (each chunk's first token has no context and is not scored)
    chunks: int  # chunks of at most sequence_length tokens, each scored on its own
    neuronfx: float
    transformers: float


@attrs.frozen(kw_only=True)
class AccuracyReport:
    """What :func:`check_accuracy` found; :meth:`format` prints it."""

    engine: str  # e.g. "neuronfx eager float32"
    reference: str  # e.g. "transformers float32"
    max_new_tokens: int
    prompts: tuple[PromptResult, ...]
    logits: LogitsResult
    perplexity: PerplexityResult | None

    @property
    def greedy_identical(self) -> bool:
        return all(p.divergence is None for p in self.prompts)

    def failed(self, fail_on: str) -> bool:
        """Whether the check fails under ``fail_on``: ``"never"``; ``"greedy"``: some prompt's
        greedy tokens diverge; ``"tolerance"``: that, or a tolerance band or top-1 disagreement
        fails (quantized and 16-bit plans are expected to fail the tight bands)."""
        if fail_on not in FAIL_ON:
            raise InputError(f"fail_on={fail_on!r} must be one of {FAIL_ON}.")
        if fail_on == "never":
            return False
        return not self.greedy_identical or (fail_on == "tolerance" and not self.logits.passed)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self) | {"greedy_identical": self.greedy_identical, "tolerance_passed": self.logits.passed}

    def format(self) -> str:
        """The report as text, one line per prompt and per band."""
        lines = [f"{self.engine} vs {self.reference}",
                 f"greedy tokens ({self.max_new_tokens} per prompt, eos does not stop):"]
        for i, p in enumerate(self.prompts):
            lines.append(f"  prompt {i} {_clip(p.prompt_text, p.prompt_ids)}: {_divergence_text(p.divergence)}")
        lg = self.logits
        lines.append(f"teacher-forced logits ({lg.positions} positions): max abs error {lg.max_abs_error:.3g}, "
                     f"top-1 agreement {lg.top1_agreement:.1%}")
        for i, p in enumerate(self.prompts):
            lines.append(f"  prompt {i}: max abs error {p.max_abs_error:.3g}, top-1 agreement {p.top1_agreement:.1%}")
        lines.append("  NxDI tolerance map (per position: max|ours - ref| - atol <= rtol * max|ref| over the band):")
        for b in lg.bands:
            lines.append(f"    {b.band.name:<9} atol {b.band.atol:g} rtol {b.band.rtol:<5g} worst {b.worst_rel_error:10.3g} "
                         f"(prompt {b.worst_prompt} token {b.worst_token})  {'pass' if b.passed else 'FAIL'}")
        lines.append(f"    top-1 ties  max(ours) - ours[ref top-1] < {DIVERGENCE_TOLERANCE:g}: worst {lg.worst_divergence:.3g}  "
                     f"{'pass' if lg.divergence_passed else 'FAIL'}")
        if self.perplexity is not None:
            pp = self.perplexity
            lines.append(f"perplexity ({pp.predicted} tokens scored in {pp.chunks} chunk{'s' if pp.chunks > 1 else ''}): neuronfx {pp.neuronfx:.4f}, "
                         f"transformers {pp.transformers:.4f}")
        lines.append(f"greedy: {'identical' if self.greedy_identical else 'DIVERGED'}; "
                     f"tolerance map: {'pass' if lg.passed else 'FAIL'}")
        return "\n".join(lines)


def _clip(text: str | None, ids: Sequence[int], width: int = 50) -> str:
    """The prompt's last ``width`` characters: a chat prompt's user message is at its end."""
    shown = repr(text) if text is not None else str(list(ids))
    return shown if len(shown) <= width else "..." + shown[3 - width:]


def _divergence_text(d: Divergence | None) -> str:
    if d is None:
        return "identical"

    def token(t: int | None, text: str | None) -> str:
        return "(none)" if t is None else f"{t}" if text is None else f"{text!r} ({t})"

    return f"diverges at token {d.index}: neuronfx {token(d.ours, d.ours_text)} vs transformers {token(d.theirs, d.theirs_text)}"


# --- comparing logits ------------------------------------------------------------------------------


def position_errors(ref: Tensor, ours: Tensor, bands: Sequence[Band] = TOLERANCE_BANDS) -> tuple[Tensor, Tensor]:
    """NxDI's per-position logit check: (relative error [n, len(bands)], divergence difference [n]),
    float64.

    ``ref``, ``ours``: [n, vocab] logits of n positions (float32), one row per position. As
    torch_neuronx's ``testing.validation.logit_validation`` (called by NxDI's
    ``utils/accuracy.py`` ``check_accuracy_logits``; its source is not public, its semantics are
    reproduced in vllm-neuron's ``vllm_neuron/accuracy/logit_validation.py``:
    ``_preprocess_logits``, ``_validate_top_k_logits``, ``_cpu_allclose`` "CPU fallback
    implementation for neuron_allclose", ``_validate_single_token_logits``), per row:

    1. entries that are -inf in either are dropped;
    2. a constant shift is removed from ``ours``: the least-squares fit ``ours ~ s * ref + c``
       (numpy ``lstsq``; here in closed form, and its minimum-norm solution when every
       reference logit is equal), then ``ours -= c`` (softmax does not see a shift; the slope
       stays);
    3. per band, the ``top_k`` largest reference logits (all for None); error =
       ``max(|ours - ref| - atol) / max|ref|`` over the band (inf when every reference logit
       there is 0); the band passes at that position when ``error <= rtol``;
    4. divergence difference: 0 when both top-1 tokens agree, else
       ``max(ours) - ours[argmax ref]``; it passes below :data:`DIVERGENCE_TOLERANCE`.
    """
    keep = ~(torch.isneginf(ref) | torch.isneginf(ours))  # (n, V)
    r = torch.where(keep, ref.double(), 0.0)
    a = without_shift(r, torch.where(keep, ours.double(), 0.0), keep)
    diff = torch.where(keep, (a - r).abs(), -math.inf)  # dropped entries never count
    mag = torch.where(keep, r.abs(), 0.0)
    ranked = torch.where(keep, r, -math.inf)
    errors = []
    for band in bands:
        idx = torch.topk(ranked, min(band.top_k or ref.shape[-1], ref.shape[-1]), dim=-1).indices  # (n, k)
        scale = mag.gather(-1, idx).amax(-1)
        worst = diff.gather(-1, idx).amax(-1) - band.atol
        errors.append(torch.where(scale > 0, worst / scale, math.inf))
    top = ranked.argmax(-1, keepdim=True)  # (n, 1)
    shifted = torch.where(keep, a, -math.inf)
    divergence = torch.where(shifted.argmax(-1, keepdim=True) == top, 0.0, shifted.amax(-1, keepdim=True) - shifted.gather(-1, top))
    return torch.stack(errors, dim=-1), divergence[:, 0]


def without_shift(r: Tensor, a: Tensor, keep: Tensor) -> Tensor:
    """``a`` minus the constant c of the least-squares fit ``a ~ s * r + c`` over the entries in
    ``keep`` (per row; r, a float64 [n, V] with dropped entries 0): numpy ``lstsq``'s solution
    in closed form, its minimum-norm one when every kept ``r`` is equal."""
    count = keep.sum(-1, keepdim=True)  # (n, 1)
    mean_r, mean_a = r.sum(-1, keepdim=True) / count, a.sum(-1, keepdim=True) / count
    dr = torch.where(keep, r - mean_r, 0.0)
    sxx, sxy = (dr * dr).sum(-1, keepdim=True), (dr * (a - mean_a)).sum(-1, keepdim=True)
    flat = sxx == 0  # [ref | 1] has rank 1: lstsq's minimum-norm solution
    shift = torch.where(flat, mean_a / (mean_r**2 + 1), mean_a - torch.where(flat, 0.0, sxy / sxx.clamp_min(1e-300)) * mean_r)
    return a - shift


def compare_logits(refs: Sequence[Tensor], ours: Sequence[Tensor], bands: Sequence[Band] = TOLERANCE_BANDS) -> LogitsResult:
    """Every position of every prompt: ``refs[b]``, ``ours[b]`` [n_b, vocab] float32 (same shapes).
    Max abs error and top-1 agreement on the raw logits; the bands and divergence difference as
    :func:`position_errors`, worst over all positions."""
    worst = [(-math.inf, 0, 0)] * len(bands)
    worst_divergence, agree, positions, max_abs = 0.0, 0, 0, 0.0
    for b, (ref, mine) in enumerate(zip(refs, ours, strict=True)):
        if ref.shape != mine.shape:
            raise ConfigError(f"prompt {b}: reference logits {tuple(ref.shape)} but neuronfx logits {tuple(mine.shape)}; "
                              "the reference must be the same model (vocabulary) as the runtime.")
        max_abs = max(max_abs, max_abs_error(ref, mine))
        agree += int((ref.argmax(-1) == mine.argmax(-1)).sum())
        positions += ref.shape[0]
        errors, divergence = position_errors(ref, mine, bands)
        for i, (value, t) in enumerate(zip(*errors.max(dim=0))):
            worst[i] = max(worst[i], (float(value), b, int(t)), key=lambda x: x[0])
        worst_divergence = max(worst_divergence, float(divergence.max()))
    results = tuple(BandResult(band=band, worst_rel_error=e, worst_prompt=b, worst_token=t, passed=e <= band.rtol)
                    for band, (e, b, t) in zip(bands, worst))
    return LogitsResult(positions=positions, max_abs_error=max_abs, top1_agreement=agree / max(positions, 1), bands=results,
                        worst_divergence=worst_divergence, divergence_passed=worst_divergence < DIVERGENCE_TOLERANCE)


def max_abs_error(ref: Tensor, ours: Tensor) -> float:
    """max |ours - ref| over entries finite in both (-inf where a model masks a token)."""
    finite = torch.isfinite(ref) & torch.isfinite(ours)
    return float((ours[finite] - ref[finite]).abs().max()) if finite.any() else 0.0


def first_divergence(ours: Sequence[int], theirs: Sequence[int]) -> int | None:
    """The first index where the token lists differ (a shorter list differs where it ends), or None."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))
