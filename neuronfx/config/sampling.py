"""Per-request sampling parameters (vLLM ``SamplingParams`` semantics), their validation and
their packing into the graphs' (B, P) float32 parameter tensor (one column per PARAM_COLUMNS).

The numeric knobs (temperature, top_k, top_p, min_p and the three penalties) run inside the
graph (:func:`neuronfx.graphs.phases.sampling.sample`); the rest (seed, min/max tokens, stop strings
and ids, ignore_eos, logprobs) is host-side bookkeeping that the runtime turns into the graph's
random numbers, logit bias and stopping decisions.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence

import attrs

from neuronfx.config.structured import StructuredOutputs
from neuronfx.errors import SamplingParamsError

GREEDY_TEMPERATURE = 1e-5
"""Temperatures at or below this mean greedy, as in vLLM ``SamplingParams`` (``_SAMPLING_EPS``)."""

PARAM_COLUMNS = (
    "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
)
"""Column order of a :func:`pack_sampling` row and of the graphs' (B, P) ``sampling_params``
tensor; graph code reads a column by its name (``neuronfx.graphs.phases.sampling.column``)."""

NUM_PARAM_COLUMNS = len(PARAM_COLUMNS)  # 7

MAX_SEED = 2**63 - 1
"""Largest accepted ``seed`` (int64 max, what ``torch.Generator.manual_seed`` takes unwrapped)."""

PENALTY_RANGE = 2.0
"""presence/frequency penalties must lie in [-2, 2], as vLLM and the OpenAI API require."""

LOGIT_BIAS_RANGE = 100.0
"""logit_bias values must lie in [-100, 100], the OpenAI API's rule."""


def _to_str_tuple(value: object) -> object:
    """A single str becomes a 1-tuple and a list a tuple; anything else is left for the check."""
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, list) else value


def _to_tuple(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


def _to_bias_pairs(value: object) -> object:
    """A mapping {token id: bias} becomes a tuple of (id, bias) pairs sorted by id (hashable,
    frozen); a list becomes a tuple; anything else (or unsortable ids) is left for the check."""
    if isinstance(value, Mapping):
        pairs = tuple(value.items())
        return tuple(sorted(pairs)) if all(_is_int(i) for i, _ in pairs) else pairs
    return tuple(tuple(p) if isinstance(p, list) else p for p in value) if isinstance(value, list) else value


def _check_logit_bias(_inst: object, _attribute: attrs.Attribute, value: object) -> None:
    """attrs validator of ``logit_bias``: (id, bias) pairs, ids ints >= 0 without repeats, biases
    finite in [-100, 100]; SamplingParamsError naming the offending id or value otherwise."""
    if not isinstance(value, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in value):
        raise _fail("logit_bias", value, "must be a mapping {token id: bias} (or (id, bias) pairs).")
    try:
        shown: object = dict(value)
    except TypeError:  # an unhashable id: show the pairs
        shown = value
    for token, bias in value:
        if not _is_int(token) or token < 0:
            raise _fail("logit_bias", shown, f"has token id {token!r}: ids must be ints >= 0 (token ids of the vocabulary).")
        if not _is_real(bias) or abs(bias) > LOGIT_BIAS_RANGE:
            raise _fail("logit_bias", shown, f"has bias {bias!r} for token {token}: biases must be finite numbers in "
                        f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}] (OpenAI's range); -100 bans the token, +100 forces it.")
    if len({token for token, _ in value}) != len(value):
        raise _fail("logit_bias", value, "repeats a token id; give each id once.")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _fail(field: str, value: object, rule: str) -> SamplingParamsError:
    return SamplingParamsError(f"SamplingParams.{field}={value!r} {rule}")


def _rule(ok: Callable[[object], bool], rule: str) -> Callable[[object, attrs.Attribute, object], None]:
    """attrs validator: raise SamplingParamsError naming the field and value unless ``ok(value)``."""

    def check(_inst: object, attribute: attrs.Attribute, value: object) -> None:
        if not ok(value):
            raise _fail(attribute.name, value, rule)

    return check


_PENALTY_RULE = f"must be a finite number in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}] (vLLM's range); 0 disables it."


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
    - ``logit_bias``: {token id: bias} (OpenAI's ``logit_bias``): each bias, a finite number in
      [-100, 100], is added to that token's logit before the penalties at every step (-100 in
      practice bans the token, +100 forces it); stored as (id, bias) pairs sorted by id. Ids
      must be < the model's vocab_size (:func:`check_sampling`).
    - ``logprobs``: None, or N >= 0: return the sampled token's logprob and the top-N raw
      logprobs (at most the compiled ``max_logprobs``).
    - ``prompt_logprobs``: None, or N >= 0 (vLLM's ``prompt_logprobs``): also return, for every
      prompt token after the first, its raw logprob given the tokens before it and the top-N
      alternatives (at most ``max_logprobs``); needs a plan compiled with
      ``InferenceConfig.enable_prompt_logprobs``.
    - ``structured``: None, or a :class:`~neuronfx.config.structured.StructuredOutputs`: the
      generated text must match a JSON schema, regex, choice or grammar (vLLM's
      ``structured_outputs``). It lives here, with the other per-request rules of what may be
      sampled, so it reaches every path SamplingParams reaches (generate, the scheduler, the
      step API, the server) without a parallel argument.

    Construction validates every field on its own (types, ranges, ``min_tokens <= max_tokens``)
    and raises SamplingParamsError naming the field, the value and the rule; what depends on a
    compiled plan (``top_k <= max_topk``, ``logprobs <= max_logprobs``, stop ids in the
    vocabulary) is :func:`check_sampling`.
    """

    temperature: float = attrs.field(default=0.0, validator=_rule(
        lambda v: _is_real(v) and v >= 0, "must be a finite number >= 0 (<= 1e-5 means greedy)."))
    top_k: int = attrs.field(default=0, validator=_rule(lambda v: _is_int(v) and v >= -1, "must be an int >= 1, or 0/-1 to disable it."))
    top_p: float = attrs.field(default=1.0, validator=_rule(lambda v: _is_real(v) and 0 < v <= 1, "must be in (0, 1]; 1 disables it."))
    min_p: float = attrs.field(default=0.0, validator=_rule(lambda v: _is_real(v) and 0 <= v <= 1, "must be in [0, 1]; 0 disables it."))
    repetition_penalty: float = attrs.field(default=1.0, validator=_rule(
        lambda v: _is_real(v) and v > 0, "must be a finite number > 0; 1 disables it."))
    presence_penalty: float = attrs.field(default=0.0, validator=_rule(
        lambda v: _is_real(v) and abs(v) <= PENALTY_RANGE, _PENALTY_RULE))
    frequency_penalty: float = attrs.field(default=0.0, validator=_rule(
        lambda v: _is_real(v) and abs(v) <= PENALTY_RANGE, _PENALTY_RULE))
    seed: int | None = attrs.field(default=None, validator=_rule(
        lambda v: v is None or (_is_int(v) and 0 <= v <= MAX_SEED), f"must be None or an int in [0, {MAX_SEED}]."))
    min_tokens: int = attrs.field(default=0, validator=_rule(lambda v: _is_int(v) and v >= 0, "must be an int >= 0."))
    max_tokens: int | None = attrs.field(default=None, validator=_rule(
        lambda v: v is None or (_is_int(v) and v >= 1), "must be None (until sequence_length) or an int >= 1."))
    stop: tuple[str, ...] = attrs.field(default=(), converter=_to_str_tuple, validator=_rule(
        lambda v: isinstance(v, tuple) and all(isinstance(s, str) and s for s in v),
        "must be a str or a tuple/list of non-empty str."))
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_to_tuple, validator=_rule(
        lambda v: isinstance(v, tuple) and all(_is_int(i) and i >= 0 for i in v), "must be a tuple/list of ints >= 0."))
    ignore_eos: bool = attrs.field(default=False, validator=_rule(lambda v: isinstance(v, bool), "must be a bool."))
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_to_bias_pairs, validator=_check_logit_bias)
    logprobs: int | None = attrs.field(default=None, validator=_rule(
        lambda v: v is None or (_is_int(v) and v >= 0), "must be None or an int >= 0."))
    prompt_logprobs: int | None = attrs.field(default=None, validator=_rule(
        lambda v: v is None or (_is_int(v) and v >= 0), "must be None or an int >= 0."))
    include_stop_str_in_output: bool = attrs.field(default=False, validator=_rule(lambda v: isinstance(v, bool), "must be a bool."))
    structured: StructuredOutputs | None = attrs.field(default=None, validator=_rule(
        lambda v: v is None or isinstance(v, StructuredOutputs), "must be None or a neuronfx.StructuredOutputs."))

    def __attrs_post_init__(self) -> None:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _fail("min_tokens", self.min_tokens,
                        f"must be <= max_tokens={self.max_tokens}; lower min_tokens or raise max_tokens.")

    @property
    def greedy(self) -> bool:
        """Whether the request takes the argmax: temperature <= 1e-5 or top_k == 1."""
        return self.temperature <= GREEDY_TEMPERATURE or self.top_k == 1


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> re.Match[str] | None:
    """The first lone UTF-16 surrogate in ``text`` (its match: ``group()``, ``start()``), or None.
    No tokenizer and no UTF-8 encoder takes one; it comes from JSON's ``"\\ud800"`` (the server)
    or from a byte that is not UTF-8 decoded with ``surrogateescape`` (the command line: 0xE9 ->
    U+DCE9)."""
    return _LONE_SURROGATE.search(text)


def check_sampling(params: SamplingParams, max_topk: int, max_logprobs: int, vocab_size: int | None = None,
                   prompt_logprobs: bool = False) -> None:
    """Raise SamplingParamsError naming the field, value, limit and fix where ``params`` asks
    for more than a compiled plan holds (construction checked everything else).

    ``max_topk`` / ``max_logprobs`` are the static widths compiled into the graphs;
    ``vocab_size`` (when given) bounds ``stop_token_ids`` and ``logit_bias`` ids; ``prompt_logprobs``: whether the plan
    was compiled with ``enable_prompt_logprobs``. Also raises when ``params`` is not a
    SamplingParams at all.
    """
    if not isinstance(params, SamplingParams):
        raise SamplingParamsError(f"sampling params {params!r:.80} must be a neuronfx.SamplingParams.")
    if params.top_k > max_topk:
        raise _fail("top_k", params.top_k, f"is > max_topk={max_topk} compiled into the graphs; lower top_k or "
                    "recompile with a larger max_topk.")
    if params.logprobs is not None and max_logprobs == 0:
        raise _fail("logprobs", params.logprobs, "asks for logprobs but max_logprobs=0 compiled none into the graphs; "
                    "drop logprobs (None) or recompile with max_logprobs >= 1.")
    if params.logprobs is not None and params.logprobs > max_logprobs:
        raise _fail("logprobs", params.logprobs, f"is > max_logprobs={max_logprobs} compiled into the graphs; ask for "
                    "fewer or recompile with a larger max_logprobs.")
    _check_prompt_logprobs(params.prompt_logprobs, max_logprobs, prompt_logprobs)
    if vocab_size is not None and any(i >= vocab_size for i in params.stop_token_ids):
        raise _fail("stop_token_ids", params.stop_token_ids, f"must be a tuple/list of ints >= 0 and < vocab_size={vocab_size}.")
    if vocab_size is not None and any(i >= vocab_size for i, _ in params.logit_bias):
        token = next(i for i, _ in params.logit_bias if i >= vocab_size)
        raise _fail("logit_bias", dict(params.logit_bias), f"has token id {token}, outside the vocabulary: ids must be "
                    f"ints in [0, vocab_size={vocab_size}); drop it or use an id of this model's tokenizer.")


def _check_prompt_logprobs(k: int | None, max_logprobs: int, enabled: bool) -> None:
    if k is not None and not enabled:
        raise _fail("prompt_logprobs", k, "needs graphs that return prompt logprobs; recompile with "
                    "InferenceConfig(enable_prompt_logprobs=True) or drop prompt_logprobs (None).")
    if k is not None and k > max_logprobs:
        raise _fail("prompt_logprobs", k, f"is > max_logprobs={max_logprobs} compiled into the graphs; ask for "
                    "fewer or recompile with a larger max_logprobs.")


def pack_sampling(params: Sequence[SamplingParams], max_topk: int) -> list[list[float]]:
    """One row of NUM_PARAM_COLUMNS floats per request, in PARAM_COLUMNS order, as the graphs
    read them: greedy rows (temperature <= 1e-5 or top_k == 1) get temperature 0.0; a disabled
    top_k (0 or -1) becomes ``max_topk``. Packs only: callers check each request against the
    plan first (:func:`check_sampling`; construction checked the rest).
    """
    rows = []
    for sp in params:
        packed = {name: float(getattr(sp, name)) for name in PARAM_COLUMNS}
        packed["top_k"] = float(max_topk if sp.top_k in (0, -1) else sp.top_k)
        packed["temperature"] = 0.0 if sp.greedy else packed["temperature"]
        rows.append([packed[name] for name in PARAM_COLUMNS])
    return rows
