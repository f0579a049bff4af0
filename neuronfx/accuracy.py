"""``neuronfx check-accuracy``: neuronfx against transformers on the same weights.

Three checks, all on one compiled runtime (``output_logits=True``) and one transformers causal LM
in float32 (:func:`reference_model`, built from the HF-named state dict the runtime was compiled
from, or from the dequantized weights of a quantized plan):

- **greedy tokens**: ``neuronfx.generate`` against transformers' ``generate(do_sample=False)``
  for each prompt, ``max_new_tokens`` tokens each (eos stops neither engine, so every prompt
  compares the same number of tokens); the first position where they differ, or identical.
- **teacher-forced logits**: neuronfx is fed the reference's tokens (prefill the prompt, then one
  decode step per reference token) so both engines see the same context at every position
  however early they diverge (NxDI's ``logit_validation`` does the same); at every position the
  fp32 logits are compared: max abs error, top-1 agreement, and NxDI's tolerance map
  (:data:`TOLERANCE_BANDS`, semantics in :func:`position_errors`).
- **perplexity** of a text file under both engines, on the same chunks of tokens.

This is a front end (like ``bench``): it drives the runtime's step functions and builds
transformers models; nothing below it imports it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

import neuronfx
from neuronfx.config.sampling import SamplingParams
from neuronfx.errors import CheckpointError, ConfigError, InputError, SequenceLengthExceededError
from neuronfx.io.checkpoints import Checkpoint
from neuronfx.runtime.generate import normalize_prompts
from neuronfx.runtime.runtime import Runtime, check_runtime
from neuronfx.runtime.steps import DecodeBatch, PrefillBatch, check_prompts, decode_step, prefill_step

Tensor = torch.Tensor

DEFAULT_CHATS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
)
"""The user messages checked when no prompt is given (through the tokenizer's chat template)."""


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


# --- the reference --------------------------------------------------------------------------------


def reference_model(source: Checkpoint | Any, state_dict: dict[str, Tensor]) -> Any:
    """transformers' causal LM for ``source`` (a :class:`~neuronfx.io.checkpoints.Checkpoint`, or a
    transformers ``PretrainedConfig``) with the HF-named ``state_dict`` as its weights, in
    float32, eval mode. Built by transformers' own loader (``from_pretrained(None, config=...,
    state_dict=...)``), so both checkpoint layouts of MoE experts and tied embeddings load as
    transformers loads them; float32 tensors are shared, not copied.

    Raises CheckpointError when ``state_dict`` lacks a weight the model needs, has one it does
    not know, or one of the wrong shape (transformers would initialise or skip it at random)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_config = source.hf_config if isinstance(source, Checkpoint) else source
    if hf_config is None:
        raise CheckpointError("the checkpoint carries no transformers config; load it with neuronfx.io.checkpoints.load_checkpoint.")
    not_tensors = [name for name, t in state_dict.items() if not isinstance(t, torch.Tensor)]
    if not_tensors:
        raise CheckpointError(f"state_dict values {not_tensors[:3]} are not tensors (a lazy checkpoint?); "
                              "load the checkpoint with lazy=False.")
    with torch.device("meta"):  # the class transformers picks for this config, at no cost
        model_class = type(AutoModelForCausalLM.from_config(hf_config))
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights" would interleave with our report
    try:
        model, info = model_class.from_pretrained(None, config=hf_config, state_dict=dict(state_dict), dtype=torch.float32,
                                                  output_loading_info=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    bad = {k: sorted(info[k])[:5] for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info[k]}
    if bad:
        raise CheckpointError(f"the reference model cannot take this state_dict: {bad}; pass the HF-named weights of "
                              f"this {hf_config.model_type} checkpoint.")
    return model.eval()


@torch.no_grad()
def reference_greedy(model: Any, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], Tensor]:
    """transformers' greedy ``generate`` for one prompt: (``max_new_tokens`` token ids, their raw
    logits [max_new_tokens, vocab] float32). eos does not stop it (``eos_token_id=[]``: an unset
    one would be taken from the model's generation config). Raises ConfigError when a logits
    processor of the model's generation config (repetition penalty, suppressed tokens, ...) made
    a token other than the raw logits' argmax: neuronfx's greedy tokens are that argmax."""
    from transformers import GenerationConfig

    ids = torch.tensor([list(prompt)])
    config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, eos_token_id=[], pad_token_id=0,
                              repetition_penalty=1.0, output_logits=True, return_dict_in_generate=True)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tokens, logits = out.sequences[0, ids.shape[1]:].tolist(), torch.stack([step[0] for step in out.logits]).float()
    if tokens != logits.argmax(-1).tolist():
        raise ConfigError(f"the reference's generate picked {tokens[:8]} but its raw logits' argmax is "
                          f"{logits.argmax(-1).tolist()[:8]}: its generation config processes logits ({model.generation_config}); "
                          "build the reference with neuronfx.accuracy.reference_model.")
    return tokens, logits


@torch.no_grad()
def reference_nll(model: Any, chunks: Sequence[Sequence[int]]) -> tuple[float, int]:
    """(sum of -log p(token | the tokens before it in its chunk), tokens scored) under ``model``,
    one forward pass per chunk; float64 sum."""
    total, count = 0.0, 0
    for chunk in chunks:
        ids = torch.tensor([list(chunk)])
        logits = model(ids).logits[0, :-1].float()  # (L - 1, vocab): position t predicts token t + 1
        total += nll_sum(logits, ids[0, 1:])
        count += len(chunk) - 1
    return total, count


def nll_sum(logits: Tensor, targets: Tensor) -> float:
    """sum over rows of -log_softmax(logits[r])[targets[r]]; ``logits`` [n, vocab] float32."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return float(-logp.gather(1, targets.long()[:, None]).sum())


# --- neuronfx ----------------------------------------------------------------------------------


def neuronfx_greedy(runtime: Runtime, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """``neuronfx.generate``'s greedy tokens per prompt, eos ignored (speculative decoding when
    the runtime can)."""
    result, _ = neuronfx.generate(runtime, neuronfx.init_state(runtime), [list(p) for p in prompts],
                                  max_new_tokens=max_new_tokens, sampling=SamplingParams(ignore_eos=True))
    return [list(t) for t in result.token_ids]


def teacher_forced_logits(runtime: Runtime, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]) -> list[Tensor]:
    """neuronfx's logits [len(continuations[b]), vocab] float32 per prompt, teacher-forced: row b
    prefills ``prompts[b]`` (logits for the first continuation token), then decodes
    ``continuations[b][:-1]`` one token per step (logits for the next). Prompts run
    ``batch_size`` at a time; needs a runtime with ``output_logits=True``."""
    size = runtime.plan.inference.batch_size
    out: list[Tensor] = []
    for start in range(0, len(prompts), size):
        out += _forced_batch(runtime, prompts[start:start + size], continuations[start:start + size])
    return out


def _forced_batch(runtime: Runtime, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]) -> list[Tensor]:
    greedy = SamplingParams()
    slots = list(range(len(prompts)))
    step, state = prefill_step(runtime, neuronfx.init_state(runtime),
                               PrefillBatch(seq_ids=slots, prompts=[list(p) for p in prompts], sampling=[greedy] * len(slots)))
    logits = [[step.logits[r].clone()] for r in slots]
    for i in range(max(len(c) for c in continuations) - 1):
        rows = [r for r in slots if i + 1 < len(continuations[r])]
        step, state = decode_step(runtime, state, DecodeBatch(seq_ids=rows, input_ids=[continuations[r][i] for r in rows],
                                                              sampling=[greedy] * len(rows)))
        for j, r in enumerate(rows):
            logits[r].append(step.logits[j].clone())
    return [torch.stack(row) for row in logits]


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
    a = torch.where(keep, ours.double(), 0.0)
    count = keep.sum(-1, keepdim=True)  # (n, 1)
    mean_r, mean_a = r.sum(-1, keepdim=True) / count, a.sum(-1, keepdim=True) / count
    dr = torch.where(keep, r - mean_r, 0.0)
    sxx, sxy = (dr * dr).sum(-1, keepdim=True), (dr * (a - mean_a)).sum(-1, keepdim=True)
    flat = sxx == 0  # [ref | 1] has rank 1: lstsq's minimum-norm solution
    shift = torch.where(flat, mean_a / (mean_r**2 + 1), mean_a - torch.where(flat, 0.0, sxy / sxx.clamp_min(1e-300)) * mean_r)
    a = a - shift
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
        max_abs = max(max_abs, _max_abs_error(ref, mine))
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


def _max_abs_error(ref: Tensor, ours: Tensor) -> float:
    """max |ours - ref| over entries finite in both (-inf where a model masks a token)."""
    finite = torch.isfinite(ref) & torch.isfinite(ours)
    return float((ours[finite] - ref[finite]).abs().max()) if finite.any() else 0.0


def first_divergence(ours: Sequence[int], theirs: Sequence[int]) -> int | None:
    """The first index where the token lists differ (a shorter list differs where it ends), or None."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


# --- perplexity ----------------------------------------------------------------------------------


def perplexity(runtime: Runtime, reference: Any, ids: Sequence[int]) -> PerplexityResult:
    """Perplexity of ``ids`` under neuronfx (teacher-forced decode steps) and ``reference``.

    The first ``batch_size * sequence_length`` tokens are cut into chunks of ``sequence_length``
    (the KV cache of one slot; a last chunk of one token is dropped), each scored with its own
    context only, all chunks in one batched pass: neuronfx prefills each chunk's first token and
    decodes the rest, one token per step. perplexity = exp(sum of -log p(token | earlier tokens
    of its chunk) / tokens scored), the same chunks for both engines. Raises InputError for
    fewer than 2 tokens."""
    inf = runtime.plan.inference
    ids = [int(t) for t in ids][: inf.batch_size * inf.sequence_length]
    chunks = [c for c in (ids[i:i + inf.sequence_length] for i in range(0, len(ids), inf.sequence_length)) if len(c) >= 2]
    if not chunks:
        raise InputError(f"the text has {len(ids)} token(s); perplexity needs at least 2.")
    check_prompts(runtime, [c[:1] for c in chunks])  # token ids inside the vocabulary
    ours = teacher_forced_logits(runtime, [c[:1] for c in chunks], [c[1:] for c in chunks])
    ours_nll = sum(nll_sum(logits, torch.tensor(c[1:])) for logits, c in zip(ours, chunks))
    theirs_nll, count = reference_nll(reference, chunks)
    return PerplexityResult(tokens=len(ids), predicted=count, chunks=len(chunks), neuronfx=math.exp(ours_nll / count),
                            transformers=math.exp(theirs_nll / count))


# --- prompts and the whole check ---------------------------------------------------------------------


def chat_prompts(tokenizer: Any, messages: Sequence[str]) -> list[list[int]]:
    """Token ids of each user message through the tokenizer's chat template (with the
    generation prompt). Raises InputError when the tokenizer has no chat template."""
    try:
        return [list(tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]) for m in messages]
    except ValueError as exc:  # transformers: "Cannot use chat template functions ... no chat template"
        raise InputError(f"chat messages need a chat template and this tokenizer has none ({exc}); give raw prompts.") from exc


def default_prompts(tokenizer: Any) -> list[list[int]]:
    """:data:`DEFAULT_CHATS` through the chat template, or as raw text when the tokenizer has none."""
    try:
        return chat_prompts(tokenizer, DEFAULT_CHATS)
    except InputError:
        return [list(tokenizer(m)["input_ids"]) for m in DEFAULT_CHATS]


def check_accuracy(
    runtime: Runtime,
    reference: Any,
    tokenizer: Any = None,
    prompts: Sequence[Sequence[int]] | None = None,
    max_new_tokens: int = 32,
    text_file: str | os.PathLike | None = None,
    bands: Sequence[Band] = TOLERANCE_BANDS,
    reference_name: str = "transformers float32",
) -> AccuracyReport:
    """Compare ``runtime`` with ``reference`` (a transformers causal LM, e.g. from
    :func:`reference_model`) on greedy tokens, teacher-forced logits and (with ``text_file``)
    perplexity; see the module docstring.

    ``prompts``: token ids per prompt (default: :func:`default_prompts` of ``tokenizer``).
    ``tokenizer`` decodes tokens in the report and tokenizes ``text_file`` (UTF-8). ``bands``:
    the tolerance map (default NxDI's). Everything is checked before anything runs: raises
    ConfigError for a runtime without ``output_logits`` or a reference of another vocabulary,
    InputError (no prompts and no
    tokenizer, a text file without a tokenizer or unreadable, ``max_new_tokens`` < 1),
    SequenceLengthExceededError (prompt + ``max_new_tokens`` > ``sequence_length``), the
    prompt errors of ``runtime.steps.check_prompts``."""
    check_runtime(runtime)
    inf = runtime.plan.inference
    if not inf.output_logits:
        raise ConfigError("check_accuracy compares logits and this runtime returns none; compile it with "
                          "InferenceConfig(output_logits=True).")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1.")
    if prompts is None and tokenizer is None:
        raise InputError("no prompts and no tokenizer: pass prompts= (token ids) or tokenizer= for the default chat prompts.")
    prompts = default_prompts(tokenizer) if prompts is None else normalize_prompts(prompts)
    check_prompts(runtime, prompts)
    for b, p in enumerate(prompts):
        if len(p) + max_new_tokens > inf.sequence_length:
            raise SequenceLengthExceededError(f"prompt {b} has {len(p)} tokens + max_new_tokens={max_new_tokens} > "
                                              f"sequence_length={inf.sequence_length}; lower max_new_tokens or compile with a "
                                              "larger sequence_length.")
    text_ids = _text_ids(tokenizer, text_file) if text_file is not None else None
    vocab = reference.config.get_text_config().vocab_size
    if vocab != runtime.plan.model.vocab_size:
        raise ConfigError(f"the reference has vocab_size={vocab} but the runtime's model has {runtime.plan.model.vocab_size}; "
                          "build the reference from the weights the runtime was compiled from (reference_model).")

    theirs = [reference_greedy(reference, p, max_new_tokens) for p in prompts]
    ours_tokens = neuronfx_greedy(runtime, prompts, max_new_tokens)
    ours_logits = teacher_forced_logits(runtime, prompts, [tokens for tokens, _ in theirs])
    refs = [logits for _, logits in theirs]
    results = tuple(
        _prompt_result(tokenizer, p, mine, tokens, ref, forced, max_new_tokens)
        for p, mine, (tokens, ref), forced in zip(prompts, ours_tokens, theirs, ours_logits, strict=True)
    )
    engine = (f"neuronfx {inf.backend} {inf.dtype}" + (f" weights {inf.weight_format}" if inf.weight_format != "float" else "")
              + (" int8 activations" if inf.activation_format == "int8" else "") + (f" tp {inf.tp_degree}" if inf.tp_degree > 1 else ""))
    return AccuracyReport(engine=engine, reference=reference_name, max_new_tokens=max_new_tokens, prompts=results,
                          logits=compare_logits(refs, ours_logits, bands),
                          perplexity=None if text_ids is None else perplexity(runtime, reference, text_ids))


def _text_ids(tokenizer: Any, text_file: str | os.PathLike) -> list[int]:
    if tokenizer is None:
        raise InputError(f"text_file={str(text_file)!r} needs a tokenizer: pass tokenizer=.")
    try:
        text = Path(text_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read text_file={str(text_file)!r}: {exc}; give a UTF-8 text file.") from exc
    ids = list(tokenizer(text)["input_ids"])
    if len(ids) < 2:
        raise InputError(f"text_file={str(text_file)!r} has {len(ids)} token(s); perplexity needs at least 2.")
    return ids


def _prompt_result(tokenizer: Any, prompt: list[int], ours: list[int], theirs: list[int], ref: Tensor, forced: Tensor,
                   num_tokens: int) -> PromptResult:
    def text(t: int | None) -> str | None:
        return None if tokenizer is None or t is None else tokenizer.decode([t])

    index = first_divergence(ours, theirs)
    divergence = None
    if index is not None:
        mine = ours[index] if index < len(ours) else None
        other = theirs[index] if index < len(theirs) else None
        divergence = Divergence(index=index, ours=mine, theirs=other, ours_text=text(mine), theirs_text=text(other))
    return PromptResult(
        prompt_ids=tuple(prompt), prompt_text=None if tokenizer is None else tokenizer.decode(prompt, skip_special_tokens=True),
        num_tokens=num_tokens, divergence=divergence, max_abs_error=_max_abs_error(ref, forced),
        top1_agreement=float((ref.argmax(-1) == forced.argmax(-1)).float().mean()),
    )
