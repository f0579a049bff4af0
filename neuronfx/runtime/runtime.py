"""Runtime: (plan, compiled graphs keyed by (phase, batch, bucket), shared weights). Immutable.

Building a runtime from weights already converted to neuronfx's layout is here
(:func:`build_runtime`); reading checkpoints, the compile cache and saved runtimes is I/O above
this layer (``neuronfx.api.compile`` / ``load``).
"""

from __future__ import annotations

import shutil
import weakref
from collections.abc import Mapping
from pathlib import Path

import attrs

from neuronfx.config.kv_blocks import ring_size
from neuronfx.config.plan import Plan, ring_options
from neuronfx.errors import ConfigError, InputError
from neuronfx.graphs.backends import Built, Graph, GraphKey, get_backend
from neuronfx.graphs.models.layers import Weights
from neuronfx.runtime.prefix_pool import identity_key
from neuronfx.runtime.state import State, check_usable, empty_state


@attrs.frozen(kw_only=True, eq=False)
class Runtime:
    """A compiled plan.

    - ``plan``: the Plan it was compiled for.
    - ``weights``: neuronfx weights in the plan's dtype, one copy shared by all graphs.
    - ``graphs``: (phase, batch_size, bucket) -> ``graph(weights, kv, inputs)``.
    - ``compile_s``: (phase, batch_size, bucket) -> seconds spent building (or loading) that graph.
    - ``compiled_dir``: the backend's private directory of compiled files the graphs use
      (inductor: its kernel cache); removed when the runtime is collected; None when none.
    - ``cache_key``: the compile-cache key the graphs came from or went into (None: no cache).
    - ``from_cache``: whether the graphs were loaded from the compile-cache entry ``cache_key``
      (False: built here, or loaded from a saved runtime).
    - ``draft``: a draft runtime for speculative decoding (:func:`with_draft`), else None.
    - ``prefix_key``: derived, not passed: what prefix-cache hashes start from
      (``prefix_pool.identity_key``: sha256 of the plan and every weight byte; b"" without
      prefix caching). Computed whenever a Runtime is made, ``attrs.evolve`` included, so a
      runtime on other weights never reuses another's cached prefixes.
    """

    plan: Plan
    weights: Weights
    graphs: Mapping[GraphKey, Graph]
    compile_s: Mapping[GraphKey, float]
    compiled_dir: str | None = None
    cache_key: str | None = None
    from_cache: bool = False
    draft: Runtime | None = None
    _owner: object = attrs.field(default=None, alias="owner", repr=False)  # removes compiled_dir when the last copy goes
    prefix_key: bytes = attrs.field(init=False, repr=False,
                                    default=attrs.Factory(lambda rt: identity_key(rt.plan, rt.weights), takes_self=True))

    @property
    def can_speculate(self) -> bool:
        """Whether :func:`neuronfx.speculate_step` can run: speculate graphs plus a draft
        (the plan's own ``draft_layers``, a draft runtime, or ``speculative_method="ngram"``:
        prompt lookup, no draft graphs)."""
        inf = self.plan.inference
        drafts = inf.draft_layers > 0 or self.draft is not None or inf.speculative_method == "ngram"
        return inf.speculation_length >= 2 and drafts


def build_runtime(plan: Plan, weights: Weights, built: Built, cache_key: str | None = None, from_cache: bool = False) -> Runtime:
    """The runtime of ``plan`` over ``weights`` with the graphs of ``built``; it owns (and
    removes when collected) ``built.compiled_dir``. ``cache_key`` / ``from_cache``: see Runtime."""
    owner = None
    if built.compiled_dir is not None:
        owner = _DirOwner()  # shared by every attrs.evolve copy of the runtime
        weakref.finalize(owner, shutil.rmtree, built.compiled_dir, True)
    return Runtime(plan=plan, weights=weights, graphs=built.graphs, compile_s=built.seconds,
                   compiled_dir=built.compiled_dir, cache_key=cache_key, from_cache=from_cache, owner=owner)


class _DirOwner:
    """Lives as long as some runtime refers to its compiled directory."""


def build_graphs(plan: Plan, weights: Weights, progress: bool = True, kernels: Path | None = None) -> Built:
    """Build every graph of ``plan`` with its backend, starting from the kernel store
    ``kernels`` (a directory, see ``neuronfx.io.cache.kernel_store``) when given."""
    return get_backend(plan.inference.backend).build(plan, weights, progress, kernels)


def with_draft(runtime: Runtime, draft: Runtime) -> Runtime:
    """``runtime`` with ``draft`` as its draft model for speculative decoding (vLLM's draft
    model): ``speculate_step`` proposes with the draft's decode graphs and verifies with
    ``runtime``'s speculate graphs. States made by :func:`init_state` then carry the draft's
    state, slot for slot.

    Raises ConfigError when ``runtime`` has no speculate graphs (``speculation_length``) or
    drafts by ``speculative_method`` ("ngram"), the draft has a draft of its own, or the
    draft cannot follow every request of ``runtime``: another vocabulary, fewer slots
    (``batch_size``), a shorter ``sequence_length`` or ``max_context_length``, a smaller
    ``max_topk``, or no logits
    (``output_logits=True`` is needed: sampled rows need the draft's distribution).
    """
    check_runtime(runtime)
    if not isinstance(draft, Runtime):
        raise ConfigError(f"draft is a {type(draft).__name__}; pass the draft's compiled Runtime (neuronfx.compile of the draft model).")
    inf, dinf = runtime.plan.inference, draft.plan.inference
    if draft.draft is not None:
        raise ConfigError("the draft runtime has a draft of its own; attach a runtime without one (its plain graphs draft).")
    if inf.speculation_length < 2:
        raise ConfigError("this runtime has no speculate graphs: compile it with InferenceConfig(speculation_length=k >= 2).")
    if inf.speculative_method is not None:
        raise ConfigError(f"this runtime drafts with speculative_method={inf.speculative_method!r} (no draft model); attach a "
                          "draft to a runtime compiled with speculative_method=None, or drop with_draft.")
    checks = [
        ("vocab_size", draft.plan.model.vocab_size, runtime.plan.model.vocab_size, "the draft must share the target's tokenizer"),
        ("batch_size", dinf.batch_size, inf.batch_size, "it needs a slot for every target slot"),
        ("sequence_length", dinf.sequence_length, inf.sequence_length, "it must hold every target request"),
        ("max_context_length", dinf.max_context_length, inf.max_context_length, "it prefills every target prompt"),
        ("max_topk", dinf.max_topk, inf.max_topk, "it samples every top_k the target accepts"),
    ]
    for name, got, want, why in checks:
        if got < want or (name == "vocab_size" and got != want):
            raise ConfigError(f"draft {name}={got} but the target's is {want}: {why}; compile the draft with {name}={want}.")
    if not dinf.output_logits:
        raise ConfigError("the draft runtime returns no logits: compile it with output_logits=True (sampled speculation "
                          "needs the distribution its tokens were drawn from).")
    check_draft_ring(draft.plan, inf.speculation_length)
    return attrs.evolve(runtime, draft=draft)


def check_draft_ring(draft: Plan, k: int) -> None:
    """Raise ConfigError when the draft's window ring (``config.kv.KVLayout``) is too small for
    drafting ``k`` - 1 tokens a verify pass may reject: they overwrite ring positions the next
    step's window still reads unless the ring holds a step of k - 1 tokens (the draft's outputs
    would stay right, its proposals not)."""
    kv = draft.kv
    if not kv.ring_blocks:
        return
    need = ring_size(ring_options(draft.model, draft.inference)["reach"], k - 1, kv.block_size)
    if kv.ring_blocks < need:
        raise ConfigError(f"the draft's window ring holds {kv.ring_blocks} blocks of {kv.block_size} positions; drafting for "
                          f"speculation_length={k} needs {need} (rejected drafts are written past the window it reads next): compile the "
                          f"draft with speculation_length={k} (its ring then holds a speculate step), a kv_block_size of at least {k - 2}, "
                          "or kv_layout='slots'.")


def check_runtime(runtime: object) -> None:
    """Raise InputError unless ``runtime`` is a Runtime."""
    if not isinstance(runtime, Runtime):
        raise InputError(f"runtime is a {type(runtime).__name__}; pass the Runtime neuronfx.compile or neuronfx.load returned.")


def check_state(runtime: Runtime, state: State) -> None:
    """Raise InputError (``runtime`` not a Runtime, ``state`` not a State), StateConsumedError or
    StateMismatchError unless ``state`` belongs to ``runtime`` (its draft state to the draft
    runtime) and may still be used."""
    check_runtime(runtime)
    check_usable(state, runtime.plan, runtime.draft.plan if runtime.draft is not None else None)


def init_state(runtime: Runtime, seed: int = 0) -> State:
    """A fresh state for ``runtime``: zero KV cache (``runtime.plan.kv.nbytes`` bytes), all slots
    free, RNG key ``seed`` (same seed and inputs give the same sampled tokens); with a draft
    runtime, the draft's fresh state too. Raises InputError for a runtime that is not a Runtime
    or a seed outside [0, 2**63 - 1], ConfigError for an embedding runtime (``task="embed"``: it
    has no generation graphs; ``neuronfx.embed`` takes no state)."""
    check_runtime(runtime)
    if runtime.plan.inference.task == "embed":
        raise ConfigError("this runtime embeds (task='embed') and has no generation graphs: call neuronfx.embed(runtime, ids), "
                          "or compile the model with InferenceConfig(task='generate') to generate.")
    draft = empty_state(runtime.draft.plan) if runtime.draft is not None else None
    return empty_state(runtime.plan, seed, draft=draft)
