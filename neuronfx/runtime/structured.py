"""Structured outputs on the host: a request's grammar (JSON schema, any JSON object, regex,
choice, Lark grammar) as a :class:`Matcher` that fills its row of the step's int32 token bitmask
(B, ceil(V / 32)) and follows the tokens the request produces. The graph applies the bitmask
(``graphs/phases/sampling.py``); nothing here runs a graph.

One small interface in the manner of vLLM's ``StructuredOutputBackend`` /
``StructuredOutputGrammar`` (``vllm/v1/structured_output/backend_types.py``): a
:class:`Backend` compiles a :class:`~neuronfx.config.structured.StructuredOutputs` into a
grammar and makes matchers from it; a :class:`Matcher` fills a bitmask row, consumes tokens,
validates tokens without advancing, rolls back, and says whether it is stopped. The backend is
llguidance (:class:`GuidanceBackend`, https://github.com/guidance-ai/llguidance); xgrammar is not
wired (see docs/usage/structured-outputs.md). :class:`Grammars` holds a backend and caches compiled
grammars by (kind, spec) on the instance: the scheduler (``Queue.grammars``) and ``generate``
hold one and pass it; nothing is cached at module level.

EOS: the tokenizer's eos token (what a grammar library ends a grammar with) need not be the
model's (SmolLM2's chat model ends a turn with ``<|im_end|>``): every one of the model's eos ids
is given to llguidance as an eos token too, so a complete grammar allows each of them, and the
scheduler finishes the request ("stop") as soon as its matcher is stopped.
"""

from __future__ import annotations

import abc
import functools
import json
from collections.abc import Sequence
from typing import Any

import torch

from neuronfx.config.plan import bitmask_words
from neuronfx.config.sampling import SamplingParams
from neuronfx.config.structured import StructuredOutputs
from neuronfx.errors import InputError, SamplingParamsError
from neuronfx.runtime.batch import stop_ids
from neuronfx.runtime.runtime import Runtime

Tensor = torch.Tensor


class Matcher(abc.ABC):
    """One request's grammar state (vLLM's ``StructuredOutputGrammar``). Mutable: the caller
    :meth:`consume` s the tokens a step produced; steps only read it (a speculate step advances
    through its own drafts and rolls them back)."""

    @abc.abstractmethod
    def fill(self, bitmask: Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` ((rows, W) int32, on the host)."""

    @abc.abstractmethod
    def consume(self, tokens: Sequence[int]) -> bool:
        """Advance over ``tokens``; False when one is not allowed (the matcher is then in error)."""

    @abc.abstractmethod
    def validate(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (a prefix) the grammar accepts from here, without advancing."""

    @abc.abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens."""

    @abc.abstractmethod
    def is_stopped(self) -> bool:
        """Whether the grammar is complete and takes no more tokens (or is in error)."""

    @abc.abstractmethod
    def error(self) -> str:
        """The library's error message, "" when none."""


class Backend(abc.ABC):
    """A grammar library (vLLM's ``StructuredOutputBackend``): compile, then make matchers."""

    @abc.abstractmethod
    def compile(self, structured: StructuredOutputs) -> Any:
        """The library's compiled grammar; SamplingParamsError naming the field and the
        library's message when it rejects the spec."""

    @abc.abstractmethod
    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the grammar's start."""


# --- llguidance -----------------------------------------------------------------------------------


class GuidanceMatcher(Matcher):
    """A :class:`Matcher` over ``llguidance.LLMatcher`` (final)."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill(self, bitmask: Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._m, bitmask, row)

    def consume(self, tokens: Sequence[int]) -> bool:
        return bool(self._m.consume_tokens(list(tokens)))

    def validate(self, tokens: Sequence[int]) -> int:
        return int(self._m.validate_tokens(list(tokens)))

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    def is_stopped(self) -> bool:
        return bool(self._m.is_stopped())

    def error(self) -> str:
        return str(self._m.get_error()).split("\n", 1)[0]  # the first line; the rest is a parser state dump


def guidance_grammar(structured: StructuredOutputs) -> str:
    """The llguidance grammar text of ``structured``. JSON is compiled with
    ``whitespace_flexible=False`` (compact JSON, one separator form): with free whitespace a small
    model can emit spaces and newlines forever while staying inside the grammar. Raises
    ValueError for what llguidance cannot even parse (the caller names the field)."""
    import llguidance

    kind, spec = structured.kind, structured.spec
    if kind in ("json", "json_object"):
        schema = spec if kind == "json" else '{"type": "object"}'
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(spec)))
    return llguidance.grammar_from("regex" if kind == "regex" else "grammar", spec)


def one_line(message: str, limit: int = 400) -> str:
    """A library's (multi-line) message as one line of at most ``limit`` characters."""
    return " ".join(message.split())[:limit]


class GuidanceBackend(Backend):
    """llguidance over a fast transformers tokenizer (``llguidance.hf.from_tokenizer``), with a
    vocabulary of the model's ``vocab_size`` and eos tokens: the tokenizer's and the model's.
    The llguidance tokenizer (about a second for a 50k vocabulary) is built at the first
    compile, so a server whose tokenizer cannot drive grammars still serves every other request;
    a structured one then gets the InputError."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, tuple(eos_token_ids)
        self._words = bitmask_words(vocab_size)

    @functools.cached_property
    def ll_tokenizer(self) -> Any:
        """The llguidance tokenizer; InputError when the tokenizer cannot drive structured outputs."""
        import llguidance.hf
        import transformers

        own = self.tokenizer.eos_token_id if isinstance(self.tokenizer, transformers.PreTrainedTokenizerFast) else None
        eos = sorted({*self.eos_token_ids, *([] if own is None else [own])})
        try:
            return llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=eos or None)
        except (ValueError, TypeError) as exc:
            raise InputError(f"tokenizer={type(self.tokenizer).__name__} cannot drive structured outputs ({exc}); pass the "
                             "model's fast transformers tokenizer (neuronfx.io.checkpoints.load_tokenizer).") from None

    def compile(self, structured: StructuredOutputs) -> str:
        import llguidance

        field = f"StructuredOutputs.{structured.kind}={structured.spec!r:.80}"
        try:
            grammar = guidance_grammar(structured)
        except ValueError as exc:
            raise SamplingParamsError(f"{field} is rejected by llguidance: {one_line(str(exc))}; fix the spec.") from None
        message = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if message:
            raise SamplingParamsError(f"{field} is rejected by llguidance: {one_line(message)}; fix the spec.")
        first = torch.zeros(1, self._words, dtype=torch.int32)
        m = self.matcher(grammar)
        m.fill(first, 0)
        if m.error() or not bool(first.any()):  # a matcher that cannot start stops in error (it still allows eos)
            raise SamplingParamsError(f"{field} allows no token at the first step (no token of this tokenizer starts a match); "
                                      "fix the spec.")
        for choice in structured.choice or ():
            self._check_choice(grammar, choice, field)
        return grammar

    def _check_choice(self, grammar: str, choice: str, field: str) -> None:
        """SamplingParamsError unless the matcher accepts ``choice`` as this tokenizer encodes it:
        llguidance can allow a byte token in its first mask yet refuse it when consumed (the first
        byte of a 4-byte character such as U+40000 with SmolLM2's byte-level BPE, found by
        tests/test_server_fuzz.py), which would end the request with no token."""
        ids = self.tokenizer.encode(choice, add_special_tokens=False)
        if self.matcher(grammar).validate(ids) != len(ids):
            raise SamplingParamsError(f"{field}: the choice {choice!r:.40} cannot be generated with this tokenizer (the "
                                      f"grammar matcher refuses its tokens {ids[:8]}); use choices the vocabulary can spell.")

    def matcher(self, compiled: str) -> GuidanceMatcher:
        import llguidance

        return GuidanceMatcher(llguidance.LLMatcher(self.ll_tokenizer, compiled, log_level=0))


# --- the cache, held by its user ------------------------------------------------------------------


class Grammars:
    """Compiled grammars of one backend, cached by (kind, spec) on this instance (at most
    ``maxsize``); the scheduler's ``Queue`` and ``generate`` hold one. Thread-safe as
    ``functools.lru_cache`` is (the server validates in its handlers, the engine makes matchers)."""

    def __init__(self, backend: Backend, maxsize: int = 256) -> None:
        self.backend = backend
        self._compiled = functools.lru_cache(maxsize=maxsize)(self._compile)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Grammars:
        """llguidance (:class:`GuidanceBackend`) over ``tokenizer`` with the model's vocabulary
        size and eos ids. Cheap: the first check or matcher builds llguidance's tokenizer (and
        raises InputError when ``tokenizer`` cannot drive it)."""
        return cls(GuidanceBackend(tokenizer, vocab_size, eos_token_ids))

    @classmethod
    def for_runtime(cls, runtime: Runtime, tokenizer: Any) -> Grammars:
        """:meth:`for_tokenizer` with ``runtime``'s vocabulary size and eos ids."""
        model = runtime.plan.model
        return cls.for_tokenizer(tokenizer, model.vocab_size, model.eos_token_ids)

    def _compile(self, kind: str, spec: Any) -> Any:
        return self.backend.compile(StructuredOutputs(**{kind: spec}))

    def check(self, structured: StructuredOutputs) -> None:
        """Raise SamplingParamsError (naming the field and the library's message) when the
        backend rejects ``structured`` or it allows no token at the first step."""
        self._compiled(structured.kind, structured.spec)

    def matcher(self, structured: StructuredOutputs) -> Matcher:
        """A fresh matcher for ``structured`` (compiled once per (kind, spec)); raises what
        :meth:`check` raises."""
        return self.backend.matcher(self._compiled(structured.kind, structured.spec))


def grammars_for(runtime: Runtime, params: Sequence[SamplingParams], tokenizer: Any, grammars: Grammars | None = None,
                 ) -> Grammars | None:
    """The Grammars the requests of ``params`` need, every structured one checked: None when none
    is structured, else ``grammars`` or a new one over ``tokenizer``. Raises InputError naming
    ``tokenizer=`` when a request is structured and no tokenizer is given, SamplingParamsError
    for a spec the library rejects."""
    wanted = [sp.structured for sp in params if sp.structured is not None]
    if not wanted:
        return grammars
    if grammars is None:
        if tokenizer is None:
            raise InputError(f"SamplingParams.structured ({wanted[0].kind}) needs the model's tokenizer to build token masks: "
                             "pass tokenizer= (e.g. neuronfx.io.checkpoints.load_tokenizer(path)); the scheduler's Queue "
                             "takes grammars=Grammars.for_runtime(runtime, tokenizer).")
        grammars = Grammars.for_runtime(runtime, tokenizer)
    for structured in wanted:
        grammars.check(structured)
    return grammars


# --- the step's bitmask ---------------------------------------------------------------------------


Constraints = tuple[Matcher | None, ...] | None
"""A step batch's ``constraints``: one matcher (or None) per row, or None for no constrained row."""


def constraint_rows(value: object) -> Constraints:
    """attrs converter of a batch's ``constraints``: None, or any sequence -> a tuple."""
    return None if value is None else tuple(value) if isinstance(value, (list, tuple)) else value  # type: ignore[return-value]


def pick(constraints: Constraints, rows: Sequence[int]) -> Constraints:
    """The ``constraints`` of batch rows ``rows`` (None stays None)."""
    return None if constraints is None else tuple(constraints[r] for r in rows)


def check_constraints(constraints: object, sampling: Sequence[SamplingParams]) -> None:
    """Raise InputError unless ``constraints`` is None or one Matcher-or-None per row, and every
    row whose SamplingParams has ``structured`` has a matcher (the step API does not make them:
    ``Grammars.matcher``)."""
    n = len(sampling)
    if constraints is not None and (not isinstance(constraints, tuple) or len(constraints) != n
                                    or not all(c is None or isinstance(c, Matcher) for c in constraints)):
        raise InputError(f"constraints={constraints!r:.80} must be None or one neuronfx.runtime.structured.Matcher (or None) "
                         f"per row ({n}); make them with Grammars.matcher(structured).")
    for b, sp in enumerate(sampling):
        if isinstance(sp, SamplingParams) and sp.structured is not None and (constraints is None or constraints[b] is None):
            raise InputError(f"row {b} has SamplingParams.structured ({sp.structured.kind}) but no matcher: pass constraints= "
                             "with grammars.matcher(sp.structured) for it (neuronfx.runtime.structured.Grammars), and consume "
                             "its tokens after each step.")


def token_bitmask(constraints: Sequence[Matcher | None] | None, params: Sequence[SamplingParams], generated: Sequence[int],
                  eos_token_ids: Sequence[int], vocab_size: int) -> Tensor | None:
    """(n, W) int32 bitmask of the n rows (W = ceil(V / 32); -1 for unconstrained rows), or None
    when no row is constrained. A constrained row still under its ``min_tokens`` must allow a
    token besides its stop ids (which the min_tokens bias holds back): else SamplingParamsError
    naming the row, raised before the step runs (never a NaN in the graph)."""
    if constraints is None or all(c is None for c in constraints):
        return None
    out = torch.full((len(params), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for r, (m, sp, done) in enumerate(zip(constraints, params, generated)):
        if m is None:
            continue
        m.fill(out, r)
        allowed = out[r].clone()
        if done < sp.min_tokens:
            for t in stop_ids(eos_token_ids, sp):
                bit = torch.tensor(1, dtype=torch.int32) << (t % 32)  # int32: bit 31 wraps to the sign bit
                allowed[t // 32] &= ~bit
        if not bool(allowed.any()):
            raise SamplingParamsError(
                f"row {r}: its structured output allows no token after {done} generated ({m.error() or 'only stop tokens'}), "
                f"min_tokens={sp.min_tokens} holds back its stop tokens: lower min_tokens or loosen the grammar.")
    return out
