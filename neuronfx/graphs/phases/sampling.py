"""In-graph sampling with vLLM V1 semantics from a per-row (B, P) parameter tensor (columns
named by ``config.sampling.PARAM_COLUMNS``) and explicit uniform random numbers.

No host sync and no data-dependent shapes (``torch.compile(fullgraph=True, dynamic=False)``
friendly): top-k uses a static width (``max_topk`` capped at the vocab, as NxD's on-device
sampler does); penalties, min_p, top-p and the draw are masks and cumulative sums.

References (vLLM): ``vllm/v1/sample/sampler.py`` (order), ``vllm/v1/sample/ops/penalties.py`` and
``vllm/model_executor/layers/utils.py::apply_penalties`` (penalty formulas),
``vllm/v1/sample/ops/topk_topp_sampler.py::apply_top_k_top_p`` (top-k/top-p rule),
``vllm/v1/sample/logits_processor`` ``MinPLogitsProcessor`` (min_p rule).

Order of :func:`sample` (``vllm/v1/sample/sampler.py``): 0 the token bitmask (structured
outputs): disallowed logits become -inf first, as vLLM applies the grammar bitmask to the logits
before its sampler runs (``vllm/v1/worker/gpu_model_runner.py``, ``apply_grammar_bitmask``); 1
raw logprobs snapshot (of the masked logits); 2 + logits_bias; 3 penalties (repetition,
frequency, presence); 4 greedy rows take the argmax of the penalized logits (ties: lowest
index); 5 temperature; 6 top-k of width ``topk_width``, ranks >= top_k masked; 7 min_p; 8 top-p
on the renormalised kept set (keep tokens whose preceding cumulative probability is < top_p, top
token always kept); 9 inverse-CDF draw with ``rand``.

Tensor parallel: the logits are gathered over the vocabulary before sampling
(``graphs/phases/common.py``), so every rank applies the whole (B, W) bitmask to the whole
vocabulary and samples the same token.

Differences from vLLM:

- top-p and min_p act within the ``topk_width`` most likely tokens even when top_k is off (NxD's
  on-device sampler has the same static width); with topk_width = V it is exact.
- vLLM applies min_p before top-k; both keep a set defined relative to the top token, so the
  kept set (their intersection) is the same in either order.
- the draw is inverse-CDF on ``rand`` instead of vLLM's exponential race argmax(p / Exp(1)):
  the same distribution, a different random stream.
- the default SamplingParams is greedy (temperature 0), vLLM's is temperature 1.
"""

from __future__ import annotations

import torch

from neuronfx.config.inputs import SamplerInputs
from neuronfx.config.sampling import GREEDY_TEMPERATURE, PARAM_COLUMNS
from neuronfx.graphs.models.ops import TopK, torch_topk

NEG_INF = float("-inf")
_COLUMN = {name: i for i, name in enumerate(PARAM_COLUMNS)}


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The (B, V) bool "allowed" mask of an int32 token bitmask (B, W), W = ceil(V / 32): bit j
    (least significant first) of word w allows token 32 * w + j, the layout llguidance and
    xgrammar share (``llguidance/torch.py``, ``apply_token_bitmask_inplace_kernel``). Static
    shapes: a shift by arange(32), & 1, reshape to (B, 32 W), slice to V."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # (32,)
    bits = (bitmask[:, :, None] >> shifts) & 1  # (B, W, 32); >> on int32 is arithmetic, & 1 keeps the bit
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size] != 0  # (B, V)


def masked_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits (B, V) float32 with the tokens ``bitmask`` (B, W) int32 disallows set to -inf."""
    return logits.masked_fill(~unpack_bitmask(bitmask, logits.shape[-1]), NEG_INF)


def column(params: torch.Tensor, name: str) -> torch.Tensor:
    """Column ``name`` (one of PARAM_COLUMNS) of the (B, P) parameter tensor, as (B, 1)."""
    i = _COLUMN[name]
    return params[:, i:i + 1]


def apply_penalties(
    logits: torch.Tensor, params: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor
) -> torch.Tensor:
    """vLLM penalties. logits (B, V) float32; params (B, P); output_counts (B, V) int32;
    prompt_mask (B, V) bool. Returns (B, V) float32.

    Repetition r on tokens seen in the prompt or the output: positive logits / r, others * r;
    then ``logit -= frequency * count`` and ``logit -= presence * (count > 0)`` (output only).
    """
    rep, presence, frequency = (column(params, n) for n in ("repetition_penalty", "presence_penalty", "frequency_penalty"))
    seen_out = output_counts > 0  # (B, V)
    r = torch.where(prompt_mask | seen_out, rep, 1.0)  # (B, V)
    logits = torch.where(logits > 0, logits / r, logits * r)
    return logits - frequency * output_counts.to(logits.dtype) - presence * seen_out.to(logits.dtype)


def filtered_probs(vals: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Probabilities of the sorted candidates after top_k, min_p and top_p; zero = dropped.

    vals (B, K) float32 temperature-scaled logits sorted descending; params (B, P).
    Returns (B, K) float32, unnormalised; the top token is always kept.
    """
    top_k, top_p, min_p = (column(params, n) for n in ("top_k", "top_p", "min_p"))  # (B, 1) each
    ranks = torch.arange(vals.shape[-1], device=vals.device)[None, :]  # (1, K)
    probs = torch.softmax(vals.masked_fill(ranks >= top_k, NEG_INF), dim=-1)  # (B, K)
    probs = probs * (probs >= min_p * probs[:, :1])  # min_p: p < min_p * p_max dropped
    probs = probs / probs.sum(-1, keepdim=True)  # top-p acts on the renormalised kept set
    before = probs.cumsum(-1) - probs  # mass ranked strictly above each token
    return probs * (before < top_p)  # the token crossing top_p is kept; so is the top token


def inverse_cdf(probs: torch.Tensor, rand: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of ``probs`` (B, K) float32 (>= 0, some > 0) with ``rand`` (B,)
    float32 in [0, 1). Returns (B,) int64, never a zero-probability index."""
    cdf = probs.cumsum(-1)  # (B, K), unnormalised
    target = rand[:, None] * cdf[:, -1:]  # (B, 1)
    choice = (cdf <= target).sum(-1)  # (B,) first index whose cdf passes the target
    # Float ranks (exact below 2**24): an int64 max reduction broke inductor's Triton codegen
    # (torch 2.11, batch 1: "torch.iinfo() requires an integer input type").
    ranks = torch.arange(probs.shape[-1], device=probs.device, dtype=torch.float32)[None, :]  # (1, K)
    last_kept = torch.where(probs > 0, ranks, 0.0).amax(-1).long()  # (B,) rounding may put target on the total
    return torch.minimum(choice, last_kept)


def raw_logprobs(raw: torch.Tensor, tokens: torch.Tensor, num_logprobs: int, topk: TopK = torch_topk) -> dict[str, torch.Tensor]:
    """raw (B, V) float32 log_softmax of the model logits; tokens (B,) int32."""
    top_logprobs, top_ids = topk(raw, num_logprobs)  # (B, N) sorted descending
    return {
        "sampled_logprobs": raw.gather(1, tokens.long()[:, None]).squeeze(1),  # (B,)
        "top_logprobs": top_logprobs,
        "top_ids": top_ids.to(torch.int32),
    }


def penalized_logits(logits: torch.Tensor, sampler: SamplerInputs) -> torch.Tensor:
    """logits (B, V) float32 masked by ``token_bitmask`` (:func:`masked_logits`), + ``logits_bias``,
    then the penalties (:func:`apply_penalties`): what greedy rows take the argmax of and what
    temperature scales. Returns (B, V) float32."""
    return _bias_and_penalties(masked_logits(logits, sampler.token_bitmask), sampler)


def _bias_and_penalties(masked: torch.Tensor, sampler: SamplerInputs) -> torch.Tensor:
    return apply_penalties(masked + sampler.logits_bias, sampler.sampling_params, sampler.output_counts, sampler.prompt_mask)


def _scaled_topk(penalized: torch.Tensor, params: torch.Tensor, topk_width: int,
                 topk: TopK = torch_topk) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(greedy (B, 1) bool, top ``topk_width`` temperature-scaled values (B, K) sorted
    descending, their token ids (B, K)); greedy rows are left unscaled."""
    temperature = column(params, "temperature")  # (B, 1)
    greedy = temperature <= GREEDY_TEMPERATURE
    vals, idx = topk(penalized / torch.where(greedy, 1.0, temperature), topk_width)
    return greedy, vals, idx


def sample(logits: torch.Tensor, sampler: SamplerInputs, topk_width: int, num_logprobs: int,
           topk: TopK = torch_topk) -> dict[str, torch.Tensor]:
    """Sample one token per row with vLLM V1 semantics.

    Inputs:
      logits (B, V) float32 raw model logits;
      sampler: the rows' :class:`~neuronfx.config.inputs.SamplerInputs`:
        sampling_params (B, P) float32 rows of :func:`neuronfx.config.sampling.pack_sampling`
        (temperature <= 1e-5 is greedy; top_k in [1, topk_width], disabled = the width);
        output_counts (B, V) int32 how often each token was generated so far for the row;
        prompt_mask (B, V) bool token occurs in the row's prompt;
        logits_bias (B, V) float32 added to the logits (the host puts -inf on EOS / stop ids
        until min_tokens);
        rand (B,) float32 uniforms in [0, 1);
        token_bitmask (B, W) int32, W = ceil(V / 32): bit j of word w allows token 32w + j
        (:func:`unpack_bitmask`); -1 (all ones) for a row without a constraint;
      topk_width static int <= V; num_logprobs static int in [0, V]; topk: :data:`TopK` (the
      top-k and the top logprobs; its order among equal values is the only thing it may change).
    Returns {"tokens": (B,) int32}, plus when num_logprobs > 0 "sampled_logprobs" (B,) float32,
    "top_logprobs" (B, num_logprobs) float32 sorted descending and "top_ids" (B, num_logprobs)
    int32, all *raw* logprobs (vLLM V1's default logprobs_mode "raw_logprobs": log_softmax of
    the model logits before bias, penalties and temperature, after the bitmask: a disallowed token
    has logprob -inf). The host guarantees every row's mask allows at least one token
    (``runtime/structured.py``); a row allowing none would sample garbage, never NaN-free.

    The order of the steps and the differences from vLLM are the module's docstring.
    """
    out: dict[str, torch.Tensor] = {}
    masked = masked_logits(logits, sampler.token_bitmask)  # (B, V) first: vLLM masks before its sampler
    raw = torch.log_softmax(masked, dim=-1) if num_logprobs > 0 else None  # (B, V)
    penalized = _bias_and_penalties(masked, sampler)  # (B, V)
    greedy, vals, idx = _scaled_topk(penalized, sampler.sampling_params, topk_width, topk)  # (B, 1), (B, K) x 2
    choice = inverse_cdf(filtered_probs(vals, sampler.sampling_params), sampler.rand)  # (B,)
    drawn = idx.gather(1, choice[:, None]).squeeze(1)  # (B,)
    out["tokens"] = torch.where(greedy[:, 0], penalized.argmax(-1), drawn).to(torch.int32)
    if raw is not None:
        out.update(raw_logprobs(raw, out["tokens"], num_logprobs, topk))
    return out


def distribution(logits: torch.Tensor, sampler: SamplerInputs, topk_width: int) -> torch.Tensor:
    """The distribution :func:`sample` draws from, over the whole vocabulary: logits (N, V)
    float32 and the rows' sampler inputs (``rand`` unused) -> probabilities (N, V) float32
    summing to 1, with the token bitmask, bias, penalties, temperature, top-k, min_p and top-p applied. Greedy rows
    are one-hot at the argmax of the penalized logits. Speculative decoding's rejection sampling
    needs the draft's q and the target's p in this form."""
    penalized = penalized_logits(logits, sampler)
    greedy, vals, idx = _scaled_topk(penalized, sampler.sampling_params, topk_width)
    probs = filtered_probs(vals, sampler.sampling_params)
    probs = probs / probs.sum(-1, keepdim=True)
    full = torch.zeros_like(logits).scatter(1, idx, probs)
    onehot = torch.zeros_like(logits).scatter(1, penalized.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy, onehot, full)
