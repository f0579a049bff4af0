"""Per-request sampling parameters (vLLM ``SamplingParams`` semantics), their validation and
their packing into the graphs' (B, 7) float32 parameter tensor.

The numeric knobs (temperature, top_k, top_p, min_p and the three penalties) run inside the
graph (:func:`neuronfx.graphs.sampling.sample`); the rest (seed, min/max tokens, stop strings
and ids, ignore_eos, logprobs) is host-side bookkeeping that the runtime turns into the graph's
random numbers, logit bias and stopping decisions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from neuronfx.errors import SamplingParamsError

GREEDY_TEMPERATURE = 1e-5
"""Temperatures at or below this mean greedy, as in vLLM ``SamplingParams`` (``_SAMPLING_EPS``)."""

PARAM_COLUMNS = (
    "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
)
"""Column order of a :func:`pack_sampling` row and of the graphs' (B, 7) ``params`` tensor."""

NUM_PARAM_COLUMNS = len(PARAM_COLUMNS)  # 7

MAX_SEED = 2**63 - 1
"""Largest accepted ``seed`` (int64 max, what ``torch.Generator.manual_seed`` takes unwrapped)."""

PENALTY_RANGE = 2.0
"""presence/frequency penalties must lie in [-2, 2], as vLLM and the OpenAI API require."""


def _to_str_tuple(value: object) -> object:
    """A single str becomes a 1-tuple and a list a tuple; anything else is left for the check."""
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, list) else value


def _to_tuple(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Sampling and stopping of one request, with vLLM's meaning for every field.

    In the graph, per row (vLLM V1 sampler order): logit bias, penalties, greedy argmax,
    temperature, top_k, min_p, top_p, draw.

    - ``temperature``: >= 0; values <= 1e-5 mean greedy (argmax). **Default 0.0 (greedy)**,
      unlike vLLM's 1.0, so that a bare ``SamplingParams()`` is deterministic.
    - ``top_k``: keep the k most likely tokens; 0 or -1 means off (then the graph's static
      ``max_topk`` width applies, as in NxD's on-device sampler). top_k = 1 is greedy.
    - ``top_p``: in (0, 1]; keep the most likely tokens whose preceding cumulative probability
      is below ``top_p`` (the token crossing it is kept; transformers/vLLM rule).
    - ``min_p``: in [0, 1]; drop tokens with probability < ``min_p`` x the top probability.
    - ``repetition_penalty``: > 0; 1 is off. Applies to tokens seen in the prompt or output:
      positive logits are divided by it, the others multiplied.
    - ``presence_penalty`` / ``frequency_penalty``: in [-2, 2]; subtract ``presence`` once and
      ``frequency`` x count from the logits of tokens generated so far (output tokens only).
    - ``seed``: None (draws come from the state's RNG key) or an int in [0, 2**63 - 1] giving the
      request its own reproducible stream.
    - ``min_tokens``: >= 0; EOS and ``stop_token_ids`` are suppressed until this many tokens.
    - ``max_tokens``: None (until the slot's ``sequence_length`` capacity) or >= 1.
    - ``stop``: stop strings (a single str becomes a 1-tuple); excluded from the output unless
      ``include_stop_str_in_output``.
    - ``stop_token_ids``: extra token ids that end the request (kept in the output, as vLLM).
    - ``ignore_eos``: keep generating after EOS.
    - ``logprobs``: None, or N >= 0: return the sampled token's logprob and the top-N raw
      logprobs (at most the compiled ``max_logprobs``).

    Validation is :func:`check_sampling` (SamplingParamsError); construction does not validate.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    max_tokens: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=_to_str_tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_to_tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE or self.top_k == 1


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _fail(field: str, value: object, rule: str) -> SamplingParamsError:
    return SamplingParamsError(f"SamplingParams.{field}={value!r} {rule}")


def _check_numeric(sp: SamplingParams, max_topk: int) -> None:
    """The object's type and the fields the graph reads (the PARAM_COLUMNS)."""
    if not isinstance(sp, SamplingParams):
        raise SamplingParamsError(f"sampling params {sp!r:.80} must be a neuronfx.SamplingParams.")
    t, k = sp.temperature, sp.top_k
    if not _is_real(t) or t < 0:
        raise _fail("temperature", t, "must be a finite number >= 0 (<= 1e-5 means greedy).")
    if not _is_int(k) or k < -1:
        raise _fail("top_k", k, "must be an int >= 1, or 0/-1 to disable it.")
    if k > max_topk:
        raise _fail("top_k", k, f"is > max_topk={max_topk} compiled into the graphs; lower top_k or "
                    "recompile with a larger max_topk.")
    if not _is_real(sp.top_p) or not 0 < sp.top_p <= 1:
        raise _fail("top_p", sp.top_p, "must be in (0, 1]; 1 disables it.")
    if not _is_real(sp.min_p) or not 0 <= sp.min_p <= 1:
        raise _fail("min_p", sp.min_p, "must be in [0, 1]; 0 disables it.")
    if not _is_real(sp.repetition_penalty) or sp.repetition_penalty <= 0:
        raise _fail("repetition_penalty", sp.repetition_penalty, "must be a finite number > 0; 1 disables it.")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(sp, name)
        if not _is_real(v) or not -PENALTY_RANGE <= v <= PENALTY_RANGE:
            raise _fail(name, v, f"must be a finite number in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}] "
                        "(vLLM's range); 0 disables it.")


def _check_lengths(sp: SamplingParams) -> None:
    if sp.seed is not None and (not _is_int(sp.seed) or not 0 <= sp.seed <= MAX_SEED):
        raise _fail("seed", sp.seed, f"must be None or an int in [0, {MAX_SEED}].")
    if not _is_int(sp.min_tokens) or sp.min_tokens < 0:
        raise _fail("min_tokens", sp.min_tokens, "must be an int >= 0.")
    if sp.max_tokens is not None and (not _is_int(sp.max_tokens) or sp.max_tokens < 1):
        raise _fail("max_tokens", sp.max_tokens, "must be None (until sequence_length) or an int >= 1.")
    if sp.max_tokens is not None and sp.min_tokens > sp.max_tokens:
        raise _fail("min_tokens", sp.min_tokens,
                    f"must be <= max_tokens={sp.max_tokens}; lower min_tokens or raise max_tokens.")


def _check_stopping(sp: SamplingParams, vocab_size: int | None) -> None:
    if not isinstance(sp.stop, tuple) or not all(isinstance(s, str) and s for s in sp.stop):
        raise _fail("stop", sp.stop, "must be a str or a tuple/list of non-empty str.")
    ids = sp.stop_token_ids
    limit = "" if vocab_size is None else f" and < vocab_size={vocab_size}"
    if not isinstance(ids, tuple) or not all(_is_int(i) and i >= 0 and (vocab_size is None or i < vocab_size) for i in ids):
        raise _fail("stop_token_ids", ids, f"must be a tuple/list of ints >= 0{limit}.")
    for name in ("ignore_eos", "include_stop_str_in_output"):
        if not isinstance(getattr(sp, name), bool):
            raise _fail(name, getattr(sp, name), "must be a bool.")


def check_sampling(params: SamplingParams, max_topk: int, max_logprobs: int, vocab_size: int | None = None) -> None:
    """Raise SamplingParamsError naming the field, value, limit and fix if ``params`` is invalid.

    ``max_topk`` / ``max_logprobs`` are the static widths compiled into the graphs;
    ``vocab_size`` (when given) bounds ``stop_token_ids``. Bools are never accepted as numbers.
    """
    _check_numeric(params, max_topk)
    _check_lengths(params)
    _check_stopping(params, vocab_size)
    n = params.logprobs
    if n is not None and (not _is_int(n) or n < 0):
        raise _fail("logprobs", n, "must be None or an int >= 0.")
    if n is not None and n > max_logprobs:
        raise _fail("logprobs", n, f"is > max_logprobs={max_logprobs} compiled into the graphs; ask for "
                    "fewer or recompile with a larger max_logprobs.")


def pack_sampling(params: Sequence[SamplingParams], max_topk: int) -> list[list[float]]:
    """One row of 7 floats per request, in PARAM_COLUMNS order, as the graphs read them.

    (temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty):
    greedy rows (temperature <= 1e-5 or top_k == 1) get temperature 0.0; a disabled top_k (0 or
    -1) becomes ``max_topk``. Callers validate with :func:`check_sampling` first; the graph-read
    fields are re-checked here (cheap) so nothing out of range reaches a graph.
    """
    rows = []
    for sp in params:
        _check_numeric(sp, max_topk)
        k = max_topk if sp.top_k in (0, -1) else sp.top_k
        t = 0.0 if sp.greedy else sp.temperature
        rows.append([float(t), float(k), float(sp.top_p), float(sp.min_p), float(sp.repetition_penalty),
                     float(sp.presence_penalty), float(sp.frequency_penalty)])
    return rows
