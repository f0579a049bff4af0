"""The reference scheduler and the step API under continuous batching, on a tiny llama (eager).

Greedy references come from transformers' ``generate`` on the same weights, one request alone.
"""

from __future__ import annotations

import pytest
import torch
from helpers import GREEDY, VOCAB, hf_greedy, kv_tensors, random_prompt, tiny_hf_model, tiny_runtime
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import neuronfx
from neuronfx import DecodeBatch, PrefillBatch, SamplingParams
from neuronfx.runtime.scheduler import Queue, Request, step, submit


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=7)


@pytest.fixture(scope="module")
def rt(hf):
    return tiny_runtime(hf)  # batch_size 4: batch buckets (1, 2, 4)


NO_EOS: list[int] = []  # the tiny model's config says eos 2; these tests stop by other rules


def reference(hf, prompt: list[int], max_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
    """transformers greedy alone, cut after the first stop id (which is kept, as in vLLM)."""
    tokens = hf_greedy(hf, prompt, max_tokens)
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


# --- continuous batching: random arrivals, stops and slot reuse --------------------------------


class SchedulerMachine(RuleBasedStateMachine):
    """Requests arrive between scheduler iterations; some stop on a stop token. Free slots and
    the scratch slot are refilled with NaN at random times. Every finished request must equal
    transformers' greedy output for it alone."""

    hf_model = None
    runtime = None

    @initialize()
    def start(self):
        self.state = neuronfx.init_state(self.runtime)
        self.queue = Queue()
        self.requests: list[Request] = []
        self.tokens: dict[int, list[int]] = {}
        self.finished: set[int] = set()

    @rule(length=st.integers(1, 20), max_tokens=st.integers(1, 12), seed=st.integers(0, 10**6), use_stop=st.booleans())
    def arrive(self, length, max_tokens, seed, use_stop):
        prompt = random_prompt(length, seed)
        # A stop id taken from the request's own greedy output makes it stop early for real.
        stop = ()
        if use_stop:
            stop = (reference(self.hf_model, prompt, max_tokens)[max_tokens // 2],)
        req = Request(prompt=tuple(prompt), sampling=SamplingParams(stop_token_ids=stop, max_tokens=max_tokens))
        self.queue = submit(self.queue, len(self.requests), req)
        self.requests.append(req)

    @rule()
    def iterate(self):
        if self.queue.idle:
            return
        events, self.state, self.queue = step(self.runtime, self.state, self.queue, frozenset())
        for ev in events:
            self.tokens.setdefault(ev.index, []).append(ev.token_id)
            if ev.finish_reason is not None:
                self.finished.add(ev.index)

    @rule()
    def poison_free_slots(self):
        free = list(self.state.free_slots) + [self.runtime.plan.kv.scratch_slot]
        for t in kv_tensors(self.state):
            t[free] = float("nan")

    @invariant()
    def finished_requests_match_alone(self):
        for i in self.finished:
            req = self.requests[i]
            want = reference(self.hf_model, list(req.prompt), req.sampling.max_tokens, req.sampling.stop_token_ids)
            assert self.tokens[i] == want, f"request {i}"

    @invariant()
    def live_slots_are_running_requests(self):
        assert sorted(r.slot for r in self.queue.running) == [s for s, on in enumerate(self.state.live) if on]

    def teardown(self):
        while not self.queue.idle:
            self.iterate()
        self.finished_requests_match_alone()
        assert len(self.finished) == len(self.requests)


def test_scheduler_state_machine(hf, rt):
    SchedulerMachine.hf_model, SchedulerMachine.runtime = hf, rt
    run = SchedulerMachine.TestCase
    run.settings = settings(max_examples=12, stateful_step_count=25, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])
    run().runTest()


def test_generate_more_prompts_than_slots(hf, rt):
    prompts = [random_prompt(n, seed=n) for n in (5, 17, 3, 12, 7, 9, 1)]
    result, state = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=7, eos_token_ids=NO_EOS)
    assert [list(t) for t in result.token_ids] == [hf_greedy(hf, p, 7) for p in prompts]
    assert result.finish_reasons == ("length",) * 7
    assert state.free_slots == (0, 1, 2, 3)


# --- batch buckets -----------------------------------------------------------------------------


def test_decode_runs_in_smallest_batch_bucket_and_pads_to_scratch_only(hf, rt):
    state = neuronfx.init_state(rt)
    g = torch.Generator().manual_seed(0)
    for t in kv_tensors(state):
        t.copy_(torch.randn(t.shape, generator=g))
    free_before = [t[1].clone() for t in kv_tensors(state)]
    prompts = {0: random_prompt(6, 1), 2: random_prompt(9, 2), 3: random_prompt(4, 3)}
    out, state = neuronfx.prefill_step(rt, state, PrefillBatch(seq_ids=list(prompts), prompts=list(prompts.values()), sampling=[GREEDY] * 3))
    assert out.batch_size == 4  # 3 rows -> batch bucket 4
    tokens = {s: [t] for s, t in zip(prompts, out.tokens)}
    for n_rows, slots in ((3, [0, 2, 3]), (2, [2, 3]), (1, [3])):
        batch = DecodeBatch(seq_ids=slots, input_ids=[tokens[s][-1] for s in slots], sampling=[GREEDY] * n_rows)
        out, state = neuronfx.decode_step(rt, state, batch)
        assert out.batch_size == {3: 4, 2: 2, 1: 1}[n_rows]
        for s, t in zip(slots, out.tokens):
            tokens[s].append(t)
    for before, t in zip(free_before, kv_tensors(state)):
        assert torch.equal(t[1], before)  # the free slot was never written
    for s, p in prompts.items():
        assert tokens[s] == hf_greedy(hf, p, len(tokens[s]))


# --- seeded sampling ---------------------------------------------------------------------------


def test_seeded_request_is_independent_of_batch_and_slot(rt):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=10)
    prompt = random_prompt(8, seed=9)
    alone, _ = neuronfx.generate(rt, neuronfx.init_state(rt, seed=0), [prompt], sampling=seeded, eos_token_ids=NO_EOS)
    others = [random_prompt(n, seed=100 + n) for n in (3, 11, 5)]
    mixed = [SamplingParams(temperature=0.8), SamplingParams(), SamplingParams(temperature=1.3, top_p=0.9)]
    # The seeded request lands in slot 3 after three others, with a different state seed.
    together, _ = neuronfx.generate(rt, neuronfx.init_state(rt, seed=99), others + [prompt], sampling=mixed + [seeded], max_new_tokens=10, eos_token_ids=NO_EOS)
    assert together.token_ids[3] == alone.token_ids[0]
    other_seed, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [prompt], sampling=SamplingParams(temperature=1.0, seed=1235, max_tokens=10), eos_token_ids=NO_EOS)
    assert other_seed.token_ids[0] != alone.token_ids[0]  # the seed matters (10 draws at T=1 over 256 tokens)


# --- vLLM request semantics --------------------------------------------------------------------


def test_repetition_penalty_matches_transformers(hf, rt):
    prompt = random_prompt(10, seed=4)
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [prompt], max_new_tokens=12,
                                  sampling=SamplingParams(repetition_penalty=1.8), eos_token_ids=NO_EOS)
    ids = torch.tensor([prompt])
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                       repetition_penalty=1.8, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert list(result.token_ids[0]) == want
    assert want != hf_greedy(hf, prompt, 12)  # the penalty changed something


@torch.no_grad()
def test_presence_and_frequency_penalties_follow_vllm_formula(hf, rt):
    prompt, pres, freq = random_prompt(6, seed=8), 0.7, 0.4
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [prompt], max_new_tokens=10,
                                  sampling=SamplingParams(presence_penalty=pres, frequency_penalty=freq), eos_token_ids=NO_EOS)
    ids, want = list(prompt), []
    for _ in range(10):  # vLLM: logit -= freq * count_in_output + pres * (count > 0)
        logits = hf(torch.tensor([ids])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(want, dtype=torch.long), minlength=VOCAB).float()
        t = int((logits - freq * counts - pres * (counts > 0).float()).argmax())
        want.append(t)
        ids.append(t)
    assert list(result.token_ids[0]) == want
    assert want != hf_greedy(hf, prompt, 10)


def test_min_tokens_holds_back_eos_then_stops(hf, rt):
    prompt = random_prompt(7, seed=12)
    greedy = hf_greedy(hf, prompt, 8)
    eos = greedy[0]  # greedy would stop right away
    quick, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [prompt], max_new_tokens=8, eos_token_ids=[eos])
    assert quick.token_ids[0] == (eos,) and quick.finish_reasons == ("stop",)
    held, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [prompt], max_new_tokens=8, eos_token_ids=[eos],
                                sampling=SamplingParams(min_tokens=3))
    assert eos not in held.token_ids[0][:3]
    assert len(held.token_ids[0]) >= 3


def test_ignore_eos_and_stop_token_ids(hf, rt):
    prompt = random_prompt(7, seed=12)
    greedy = hf_greedy(hf, prompt, 8)
    plain, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [prompt], max_new_tokens=8,
                                 sampling=SamplingParams(ignore_eos=True, stop_token_ids=(greedy[4],)), eos_token_ids=NO_EOS)
    first = greedy.index(greedy[4])
    assert list(plain.token_ids[0]) == greedy[: first + 1]
    assert plain.finish_reasons == ("stop",) and plain.stop_reasons == (greedy[4],)


@torch.no_grad()
def test_logprobs_are_raw_model_logprobs(hf, rt):
    prompt = random_prompt(5, seed=21)
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [prompt], max_new_tokens=4,
                                  sampling=SamplingParams(logprobs=3, repetition_penalty=1.5), eos_token_ids=NO_EOS)
    ids = list(prompt)
    for lp in result.logprobs[0]:
        raw = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
        top = raw.topk(3)
        assert lp.top_ids == tuple(top.indices.tolist())
        assert torch.allclose(torch.tensor(lp.top_logprobs), top.values, atol=1e-4)
        assert abs(lp.logprob - raw[lp.token_id].item()) < 1e-4
        ids.append(lp.token_id)
    assert [lp.token_id for lp in result.logprobs[0]] == list(result.token_ids[0])


# --- text, stop strings, streaming -------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    """Word-level tokenizer over the tiny vocab: token i is the word "w{i}"; decode joins with spaces."""
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_stop_string_cut_from_text_and_streamed_text_matches(hf, rt, tokenizer):
    prompt = random_prompt(9, seed=33)
    greedy = hf_greedy(hf, prompt, 10)
    words = [f"w{t}" for t in greedy]
    stop = f"{words[3]} {words[4]}"  # spans two tokens
    sp = SamplingParams(stop=stop, max_tokens=10)
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [prompt], sampling=sp, tokenizer=tokenizer, eos_token_ids=NO_EOS)
    cut = " ".join(words).index(stop)
    assert result.texts[0] == " ".join(words)[:cut]
    assert result.finish_reasons == ("stop",) and result.stop_reasons == (stop,)
    assert list(result.token_ids[0]) == greedy[:5]

    events = list(neuronfx.stream_generate(rt, neuronfx.init_state(rt), [prompt], sampling=sp, tokenizer=tokenizer, eos_token_ids=NO_EOS))
    assert isinstance(events[-1], neuronfx.Finished) and events[-1].state.free_slots == (0, 1, 2, 3)
    tokens = [e for e in events if isinstance(e, neuronfx.TokenEvent)]
    assert "".join(e.text for e in tokens) == result.texts[0]
    assert [e.token_id for e in tokens] == greedy[:5]
    assert [e.finish_reason for e in tokens] == [None] * 4 + ["stop"]

    kept, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [prompt], tokenizer=tokenizer,
                                sampling=SamplingParams(stop=stop, max_tokens=10, include_stop_str_in_output=True), eos_token_ids=NO_EOS)
    assert kept.texts[0] == " ".join(words)[: cut + len(stop)]
