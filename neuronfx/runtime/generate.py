"""generate: prompts in, generated tokens and a new state out, through the reference scheduler;
stream_generate: the same, as events."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from neuronfx.config.sampling import SamplingParams, check_sampling
from neuronfx.errors import BatchTooLargeError, InputError, SamplingParamsError, TokenOutOfVocabError
from neuronfx.runtime.checks import check_prompts
from neuronfx.runtime.fork import check_n, choices
from neuronfx.runtime.overlap import overlap_schedule
from neuronfx.runtime.pipeline import Logprobs
from neuronfx.runtime.requests import Finished, Request, TokenEvent, check_budget, priorities
from neuronfx.runtime.runtime import Runtime, check_state
from neuronfx.runtime.scheduler import schedule
from neuronfx.runtime.speculate import SpeculationStats
from neuronfx.runtime.state import State
from neuronfx.runtime.structured import Grammars, grammars_for

Prompts = Sequence[int] | Sequence[Sequence[int]] | torch.Tensor | np.ndarray


@attrs.frozen(kw_only=True, eq=False)
class GenerateResult:
    """Output of :func:`generate`, one entry per prompt in input order (with ``n`` > 1, one per
    choice: prompt p's choice c is entry p * n + c)."""

    token_ids: tuple[tuple[int, ...], ...]  # [n][generated_b] generated ids (a stopping eos/stop id included)
    finish_reasons: tuple[str, ...]  # [n] "stop" (eos, stop id or stop string), "length" (max tokens reached) or "error" (NaN/inf logits)
    stop_reasons: tuple[int | str | None, ...]  # [n] stop token id or stop string; None for eos or length
    texts: tuple[str, ...] | None  # [n] detokenized outputs (stop strings cut), when a tokenizer was given
    logprobs: tuple[tuple[Logprobs, ...] | None, ...]  # [n][generated_b] for requests that asked
    prefill_s: float  # seconds in prefill steps
    decode_s: float  # seconds in decode and speculate steps (drafting and verification included)
    speculation: tuple[SpeculationStats | None, ...] | None = None  # [n] when the runtime speculated (None for a request that errored)
    # [n][len(prompt_b)] for requests with SamplingParams.prompt_logprobs: per prompt token, None for the first
    prompt_logprobs: tuple[tuple[Logprobs | None, ...] | None, ...] | None = None

    @property
    def num_generated(self) -> int:
        """Generated tokens over all rows."""
        return sum(len(t) for t in self.token_ids)


def normalize_prompts(ids: Prompts) -> list[list[int]]:
    """Accept one prompt (list of ints or 1-D tensor) or many (list of lists or 2-D tensor without
    padding); returns a list of int lists. Raises InputError for text, other shapes, dtypes or a
    tensor without data (meta device)."""
    if isinstance(ids, (str, bytes, bytearray)):
        raise InputError(f"ids={ids!r:.40} is text; pass token ids: tokenize it first, e.g. tokenizer(text)['input_ids'].")
    if isinstance(ids, np.ndarray):
        if not np.issubdtype(ids.dtype, np.integer):
            raise InputError(f"token ids array has dtype {ids.dtype}; give an integer array (int32/int64).")
        ids = torch.from_numpy(ids)
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise InputError(f"token ids tensor has dtype {ids.dtype}; give an integer tensor (int32/int64).")
        if ids.dim() not in (1, 2):
            raise InputError(f"token ids tensor has shape {tuple(ids.shape)}; give [T] or [B, T].")
        ids = _host_list(ids)
    if not isinstance(ids, (list, tuple)):
        raise InputError(f"ids={ids!r:.40} is a {type(ids).__name__}; pass a list of token ids, a list of such lists, "
                         "or an integer tensor/array of shape [T] or [B, T].")
    rows = [_as_row(r) if isinstance(r, (np.ndarray, torch.Tensor)) else r for r in ids]
    if rows and all(_is_id(r) for r in rows):
        return [[int(t) for t in rows]]
    for b, r in enumerate(rows):
        if not isinstance(r, (list, tuple)) or not all(_is_id(t) for t in r):
            raise InputError(
                f"prompt {b} is {r!r:.60}; ids must be a list of int token ids, a list of such lists, "
                "or an integer tensor/array of shape [T] or [B, T]."
            )
    return [[int(t) for t in r] for r in rows]


def _is_id(t: object) -> bool:
    # numpy integer scalars count as ids; bools do not.
    return isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))


def _as_row(r: np.ndarray | torch.Tensor) -> list | int:
    """A 0-d tensor or array is one id (like a numpy integer), a 1-d one a prompt."""
    if r.ndim == 0:
        if r.dtype.is_floating_point if isinstance(r, torch.Tensor) else not np.issubdtype(r.dtype, np.integer):
            raise InputError(f"token id {r!r:.40} is not an integer; token ids are ints.")
        return int(r)
    values = _host_list(r) if isinstance(r, torch.Tensor) else r.tolist()
    return values if r.ndim == 1 else [values]


def _host_list(t: torch.Tensor) -> list:
    """``t.tolist()`` for a tensor on any device that holds data (cpu, cuda, ...)."""
    if t.device.type == "meta":
        raise InputError(f"token ids tensor is on device {t.device.type!r}, which holds no values; pass a cpu (or cuda) tensor.")
    return t.tolist()


def eos_set(eos_token_ids: int | Sequence[int], vocab_size: int | None = None) -> set[int]:
    """One id or a sequence of ids (as transformers' ``eos_token_id`` accepts); raises InputError
    otherwise, TokenOutOfVocabError for an id outside [0, vocab_size) (when given)."""
    ids = [eos_token_ids] if _is_id(eos_token_ids) else eos_token_ids
    if not isinstance(ids, (list, tuple, set, frozenset)) or not all(_is_id(t) for t in ids):
        raise InputError(f"eos_token_ids={eos_token_ids!r} must be a token id or a sequence of token ids.")
    for t in ids:
        if vocab_size is not None and not 0 <= t < vocab_size:
            raise TokenOutOfVocabError(
                f"eos_token_ids contains {int(t)}, outside the vocabulary [0, {vocab_size}); use the tokenizer's eos id."
            )
    return {int(t) for t in ids}


def check_stop_strings(sp: SamplingParams, tokenizer: Any) -> None:
    """Raise SamplingParamsError for a stop string the tokenizer cannot produce: it encodes to
    nothing, or its ids decode to text that does not contain it (e.g. unknown characters), so the
    output text could never contain it and the stop would be silently ignored."""
    for stop in sp.stop:
        ids = tokenizer.encode(stop, add_special_tokens=False)
        back = tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
        if not ids or stop.strip() not in back:
            raise SamplingParamsError(
                f"SamplingParams.stop={stop!r} cannot be produced by this tokenizer (encodes to {list(ids)[:8]}, "
                f"which decodes to {back!r:.60}): the output text could never contain it; fix the stop string, pass the model's "
                "tokenizer, or for a special token (dropped from the text) use stop_token_ids."
            )


def check_tokenizer(tokenizer: Any) -> None:
    """Raise InputError unless ``tokenizer`` is None or decodes ids the way neuronfx asks
    (``tokenizer.decode(ids, skip_special_tokens=True)``, as a transformers tokenizer does)."""
    if tokenizer is None:
        return
    try:
        text = tokenizer.decode([], skip_special_tokens=True)
    except (AttributeError, TypeError) as exc:
        raise InputError(f"tokenizer={tokenizer!r:.60} cannot decode token ids ({exc}); pass a transformers tokenizer, "
                         "e.g. neuronfx.io.checkpoints.load_tokenizer(path).") from exc
    if not isinstance(text, str):
        raise InputError(f"tokenizer.decode returned a {type(text).__name__}, not text; pass a transformers tokenizer.")


def make_requests(
    runtime: Runtime, state: State, ids: Prompts, *, max_new_tokens: int = 32,
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    eos_token_ids: int | Sequence[int] | None = None, tokenizer: Any = None, speculative: bool = True,
    async_decode: bool = False, n: int = 1, priority: int | Sequence[int] = 0,
) -> tuple[list[Request], frozenset[int], Grammars | None]:
    """Validate everything :func:`generate` needs and build its requests, eos set and the
    compiled grammars of its structured requests (None when there are none). With ``n`` > 1
    each prompt is ``n`` requests in a row (``fork.choices``).

    Raises (nothing has changed yet): InputError (bad ids, max_new_tokens < 1, sampling not one
    SamplingParams or one per prompt, stop strings or structured outputs without a tokenizer, a
    tokenizer that cannot decode, ``speculative`` or ``async_decode`` not a bool),
    ``n`` not an int in [1, 128], ``priority`` not one int or one per prompt), BatchTooLargeError (no free slot), SequenceLengthExceededError (prompt + max tokens >
    sequence_length), SamplingParamsError (including stop strings the tokenizer cannot produce,
    min_tokens over the token budget, a structured output the grammar library rejects or that
    allows no first token), TokenOutOfVocabError (eos ids), and the prompt errors of
    :func:`check_prompts`.
    """
    check_state(runtime, state)
    prompts = normalize_prompts(ids)
    if not prompts:
        raise InputError("no prompts given; pass at least one list of token ids.")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1.")
    check_prompts(runtime, prompts)
    check_run_options(state, speculative, async_decode)
    check_n(n)
    check_tokenizer(tokenizer)
    ranks = priorities(priority, len(prompts))
    params = request_params(runtime, sampling, len(prompts), tokenizer)
    grammars = grammars_for(runtime, params, tokenizer)
    eos = runtime.plan.model.eos_token_ids if eos_token_ids is None else eos_set(eos_token_ids, runtime.plan.model.vocab_size)
    if eos_token_ids is not None:
        # The caller's eos ids replace the model's (the steps hold back the model's while
        # min_tokens lasts): as stop ids they are held back instead. ignore_eos ignores them too.
        params = tuple(sp if sp.ignore_eos else attrs.evolve(sp, ignore_eos=True, stop_token_ids=sp.stop_token_ids + tuple(sorted(eos)))
                       for sp in params)
    requests = [attrs.evolve(budgeted(runtime, b, p, sp, max_new_tokens), priority=ranks[b]) for b, (p, sp) in enumerate(zip(prompts, params))]
    return choices(requests, n), frozenset(eos), grammars


def check_run_options(state: State, speculative: object, async_decode: object) -> None:
    """Raise BatchTooLargeError when ``state`` has no free slot, InputError when ``speculative``
    or ``async_decode`` is not a bool."""
    if not state.free_slots:
        raise BatchTooLargeError(
            f"all {state.num_slots} slots are live; release some or use a state with free slots (neuronfx.init_state)."
        )
    for name, flag in (("speculative", speculative), ("async_decode", async_decode)):
        if not isinstance(flag, bool):
            raise InputError(f"{name}={flag!r} must be True or False.")


def request_params(runtime: Runtime, sampling: SamplingParams | Sequence[SamplingParams], n: int, tokenizer: Any,
                   ) -> tuple[SamplingParams, ...]:
    """The ``n`` requests' SamplingParams (one for all, or one each), checked against the plan
    and, for stop strings, the tokenizer. Raises InputError or SamplingParamsError."""
    params = (sampling,) * n if isinstance(sampling, SamplingParams) else tuple(sampling)
    if len(params) != n or not all(isinstance(sp, SamplingParams) for sp in params):
        raise InputError(f"sampling={sampling!r:.80} must be one SamplingParams, or one per prompt ({n}).")
    plan = runtime.plan
    for sp in params:
        check_sampling(sp, plan.topk_width, plan.logprobs_width, plan.model.vocab_size, plan.inference.enable_prompt_logprobs)
        if sp.stop and tokenizer is None:
            raise InputError(f"stop={sp.stop!r} needs text: pass tokenizer= (e.g. neuronfx.io.checkpoints.load_tokenizer).")
        if sp.stop:
            check_stop_strings(sp, tokenizer)
    return params


def budgeted(runtime: Runtime, b: int, prompt: Sequence[int], sp: SamplingParams, max_new_tokens: int) -> Request:
    """Request ``b`` with its token budget (``sp.max_tokens``, else ``max_new_tokens``) checked
    against the slot (SequenceLengthExceededError) and ``min_tokens`` (SamplingParamsError)."""
    budget = max_new_tokens if sp.max_tokens is None else sp.max_tokens
    check_budget(runtime, b, len(prompt), budget)
    if sp.min_tokens > budget:
        raise SamplingParamsError(f"SamplingParams.min_tokens={sp.min_tokens} of prompt {b} is > its token budget {budget} "
                                  "(max_tokens or max_new_tokens); lower min_tokens or raise the budget.")
    return Request(prompt=tuple(prompt), sampling=attrs.evolve(sp, max_tokens=budget))


def generate(
    runtime: Runtime,
    state: State,
    ids: Prompts,
    *,
    max_new_tokens: int = 32,
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    eos_token_ids: int | Sequence[int] | None = None,
    tokenizer: Any = None,
    speculative: bool = True,
    async_decode: bool = False,
    n: int = 1,
    priority: int | Sequence[int] = 0,
) -> tuple[GenerateResult, State]:
    """Generate for any number of prompts through the reference scheduler (continuous batching
    over the state's free slots; prompts beyond them wait for a slot). Returns
    (GenerateResult, new state); ``state`` is consumed.

    Each request stops at its ``sampling.max_tokens`` (default ``max_new_tokens``), an eos id
    (``eos_token_ids`` or the model's; included in token_ids, as in transformers), a stop token
    id or stop string (``tokenizer`` needed for text and stop strings). Greedy unless ``sampling``
    says otherwise (one SamplingParams for all prompts or one per prompt). Unseeded sampling
    draws from the state's RNG key; a request with ``seed`` draws from its own. A runtime that
    can speculate (``Runtime.can_speculate``) decodes with ``speculate_step`` unless
    ``speculative=False``; every option works either way and the result then carries
    per-request ``speculation`` statistics. ``async_decode=True`` overlaps each iteration with
    the delivery of the previous one's tokens (``runtime/overlap.py``; the same tokens).
    ``SamplingParams.structured`` constrains a request's output to a JSON schema, regex, choice
    or grammar (``tokenizer`` needed; docs/usage/structured-outputs.md); it finishes ("stop") as
    soon as its grammar is complete. ``n`` > 1 samples n choices per prompt (OpenAI's ``n``):
    the result then holds each prompt's n choices in a row (entry p * n + c); the prompt is
    prefilled once and the other choices copy its KV (``runtime/fork.py``); seeded choice c draws
    with seed + c, as vLLM. ``priority`` (one int, or one per prompt; vLLM's): waiting prompts
    are admitted lowest first, ties in order. Raises before any state change (:func:`make_requests`).
    """
    events = stream_generate(runtime, state, ids, max_new_tokens=max_new_tokens, sampling=sampling,
                             eos_token_ids=eos_token_ids, tokenizer=tokenizer, speculative=speculative, async_decode=async_decode,
                             n=n, priority=priority)
    return collect(events, tokenizer is not None)


def stream_generate(
    runtime: Runtime,
    state: State,
    ids: Prompts,
    *,
    max_new_tokens: int = 32,
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    eos_token_ids: int | Sequence[int] | None = None,
    tokenizer: Any = None,
    speculative: bool = True,
    async_decode: bool = False,
    n: int = 1,
    priority: int | Sequence[int] = 0,
) -> Iterator[TokenEvent | Finished]:
    """:func:`generate` as events: an iterator of :class:`TokenEvent` (one per token, with its
    text delta, held back while it could still become a stop string) ending with a
    :class:`Finished` that carries the new state. The arguments are validated when this is
    called, before any state change (see :func:`make_requests`); ``state`` is consumed as the
    iterator runs."""
    requests, eos, grammars = make_requests(
        runtime, state, ids, max_new_tokens=max_new_tokens, sampling=sampling, eos_token_ids=eos_token_ids, tokenizer=tokenizer,
        speculative=speculative, async_decode=async_decode, n=n, priority=priority,
    )
    run = overlap_schedule if async_decode else schedule
    return run(runtime, state, requests, eos, tokenizer, speculative, grammars=grammars)


def collect(events: Iterator[TokenEvent | Finished], with_text: bool) -> tuple[GenerateResult, State]:
    """Drain a schedule into a GenerateResult and the final state."""
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    logprobs: dict[int, list[Logprobs]] = {}
    reasons: dict[int, str] = {}
    stop_reasons: dict[int, int | str | None] = {}
    stats: dict[int, SpeculationStats] = {}
    prompt: dict[int, tuple[Logprobs | None, ...]] = {}
    for ev in events:
        if isinstance(ev, Finished):
            n = ev.num_requests
            result = GenerateResult(
                token_ids=tuple(tuple(tokens.get(i, ())) for i in range(n)),
                finish_reasons=tuple(reasons.get(i, "length") for i in range(n)),
                stop_reasons=tuple(stop_reasons.get(i) for i in range(n)),
                texts=tuple(texts.get(i, "") for i in range(n)) if with_text else None,
                logprobs=tuple(tuple(logprobs[i]) if i in logprobs else None for i in range(n)),
                prefill_s=ev.prefill_s, decode_s=ev.decode_s,
                speculation=tuple(stats.get(i) for i in range(n)) if stats else None,
                prompt_logprobs=tuple(prompt.get(i) for i in range(n)) if prompt else None,
            )
            return result, ev.state
        if ev.token_id is not None:  # None: the request ended with "error" (NaN/inf logits)
            tokens.setdefault(ev.index, []).append(ev.token_id)
        texts[ev.index] = texts.get(ev.index, "") + ev.text
        if ev.logprobs is not None:
            logprobs.setdefault(ev.index, []).append(ev.logprobs)
        if ev.finish_reason is not None:
            reasons[ev.index], stop_reasons[ev.index] = ev.finish_reason, ev.stop_reason
        if ev.speculation is not None:
            stats[ev.index] = ev.speculation
        if ev.prompt_logprobs is not None:
            prompt[ev.index] = ev.prompt_logprobs
    raise RuntimeError("schedule ended without a Finished event")  # unreachable: schedule always ends with one
