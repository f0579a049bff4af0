"""Faults inside a step and non-finite model output, on a tiny llama.

- An exception or KeyboardInterrupt raised inside a step's graph (injected by wrapping the
  runtime's graph callables) leaves the input state usable: not consumed, and continuing it gives
  the tokens of a control that never saw the fault. An interrupt after the graph, while the step
  updates the state's shared host tensors, leaves the input state clearly invalid (consumed).
- NaN/inf logits in one row (a poisoned KV slot, or a NaN embedding row) are reported for that
  row (``StepOutput.finite``, finish reason "error") and change no other row's tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
import torch
from helpers import GREEDY, random_prompt, tiny_hf_model, tiny_runtime

import neuronfx
from neuronfx import DecodeBatch, PrefillBatch, SamplingParams
from neuronfx.errors import StateConsumedError
from neuronfx.runtime import pipeline
from neuronfx.runtime.scheduler import Queue, Request, step, submit

LIVE = {0: random_prompt(7, seed=50), 2: random_prompt(12, seed=51)}
NEW = random_prompt(5, seed=52)  # prefilled into free slot 1 by the faulty step
NO_EOS: frozenset[int] = frozenset()


class Injected(RuntimeError):
    """The fault the tests inject."""


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=0)


@pytest.fixture(scope="module")
def rt(hf):
    return tiny_runtime(hf)


def faulty(rt: neuronfx.Runtime, phase: str, exc: type[BaseException], after: bool) -> neuronfx.Runtime:
    """``rt`` whose ``phase`` graphs raise ``exc``: before running, or after the real graph ran
    (its K/V writes done), the worst case of a fault part-way through. "decode" covers both
    graphs a decode step may run (decode, and greedy for all-greedy rows)."""

    def wrap(graph: Callable) -> Callable:
        def run(*args):
            if after:
                graph(*args)
            raise exc("injected fault")

        return run

    phases = ("decode", "greedy") if phase == "decode" else (phase,)
    graphs = {k: wrap(g) if k[0] in phases else g for k, g in rt.graphs.items()}
    return attrs.evolve(rt, graphs=graphs)


def P(seq_ids, prompts):
    return PrefillBatch(seq_ids=seq_ids, prompts=prompts, sampling=[GREEDY] * len(prompts))


def D(seq_ids, input_ids):
    return DecodeBatch(seq_ids=seq_ids, input_ids=input_ids, sampling=[GREEDY] * len(input_ids))


def live_state(rt):
    """State with slots 0 and 2 live (prefilled, then one decode) and their last tokens."""
    out, state = neuronfx.prefill_step(rt, neuronfx.init_state(rt, seed=1), P(list(LIVE), list(LIVE.values())))
    out, state = neuronfx.decode_step(rt, state, D(list(LIVE), list(out.tokens)))
    return state, dict(zip(LIVE, out.tokens))


def continue_all(rt, state, last: dict[int, int], n: int = 5) -> tuple[dict[int, list[int]], neuronfx.State]:
    """Decode every slot of ``last`` n tokens, one batch per step."""
    slots, ids, tokens = list(last), list(last.values()), {s: [] for s in last}
    for _ in range(n):
        out, state = neuronfx.decode_step(rt, state, D(slots, ids))
        ids = list(out.tokens)
        for s, t in zip(slots, ids):
            tokens[s].append(t)
    return tokens, state


def control_run(rt) -> dict[int, list[int]]:
    """No fault: prefill NEW into slot 1, then decode slots 0, 2 and 1 together."""
    state, last = live_state(rt)
    out, state = neuronfx.prefill_step(rt, state, P([1], [NEW]))
    tokens, _ = continue_all(rt, state, last | {1: out.tokens[0]})
    return tokens | {"first": out.tokens[0]}


@pytest.fixture(scope="module")
def control(rt):
    return control_run(rt)


def host_view(state) -> tuple:
    return state.cache_lens, state.generated, state.live, state.rng_key


FAULTS = [(Injected, False), (Injected, True), (KeyboardInterrupt, False), (KeyboardInterrupt, True)]
FAULT_IDS = ["exception-before-graph", "exception-after-graph", "interrupt-before-graph", "interrupt-after-graph"]


@pytest.mark.parametrize("exc, after", FAULTS, ids=FAULT_IDS)
def test_fault_in_decode_graph_leaves_state_usable(rt, control, exc, after):
    state, last = live_state(rt)
    before = host_view(state)
    with pytest.raises(exc):
        neuronfx.decode_step(faulty(rt, "decode", exc, after), state, D(list(last), list(last.values())))
    assert not state.consumed and host_view(state) == before
    out, state = neuronfx.prefill_step(rt, state, P([1], [NEW]))
    tokens, _ = continue_all(rt, state, last | {1: out.tokens[0]})
    assert tokens | {"first": out.tokens[0]} == control


@pytest.mark.parametrize("exc, after", FAULTS, ids=FAULT_IDS)
def test_fault_in_prefill_graph_leaves_state_usable(rt, control, exc, after):
    state, last = live_state(rt)
    before = host_view(state)
    counts, mask = state.output_counts.clone(), state.prompt_mask.clone()
    with pytest.raises(exc):
        neuronfx.prefill_step(faulty(rt, "prefill", exc, after), state, P([1], [NEW]))
    assert not state.consumed and host_view(state) == before
    assert torch.equal(state.output_counts, counts) and torch.equal(state.prompt_mask, mask)
    out, state = neuronfx.prefill_step(rt, state, P([1], [NEW]))  # the retry
    tokens, _ = continue_all(rt, state, last | {1: out.tokens[0]})
    assert tokens | {"first": out.tokens[0]} == control


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_interrupt_while_updating_host_tensors_consumes_the_state(rt, monkeypatch, phase):
    """After the graph, a step revokes the input state's lease before it touches the shared
    token counts: an interrupt there leaves a state that raises on reuse, never one with
    half-updated counts that would silently change penalties."""
    state, last = live_state(rt)

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "count_tokens", interrupted)
    with pytest.raises(KeyboardInterrupt):
        if phase == "prefill":
            neuronfx.prefill_step(rt, state, P([1], [NEW]))
        else:
            neuronfx.decode_step(rt, state, D(list(last), list(last.values())))
    assert state.consumed
    with pytest.raises(StateConsumedError):
        neuronfx.decode_step(rt, state, D(list(last), list(last.values())))


def requests(n_tokens: int = 6) -> list[Request]:
    return [Request(prompt=tuple(p), sampling=SamplingParams(max_tokens=n_tokens)) for p in (*LIVE.values(), NEW)]


def drain(rt, state, queue) -> dict[int, list[int | None]]:
    tokens: dict[int, list[int | None]] = {}
    while not queue.idle:
        events, state, queue = step(rt, state, queue, NO_EOS)
        for ev in events:
            tokens.setdefault(ev.index, []).append(ev.token_id)
    return tokens


def started(rt, state) -> tuple[neuronfx.State, Queue]:
    """Two requests prefilled by a first iteration, then a third submitted: the next iteration
    prefills it and decodes the first two."""
    reqs, queue = requests(), Queue()
    for i, req in enumerate(reqs[:2]):
        queue = submit(queue, i, req, runtime=rt)
    _, state, queue = step(rt, state, queue, NO_EOS)
    return state, submit(queue, 2, reqs[2], runtime=rt)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_fault_inside_a_scheduler_iteration(rt, phase):
    """A scheduler iteration that fails keeps the caller's (state, queue) values: after a
    prefill fault (its first step) they run on exactly as without it; after a decode fault that
    followed a successful prefill in the same iteration, the state is consumed and says so."""
    want = drain(rt, *started(rt, neuronfx.init_state(rt)))
    state, queue = started(rt, neuronfx.init_state(rt))
    with pytest.raises(Injected):
        step(faulty(rt, phase, Injected, True), state, queue, NO_EOS)
    if phase == "prefill":
        assert not state.consumed and drain(rt, state, queue) == want
    else:
        assert state.consumed
        with pytest.raises(StateConsumedError):
            step(rt, state, queue, NO_EOS)


# --- NaN / inf produced by the model --------------------------------------------------------


def poison(state, slot: int) -> None:
    """Test-only: NaN into every attended K position of ``slot`` (layer 0)."""
    state.kv[0].k[slot, :, : state.cache_lens[slot]] = float("nan")


def test_nan_cache_in_one_slot_is_reported_and_other_rows_unchanged(rt, control):
    state, last = live_state(rt)
    out, state = neuronfx.prefill_step(rt, state, P([1], [NEW]))
    assert out.finite == (True,)
    poison(state, 2)
    slots = [0, 1, 2]
    step_out, state = neuronfx.decode_step(rt, state, D(slots, [last[0], out.tokens[0], last[2]]))
    assert step_out.finite == (True, True, False)
    assert not torch.isfinite(step_out.logits[2]).all() and torch.isfinite(step_out.logits[:2]).all()
    assert list(step_out.tokens[:2]) == [control[0][0], control[1][0]]
    state = neuronfx.release(rt, state, [2])  # the caller retires the reported request
    tokens, _ = continue_all(rt, state, {0: step_out.tokens[0], 1: step_out.tokens[1]}, n=4)
    assert tokens == {0: control[0][1:], 1: control[1][1:]}


def test_scheduler_finishes_a_nan_request_with_error(rt):
    queue = Queue()
    for i, req in enumerate(requests(8)):
        queue = submit(queue, i, req, runtime=rt)
    want = drain(rt, neuronfx.init_state(rt), queue)
    state = neuronfx.init_state(rt)
    events, state, queue = step(rt, state, queue, NO_EOS)
    got: dict[int, list] = {}
    reasons: dict[int, str] = {}
    slot_of_1 = next(r.slot for r in queue.running if r.index == 1)
    poison(state, slot_of_1)
    while True:
        for ev in events:
            got.setdefault(ev.index, []).append(ev.token_id)
            if ev.finish_reason:
                reasons[ev.index] = ev.finish_reason
        if queue.idle:
            break
        events, state, queue = step(rt, state, queue, NO_EOS)
    assert reasons == {0: "length", 1: "error", 2: "length"}
    assert got[0] == want[0] and got[2] == want[2]
    assert got[1] == want[1][:1] + [None]  # its prefill's token, then the error event of its first decode
    assert state.free_slots == (0, 1, 2, 3)


def nan_embedding(rt, token: int) -> neuronfx.Runtime:
    """``rt`` whose embedding row ``token`` is NaN: any prompt holding it gives NaN logits."""
    embed = rt.weights["embed"].clone()
    embed[token] = float("nan")
    return attrs.evolve(rt, weights=rt.weights | {"embed": embed})


@pytest.mark.parametrize("backend", ["eager", "export", "inductor", "inductor-speculative"])
def test_generate_reports_nan_prompt_and_keeps_others(hf, request, backend):
    base = {"eager": lambda: rt_small(hf, "eager"), "export": lambda: rt_small(hf, "export"),
            "inductor": lambda: request.getfixturevalue("inductor_qwen2")[1],
            "inductor-speculative": lambda: request.getfixturevalue("inductor_speculative")[1]}[backend]()
    good, bad = [3, 4, 5], [6, 7, 8]
    alone, _ = neuronfx.generate(base, neuronfx.init_state(base), [good], max_new_tokens=5, eos_token_ids=[])
    poisoned = nan_embedding(base, 7)
    result, state = neuronfx.generate(poisoned, neuronfx.init_state(poisoned), [good, bad], max_new_tokens=5, eos_token_ids=[])
    assert result.finish_reasons == ("length", "error")
    assert result.token_ids == (alone.token_ids[0], ())
    assert state.free_slots == tuple(range(base.plan.inference.batch_size))


def test_speculate_step_reports_a_nan_row_and_keeps_the_others(hf):
    """A poisoned slot's verify logits are NaN: speculate_step flags that row only."""
    rt = tiny_runtime(hf, speculation_length=4, draft_layers=1)
    state, last = live_state(rt)
    plain, _ = neuronfx.speculate_step(rt, live_state(rt)[0], neuronfx.SpeculateBatch(seq_ids=list(last), input_ids=list(last.values()),
                                                                                       sampling=[GREEDY] * 2))
    poison(state, 2)
    out, state = neuronfx.speculate_step(rt, state, neuronfx.SpeculateBatch(seq_ids=list(last), input_ids=list(last.values()),
                                                                            sampling=[GREEDY] * 2))
    assert out.finite == (True, False) and out.new_tokens[0] == plain.new_tokens[0]


@pytest.mark.parametrize("phase", ["decode", "speculate"])
def test_compiled_graphs_report_a_poisoned_slot(inductor_speculative, phase):
    """The default backend: NaN keys in one slot reach that row's logits through the C++
    cached-attention kernel (whose softmax once skipped a NaN score, so the compiled step
    reported nothing where the eager one did), the step flags that row only and the other
    row's tokens are those of the same step without the poison."""
    _, rt = inductor_speculative
    step = neuronfx.decode_step if phase == "decode" else neuronfx.speculate_step
    batch = D if phase == "decode" else (lambda seq_ids, ids: neuronfx.SpeculateBatch(seq_ids=seq_ids, input_ids=ids, sampling=[GREEDY] * 2))
    state, last = live_state(rt)
    plain, _ = step(rt, live_state(rt)[0], batch(list(last), list(last.values())))
    poison(state, 2)
    out, state = step(rt, state, batch(list(last), list(last.values())))
    tokens = (lambda o: list(o.tokens)) if phase == "decode" else (lambda o: list(o.new_tokens))
    assert plain.finite == (True, True) and out.finite == (True, False)
    assert tokens(out)[0] == tokens(plain)[0]


def rt_small(hf, backend: str) -> neuronfx.Runtime:
    """Two slots, one prefill and one decode bucket: 2 graphs (cheap to export)."""
    return tiny_runtime(hf, backend, batch_size=2, batch_buckets=(2,), max_context_length=8, sequence_length=16,
                        prefill_buckets=(8,), decode_buckets=(16,))
