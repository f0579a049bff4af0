"""Runtime behaviour on a tiny llama (eager backend): batching, slots and stale cache, bucket
selection, consumed states, input errors raised before any state change, seeded sampling, eos.

Plan: batch_size 4 (slots 0-3, scratch slot 4), prefill buckets (8, 16, 32), decode buckets
(16, 32, 64), max_context_length 32, sequence_length 64, vocab 256.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import GREEDY, VOCAB, kv_tensors, random_prompt, run_steps, tiny_hf_model, tiny_runtime

import neuronfx
from neuronfx import DecodeBatch, InferenceConfig, PrefillBatch, SamplingParams
from neuronfx.config import structure
from neuronfx.errors import (
    BatchTooLargeError,
    ConfigError,
    EmptyPromptError,
    InputError,
    PromptTooLongError,
    SamplingParamsError,
    SequenceLengthExceededError,
    SlotError,
    StateConsumedError,
    StateMismatchError,
    TokenOutOfVocabError,
)


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=0)


@pytest.fixture(scope="module")
def rt(hf):
    return tiny_runtime(hf)


def generate(rt, state, prompts, n=16, **kw):
    return neuronfx.generate(rt, state, prompts, max_new_tokens=n, eos_token_ids=kw.pop("eos_token_ids", []), **kw)


def slot_kv(state, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for t in kv_tensors(state)]


def assert_kv_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def decode_from(rt, state, slot: int, token: int, n: int) -> tuple[list[int], neuronfx.State]:
    """Continue live ``slot`` (whose last sampled token is ``token``) greedily for n tokens."""
    out = []
    for _ in range(n):
        step, state = neuronfx.decode_step(rt, state, DecodeBatch(seq_ids=[slot], input_ids=[token], sampling=[GREEDY]))
        token = step.tokens[0]
        out.append(token)
    return out, state


# --- batching -------------------------------------------------------------------------------

LENGTHS = (3, 9, 16, 30)


def test_batch_rows_match_single_runs(rt):
    prompts = [random_prompt(n, seed=n) for n in LENGTHS]
    slots = [2, 0, 3, 1]  # rows need not sit in their own slot index
    tokens, logits, buckets, state = run_steps(rt, neuronfx.init_state(rt), slots, prompts, 16)
    assert buckets[0] == 32 and buckets[-1] == 64
    assert state.cache_lens[2] == 3 + 15 and state.cache_lens[1] == 30 + 15
    for r, prompt in enumerate(prompts):
        alone_tokens, alone_logits, _, _ = run_steps(rt, neuronfx.init_state(rt), [0], [prompt], 16)
        assert tokens[r] == alone_tokens[0], f"row {r} (prompt length {len(prompt)})"
        for step, (a, b) in enumerate(zip(logits[r], alone_logits[0], strict=True)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m, s=step, r=r: f"row {r} step {s}: {m}")
    result, state = generate(rt, neuronfx.init_state(rt), prompts)
    assert [list(t) for t in result.token_ids] == tokens
    assert state.free_slots == (0, 1, 2, 3) and state.cache_lens == (0, 0, 0, 0)


# --- stale and NaN cache contents -----------------------------------------------------------


def test_nan_filled_cache_gives_identical_tokens_and_logits(rt):
    prompts = [random_prompt(n, seed=10 + n) for n in LENGTHS]
    clean_tokens, clean_logits, _, _ = run_steps(rt, neuronfx.init_state(rt), [0, 1, 2, 3], prompts, 20)
    state = neuronfx.init_state(rt)
    for t in kv_tensors(state):
        t.fill_(float("nan"))
    tokens, logits, _, _ = run_steps(rt, state, [0, 1, 2, 3], prompts, 20)
    assert tokens == clean_tokens
    for row, clean_row in zip(logits, clean_logits, strict=True):
        for a, b in zip(row, clean_row, strict=True):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)

    state = neuronfx.init_state(rt)
    for t in kv_tensors(state):
        t.fill_(float("nan"))
    result, _ = generate(rt, state, prompts, n=20)
    assert [list(t) for t in result.token_ids] == clean_tokens


def test_slot_reused_after_long_request_behaves_like_fresh(rt):
    short = random_prompt(3, seed=21)
    fresh_tokens, fresh_logits, _, _ = run_steps(rt, neuronfx.init_state(rt), [0], [short], 16)

    state = neuronfx.init_state(rt)
    long_result, state = generate(rt, state, [random_prompt(32, seed=22)], n=32)  # fills slot 0 to 63
    assert len(long_result.token_ids[0]) == 32 and state.free_slots == (0, 1, 2, 3)
    tokens, logits, _, _ = run_steps(rt, state, [0], [short], 16)
    assert tokens == fresh_tokens
    for a, b in zip(logits[0], fresh_logits[0], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_padding_rows_never_write_other_slots(rt):
    state = neuronfx.init_state(rt)
    g = torch.Generator().manual_seed(0)
    for t in kv_tensors(state):  # distinctive content, so any write shows up
        t.copy_(torch.randn(t.shape, generator=g))
    untouched = {s: slot_kv(state, s) for s in (1, 3)}

    held = random_prompt(9, seed=31)
    ref, _, _, _ = run_steps(rt, neuronfx.init_state(rt), [0], [held], 12)
    first, state = neuronfx.prefill_step(rt, state, PrefillBatch(seq_ids=[2], prompts=[held], sampling=[GREEDY]))
    assert first.tokens[0] == ref[0][0]
    held_kv = slot_kv(state, 2)

    out, state = neuronfx.prefill_step(rt, state, PrefillBatch(seq_ids=[0], prompts=[random_prompt(14, seed=32)], sampling=[GREEDY]))
    _, state = decode_from(rt, state, 0, out.tokens[0], 6)  # decode buckets 16 then 32 (batch bucket 1)
    for s in (1, 3):
        assert_kv_equal(slot_kv(state, s), untouched[s])
    assert_kv_equal(slot_kv(state, 2), held_kv)

    continuation, state = decode_from(rt, state, 2, first.tokens[0], 11)
    assert [first.tokens[0]] + continuation == ref[0]
    for s in (1, 3):
        assert_kv_equal(slot_kv(state, s), untouched[s])


# --- bucket selection -----------------------------------------------------------------------


def test_decode_bucket_is_smallest_holding_cache_len_plus_one(rt):
    _, _, buckets, state = run_steps(rt, neuronfx.init_state(rt), [0], [random_prompt(10, seed=41)], 32)
    assert buckets[0] == 16  # prefill of 10 tokens
    decode = dict(zip(range(10, 41), buckets[1:], strict=True))  # cache_len before the step -> bucket
    assert decode[10] == 16 and decode[15] == 16 and decode[16] == 32
    assert decode[31] == 32 and decode[32] == 64 and decode[40] == 64
    assert decode == {c: 16 if c < 16 else 32 if c < 32 else 64 for c in decode}
    assert state.cache_lens[0] == 41


def test_decode_of_full_slot_raises_and_keeps_state(rt):
    prompt = random_prompt(32, seed=42)
    tokens, _, buckets, state = run_steps(rt, neuronfx.init_state(rt), [0], [prompt], 33)
    assert state.cache_lens[0] == 64 and buckets[-1] == 64
    with pytest.raises(SequenceLengthExceededError):
        neuronfx.decode_step(rt, state, DecodeBatch(seq_ids=[0], input_ids=[tokens[0][-1]], sampling=[GREEDY]))
    state = neuronfx.release(rt, state, [0])  # still usable
    assert state.free_slots == (0, 1, 2, 3)


# --- consumed and mismatched states ---------------------------------------------------------


def uses(rt) -> dict[str, Callable]:
    """Every way to use a state; each would succeed on a fresh state of ``rt`` with slot 0 live."""
    return {
        "prefill_step": lambda s: neuronfx.prefill_step(rt, s, PrefillBatch(seq_ids=[1], prompts=[[1, 2]], sampling=[GREEDY])),
        "decode_step": lambda s: neuronfx.decode_step(rt, s, DecodeBatch(seq_ids=[0], input_ids=[1], sampling=[GREEDY])),
        "generate": lambda s: generate(rt, s, [[1, 2]], n=2),
        "release": lambda s: neuronfx.release(rt, s, [0]),
    }


def live_state(rt, seed: int = 0):
    _, state = neuronfx.prefill_step(rt, neuronfx.init_state(rt, seed), PrefillBatch(seq_ids=[0], prompts=[[5, 6, 7]], sampling=[GREEDY]))
    return state


@pytest.mark.parametrize("consumer", ["prefill_step", "decode_step", "generate", "release"])
def test_consumed_state_raises(rt, consumer):
    old = live_state(rt)
    result = uses(rt)[consumer](old)
    new = result[1] if isinstance(result, tuple) else result
    assert old.consumed and not new.consumed
    for _name, use in uses(rt).items():
        with pytest.raises(StateConsumedError):
            use(old)
    uses(rt)["generate"](new)  # the returned state works


def test_state_of_another_plan_raises(hf, rt):
    for other in (tiny_runtime(hf, batch_size=2), tiny_runtime(hf, sequence_length=48, decode_buckets=(16, 48))):
        foreign = live_state(other)
        for _name, use in uses(rt).items():
            with pytest.raises(StateMismatchError):
                use(foreign)
        assert not foreign.consumed


# --- bad input: named error, raised before any state change ---------------------------------

HELD = random_prompt(7, seed=50)


def P(seq_ids, prompts, sampling=None):
    return PrefillBatch(seq_ids=seq_ids, prompts=prompts, sampling=sampling or [GREEDY] * len(prompts))


def D(seq_ids, input_ids, sampling=None):
    return DecodeBatch(seq_ids=seq_ids, input_ids=input_ids, sampling=sampling or [GREEDY] * len(input_ids))


# Each is rejected: by SamplingParams itself when constructed (inside the call), or by the plan.
BAD_SAMPLING = [
    {"temperature": -1.0}, {"temperature": float("nan")}, {"temperature": float("inf")},
    {"temperature": 1.0, "top_p": 0.0}, {"temperature": 1.0, "top_p": 1.5}, {"temperature": 1.0, "top_k": -2},
    {"temperature": 1.0, "top_k": VOCAB + 1}, {"temperature": 1.0, "top_k": 2.0}, {"min_p": 1.5},
    {"repetition_penalty": 0.0}, {"presence_penalty": 3.0}, {"frequency_penalty": float("nan")}, {"seed": -1},
    {"min_tokens": -1}, {"max_tokens": 0}, {"min_tokens": 5, "max_tokens": 2}, {"stop_token_ids": (VOCAB,)},
    {"logprobs": 21}, {"logprobs": -1}, {"ignore_eos": 1},
]


# (error, call(rt, state)); state has slot 0 live holding HELD (+ its first token).
BAD_INPUTS = {
    "generate-prompt-too-long": (PromptTooLongError, lambda rt, s: generate(rt, s, [random_prompt(33, 1)], n=1)),
    "prefill-prompt-too-long": (PromptTooLongError, lambda rt, s: neuronfx.prefill_step(rt, s, P([1], [random_prompt(33, 1)]))),
    "sequence-length": (SequenceLengthExceededError, lambda rt, s: generate(rt, s, [random_prompt(30, 1)], n=35)),
    "sequence-length-one-over": (SequenceLengthExceededError, lambda rt, s: generate(rt, s, [[1] * 32], n=33)),
    "generate-stop-string-without-tokenizer": (InputError, lambda rt, s: generate(rt, s, [[1]], sampling=SamplingParams(stop="x"))),
    "generate-no-prompts": (InputError, lambda rt, s: generate(rt, s, [])),
    "prefill-5-rows": (BatchTooLargeError, lambda rt, s: neuronfx.prefill_step(rt, s, P([1, 2, 3, 4, 5], [[1]] * 5))),
    "decode-5-rows": (BatchTooLargeError, lambda rt, s: neuronfx.decode_step(rt, s, D([0, 1, 2, 3, 4], [1] * 5))),
    "generate-empty-prompt": (EmptyPromptError, lambda rt, s: generate(rt, s, [[1, 2], []])),
    "prefill-empty-prompt": (EmptyPromptError, lambda rt, s: neuronfx.prefill_step(rt, s, P([1], [[]]))),
    "token-vocab-size": (TokenOutOfVocabError, lambda rt, s: generate(rt, s, [[1, VOCAB]])),
    "token-negative": (TokenOutOfVocabError, lambda rt, s: generate(rt, s, torch.tensor([[-1, 3]]))),
    "prefill-token-vocab-size": (TokenOutOfVocabError, lambda rt, s: neuronfx.prefill_step(rt, s, P([1], [[VOCAB]]))),
    "decode-token-vocab-size": (TokenOutOfVocabError, lambda rt, s: neuronfx.decode_step(rt, s, D([0], [VOCAB]))),
    "decode-token-negative": (TokenOutOfVocabError, lambda rt, s: neuronfx.decode_step(rt, s, D([0], [-1]))),
    "float-ids": (InputError, lambda rt, s: generate(rt, s, torch.tensor([[1.0, 2.0]]))),
    "3d-ids": (InputError, lambda rt, s: generate(rt, s, torch.ones(1, 1, 2, dtype=torch.long))),
    "max-new-tokens-0": (InputError, lambda rt, s: generate(rt, s, [[1, 2]], n=0)),
    "sampling-count": (InputError, lambda rt, s: generate(rt, s, [[1], [2]], sampling=[GREEDY] * 3)),
    "prefill-live-slot": (SlotError, lambda rt, s: neuronfx.prefill_step(rt, s, P([0], [[1, 2]]))),
    "prefill-scratch-slot": (SlotError, lambda rt, s: neuronfx.prefill_step(rt, s, P([4], [[1, 2]]))),
    "prefill-negative-slot": (SlotError, lambda rt, s: neuronfx.prefill_step(rt, s, P([-1], [[1, 2]]))),
    "prefill-duplicate-slots": (SlotError, lambda rt, s: neuronfx.prefill_step(rt, s, P([1, 1], [[1], [2]]))),
    "decode-free-slot": (SlotError, lambda rt, s: neuronfx.decode_step(rt, s, D([1], [1]))),
    "decode-duplicate-slots": (SlotError, lambda rt, s: neuronfx.decode_step(rt, s, D([0, 0], [1, 1]))),
    "release-free-slot": (SlotError, lambda rt, s: neuronfx.release(rt, s, [1])),
    "release-duplicate": (SlotError, lambda rt, s: neuronfx.release(rt, s, [0, 0])),
    **{
        f"generate-sampling-{i}": (SamplingParamsError, lambda rt, s, f=f: generate(rt, s, [[1, 2]], sampling=SamplingParams(**f)))
        for i, f in enumerate(BAD_SAMPLING)
    },
    "prefill-sampling": (SamplingParamsError,
                         lambda rt, s: neuronfx.prefill_step(rt, s, P([1], [[1]], [SamplingParams(**BAD_SAMPLING[0])]))),
    "prefill-sampling-over-plan": (SamplingParamsError,
                                   lambda rt, s: neuronfx.prefill_step(rt, s, P([1], [[1]], [SamplingParams(**BAD_SAMPLING[6])]))),
    "decode-sampling": (SamplingParamsError,
                        lambda rt, s: neuronfx.decode_step(rt, s, D([0], [1], [SamplingParams(**BAD_SAMPLING[4])]))),
    "decode-sampling-over-plan": (SamplingParamsError,
                                  lambda rt, s: neuronfx.decode_step(rt, s, D([0], [1], [SamplingParams(**BAD_SAMPLING[17])]))),
    "decode-sampling-second-row": (
        SamplingParamsError,
        lambda rt, s: generate(rt, s, [[1], [2]], sampling=[GREEDY, SamplingParams(**BAD_SAMPLING[1])]),
    ),
}


@pytest.fixture(scope="module")
def held_reference(rt):
    tokens, _, _, _ = run_steps(rt, neuronfx.init_state(rt), [0], [HELD], 6)
    return tokens[0]


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_raises_before_any_state_change(rt, held_reference, case):
    error, call = BAD_INPUTS[case]
    first, state = neuronfx.prefill_step(rt, neuronfx.init_state(rt, seed=3), P([0], [HELD]))
    assert first.tokens[0] == held_reference[0]
    before = ([t.clone() for t in kv_tensors(state)], state.cache_lens, state.live, state.rng_key, state.generated,
              state.output_counts.clone(), state.prompt_mask.clone())

    with pytest.raises(error) as info:
        call(rt, state)
    assert type(info.value) is error, f"expected exactly {error.__name__}, got {type(info.value).__name__}: {info.value}"

    assert not state.consumed
    assert (state.cache_lens, state.live, state.rng_key, state.generated) == before[1:5]
    assert torch.equal(state.output_counts, before[5]) and torch.equal(state.prompt_mask, before[6])
    assert_kv_equal(kv_tensors(state), before[0])
    continuation, _ = decode_from(rt, state, 0, first.tokens[0], 5)
    assert [first.tokens[0]] + continuation == held_reference


def test_unknown_config_key_is_config_error():
    good = {"batch_size": 4, "max_context_length": 32, "sequence_length": 64}
    assert structure(good, InferenceConfig) == InferenceConfig(**good)
    with pytest.raises(ConfigError, match="bogus"):
        structure({**good, "bogus": 1}, InferenceConfig)


# --- seeded sampling ------------------------------------------------------------------------

PROMPTS = [random_prompt(5, seed=60), random_prompt(11, seed=61)]


def test_same_seed_same_tokens_different_seed_different_tokens(rt):
    warm = SamplingParams(temperature=1.0)
    runs = {seed: generate(rt, neuronfx.init_state(rt, seed), PROMPTS, sampling=warm)[0].token_ids for seed in (0, 1)}
    again, _ = generate(rt, neuronfx.init_state(rt, 0), PROMPTS, sampling=warm)
    assert again.token_ids == runs[0]
    assert runs[0] != runs[1]
    greedy, _ = generate(rt, neuronfx.init_state(rt, 0), PROMPTS)
    assert runs[0] != greedy.token_ids  # temperature 1 on a near-flat tiny model is not argmax


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.3, top_k=1, top_p=0.5),
    SamplingParams(temperature=1.0, top_p=1e-6),  # top_p keeps only the top token
])
def test_sampling_that_keeps_one_token_equals_greedy(rt, params):
    greedy, _ = generate(rt, neuronfx.init_state(rt, 0), PROMPTS)
    for seed in (0, 7):
        sampled, _ = generate(rt, neuronfx.init_state(rt, seed), PROMPTS, sampling=params)
        assert sampled.token_ids == greedy.token_ids


def test_per_row_sampling_params(rt):
    greedy, _ = generate(rt, neuronfx.init_state(rt, 0), PROMPTS)
    mixed, _ = generate(rt, neuronfx.init_state(rt, 0), PROMPTS, sampling=[GREEDY, SamplingParams(temperature=1.0)])
    assert mixed.token_ids[0] == greedy.token_ids[0]
    assert mixed.token_ids[1] != greedy.token_ids[1]


# --- eos and max_new_tokens -----------------------------------------------------------------


def test_eos_stops_right_after_it(rt):
    for seed in range(70, 90):  # a prompt whose 3rd greedy token is new
        prompt = random_prompt(6, seed=seed)
        full, _ = generate(rt, neuronfx.init_state(rt), [prompt])
        g = list(full.token_ids[0])
        if g[2] not in g[:2]:
            break
    else:
        pytest.fail("no prompt with a fresh 3rd greedy token")
    assert full.finish_reasons == ("length",) and len(g) == 16

    result, state = generate(rt, neuronfx.init_state(rt), [prompt], eos_token_ids={g[2]})
    assert list(result.token_ids[0]) == g[:3]
    assert result.finish_reasons == ("stop",)
    assert state.free_slots == (0, 1, 2, 3)

    first, _ = generate(rt, neuronfx.init_state(rt), [prompt], eos_token_ids=[g[0]])
    assert first.token_ids == ((g[0],),) and first.finish_reasons == ("stop",)

    other = random_prompt(9, seed=99)
    alone, _ = generate(rt, neuronfx.init_state(rt), [other], n=10)
    assert g[2] not in alone.token_ids[0]
    both, _ = generate(rt, neuronfx.init_state(rt), [prompt, other], n=10, eos_token_ids=[g[2]])
    assert both.token_ids == (tuple(g[:3]), alone.token_ids[0])  # rows finish independently
    assert both.finish_reasons == ("stop", "length")


@pytest.mark.parametrize("n", [1, 2, 7])
def test_max_new_tokens_is_exact(rt, n):
    result, state = generate(rt, neuronfx.init_state(rt), PROMPTS, n=n)
    assert [len(t) for t in result.token_ids] == [n, n]
    assert result.finish_reasons == ("length", "length")
    assert result.num_generated == 2 * n
    assert state.free_slots == (0, 1, 2, 3)
