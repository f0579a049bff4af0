"""State: the KV cache, per-slot token bookkeeping and liveness, and the RNG key, passed explicitly.

A step consumes its input state and returns a new one. KV tensors are updated in place for
speed, so a consumed state must not be used again: its lease is revoked and any further use
raises StateConsumedError.
"""

from __future__ import annotations

import attrs
import torch

from neuronfx.config.dtypes import dtype_name
from neuronfx.config.plan import Plan
from neuronfx.config.sampling import MAX_SEED
from neuronfx.errors import InputError, StateConsumedError, StateMismatchError
from neuronfx.graphs.phases.inputs import KVCache, empty_kv
from neuronfx.runtime.blocks import BlockTables, empty_blocks
from neuronfx.runtime.prefix_pool import PrefixCache, empty_prefix_cache


@attrs.define
class Lease:
    """The one mutable cell: whether the value holding it (a State, an overlapped step's
    ``Pending``) may still be used."""

    valid: bool = True


@attrs.frozen(kw_only=True, eq=False)
class State:
    """Per-request mutable facts of a runtime, as a value.

    - ``kv``: the KV cache, one ``LayerKV(k, v)`` per layer, each
      [num_slots, num_kv_heads, sequence_length, head_dim] in the plan's dtype, on the plan's
      device; the last slot is scratch.
    - ``output_counts``: [batch_size, vocab] int32 on the host, how often each token was sampled
      by the request in each slot (presence/frequency/repetition penalties).
    - ``prompt_mask``: [batch_size, vocab] bool on the host, tokens of each slot's prompt
      (repetition penalty). Both go to the device with each step's inputs.
    - ``cache_lens``: tokens held per request slot, [batch_size] host ints.
    - ``generated``: tokens sampled so far per request slot, [batch_size] host ints (a seeded
      request's n-th draw depends only on its seed and n).
    - ``live``: whether each request slot belongs to a request, [batch_size] bools.
    - ``rng_key``: int seed of the next step's random numbers.
    - ``plan_key``: identifies the plan the state was made for.
    - ``draft``: the draft model's state when the runtime has a draft runtime (its slots follow
      this state's: slot s holds the same request in both), else None.
    - ``prefix``: the prefix cache (its block pool, updated in place like ``kv``, and the
      store's bookkeeping value) when the plan has ``enable_prefix_caching``, else None.
    - ``blocks``: the block manager's tables and reference counts (``runtime/blocks.py``, host
      tensors updated in place like ``output_counts``) for ``kv_layout="blocks"``, else None.
    """

    kv: KVCache
    output_counts: torch.Tensor
    prompt_mask: torch.Tensor
    cache_lens: tuple[int, ...]
    generated: tuple[int, ...]
    live: tuple[bool, ...]
    rng_key: int
    plan_key: int
    draft: State | None = None
    prefix: PrefixCache | None = None
    blocks: BlockTables | None = None
    _lease: Lease = attrs.field(factory=Lease, alias="lease")

    @property
    def num_slots(self) -> int:
        """Request slots (excludes the scratch slot)."""
        return len(self.cache_lens)

    @property
    def free_slots(self) -> tuple[int, ...]:
        """Request slots that hold no request, ascending."""
        return free_slots_of(self.live)

    @property
    def consumed(self) -> bool:
        """Whether a step already consumed this state (using it again raises StateConsumedError)."""
        return not self._lease.valid


def free_slots_of(live: tuple[bool, ...]) -> tuple[int, ...]:
    """The slots ``live`` marks free, ascending (a State's or an overlapped step's)."""
    return tuple(s for s, on in enumerate(live) if not on)


def plan_key(plan: Plan) -> int:
    """What a state records of the plan it was made for: a hash of (model, inference) configs."""
    return hash((plan.model, plan.inference))


def check_seed(seed: object) -> None:
    """Raise InputError unless ``seed`` is an int in [0, MAX_SEED] (a torch.Generator seed)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise InputError(f"seed={seed!r} must be an int in [0, {MAX_SEED}].")


def empty_state(plan: Plan, seed: int = 0, draft: State | None = None) -> State:
    """Fresh state: zero KV cache (plan.kv.nbytes bytes) and token counts, all slots free, RNG
    key ``seed``; ``draft`` is the draft runtime's fresh state, if any.

    Raises InputError unless ``seed`` is an int in [0, 2**63 - 1] (a torch.Generator seed)."""
    check_seed(seed)
    n, vocab, prefix = plan.inference.batch_size, plan.model.vocab_size, empty_prefix_cache(plan)
    return State(
        kv=empty_kv(plan), output_counts=torch.zeros(n, vocab, dtype=torch.int32),
        prompt_mask=torch.zeros(n, vocab, dtype=torch.bool), cache_lens=(0,) * n, generated=(0,) * n,
        live=(False,) * n, rng_key=int(seed), plan_key=plan_key(plan), draft=draft, prefix=prefix,
        blocks=empty_blocks(plan, 0 if prefix is None else prefix.store.num_blocks),
    )


def check_usable(state: State, plan: Plan, draft_plan: Plan | None = None) -> None:
    """Raise InputError (not a State), StateConsumedError or StateMismatchError unless ``state``
    may be used with ``plan`` (and its draft state with ``draft_plan``, the draft runtime's)."""
    if not isinstance(state, State):
        raise InputError(
            f"state is a {type(state).__name__}; pass the State returned by neuronfx.init_state(runtime) or by the last step."
        )
    if state.consumed:
        raise StateConsumedError(
            "this state was already consumed by a step (its KV cache was updated in place); "
            "use the new state that step returned."
        )
    if state.plan_key != plan_key(plan):
        got = (tuple(state.kv[0].k.shape), dtype_name(state.kv[0].k.dtype)) if state.kv else None
        raise StateMismatchError(
            f"this state was made for a different plan (its KV cache is {got}, this runtime's is "
            f"{(plan.kv.layer_shape(0), plan.kv.dtype)}, or the model/options differ); create one with neuronfx.init_state(runtime)."
        )
    if state.draft is not None and state.draft.consumed:
        raise StateConsumedError(
            "this state's draft state was already consumed (a step was interrupted after advancing the draft); "
            "use the state that step returned, or start again from neuronfx.init_state(runtime)."
        )
    if (state.draft is None) != (draft_plan is None) or (draft_plan is not None and state.draft.plan_key != plan_key(draft_plan)):
        raise StateMismatchError(
            "this state's draft state does not belong to this runtime's draft runtime (one has a draft, the other not, "
            "or they differ); create the state with neuronfx.init_state(runtime) after attaching the draft."
        )


def advance(state: State, *, cache_lens: tuple[int, ...], generated: tuple[int, ...], live: tuple[bool, ...], rng_key: int,
            draft: State | None = None, prefix: PrefixCache | None = None) -> State:
    """Revoke ``state``'s lease; return a new state sharing its tensors (updated in place by the
    step) with the new host counts (and the new draft state and prefix cache, or the old ones
    when None)."""
    state._lease.valid = False
    return State(
        kv=state.kv, output_counts=state.output_counts, prompt_mask=state.prompt_mask, cache_lens=cache_lens,
        generated=generated, live=live, rng_key=rng_key, plan_key=state.plan_key,
        draft=state.draft if draft is None else draft, prefix=state.prefix if prefix is None else prefix, blocks=state.blocks,
    )


def with_draft_state(state: State, draft: State) -> State:
    """Revoke ``state``'s lease; the same state with ``draft`` as its draft runtime's state (a
    step of the draft runtime followed the target's, ``speculate.follow_draft``)."""
    return advance(state, cache_lens=state.cache_lens, generated=state.generated, live=state.live, rng_key=state.rng_key,
                   draft=draft)
