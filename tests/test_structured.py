"""Structured outputs: the in-graph token bitmask, the llguidance matcher behind
``runtime/structured.py``, and constrained requests through generate, the step API, speculation
and overlapped decode, on tiny random llamas with a byte-level tokenizer (eager unless stated)."""

from __future__ import annotations

import pytest
import torch
from helpers import byte_tokenizer, tiny_hf_model, tiny_runtime
from hypothesis import example, given
from hypothesis import strategies as st

import neuronfx
from neuronfx import DecodeBatch, PrefillBatch, Request, SamplingParams, StructuredOutputs
from neuronfx.config.inputs import SamplerInputs
from neuronfx.config.sampling import pack_sampling
from neuronfx.errors import InputError, SamplingParamsError
from neuronfx.graphs.phases.sampling import distribution, sample, unpack_bitmask
from neuronfx.runtime.scheduler import Queue, submit
from neuronfx.runtime.structured import Grammars, token_bitmask

CHOICE = StructuredOutputs(choice=["yes", "no", "maybe"])
REGEX = StructuredOutputs(regex=r"[a-c]{2}-[0-9]{3}")
SCHEMA = StructuredOutputs(json={"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"enum": ["x", "y"]}},
                                 "required": ["n", "tag"], "additionalProperties": False})
PROMPTS = [[5, 6, 7], [9, 4], [11, 12, 13, 14], [3]]


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=3)


@pytest.fixture(scope="module")
def rt(hf):
    return tiny_runtime(hf)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def grammars(rt, tok):
    return Grammars.for_runtime(rt, tok)


def allowed(bitmask_row: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask_row[token // 32]) >> (token % 32)) & 1)


# --- the bitmask -------------------------------------------------------------------------------------


@given(st.integers(1, 4), st.integers(1, 100), st.randoms(use_true_random=False))
@example(1, 32, None)
@example(2, 33, None)
def test_unpack_bitmask_equals_a_naive_reference(rows, vocab, rnd):
    words = -(-vocab // 32)
    values = [[(rnd.getrandbits(32) if rnd else 0x80000001) for _ in range(words)] for _ in range(rows)]
    bitmask = torch.tensor([[v - 2**32 if v >= 2**31 else v for v in row] for row in values], dtype=torch.int32)
    naive = torch.tensor([[bool((row[t // 32] >> (t % 32)) & 1) for t in range(vocab)] for row in values])
    assert torch.equal(unpack_bitmask(bitmask, vocab), naive)


def test_the_mask_comes_before_bias_penalties_and_logprobs():
    """Only tokens 3, 17 and 38 of 40 are allowed: a +100 bias or a repetition penalty on other
    tokens changes nothing, greedy and sampled rows pick allowed tokens, raw logprobs are
    renormalised over them (-inf elsewhere) and ``distribution`` is zero elsewhere."""
    g = torch.Generator().manual_seed(0)
    b, v, width = 4, 40, 16
    logits = torch.randn(b, v, generator=g) * 3
    allowed_ids = [3, 17, 38]
    words = torch.zeros(b, 2, dtype=torch.int64)
    for t in allowed_ids:
        words[:, t // 32] |= 1 << (t % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    sps = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=2.0, top_k=2, top_p=0.9),
           SamplingParams(temperature=0.5, min_p=0.2, repetition_penalty=2.0)]
    bias = torch.zeros(b, v)
    bias[:, 0] = 100.0
    sampler = SamplerInputs(torch.tensor(pack_sampling(sps, width)), torch.zeros(b, v, dtype=torch.int32),
                            torch.ones(b, v, dtype=torch.bool), bias, torch.rand(b, generator=g), bitmask)
    out = sample(logits, sampler, width, 5)
    assert set(out["tokens"].tolist()) <= set(allowed_ids)
    want = torch.log_softmax(logits[:, allowed_ids], -1)
    torch.testing.assert_close(out["top_logprobs"][:, :3].sort(-1).values, want.sort(-1).values)
    assert torch.isinf(out["top_logprobs"][:, 3:]).all()
    probs = distribution(logits, sampler, width)
    assert probs[:, [t for t in range(v) if t not in allowed_ids]].abs().max() == 0
    torch.testing.assert_close(probs.sum(-1), torch.ones(b))


def test_token_bitmask_rows(rt, grammars):
    m = grammars.matcher(CHOICE)
    sp = SamplingParams()
    mask = token_bitmask((None, m), [sp, sp], [0, 0], rt.plan.model.eos_token_ids, rt.plan.model.vocab_size)
    assert mask.shape == (2, 8) and mask.dtype == torch.int32
    assert (mask[0] == -1).all()  # an unconstrained row allows everything
    assert [t for t in range(256) if allowed(mask[1], t)] == [ord("m"), ord("n"), ord("y")]
    assert token_bitmask(None, [sp], [0], (2,), 256) is None


# --- greedy against a host-side reference --------------------------------------------------------------


def host_reference(hf, grammars, prompt, structured, n):
    """transformers' logits in float64, masked by the same kind of matcher, argmax, step by step."""
    m, ids, out = grammars.matcher(structured), list(prompt), []
    mask = torch.zeros(1, 8, dtype=torch.int32)
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        m.fill(mask, 0)
        logits = logits.masked_fill(~unpack_bitmask(mask, 256)[0], float("-inf"))
        t = int(logits.argmax())
        out.append(t)
        ids.append(t)
        assert m.consume([t])
        if m.is_stopped():
            break
    return out


@pytest.mark.parametrize("structured", [CHOICE, REGEX], ids=["choice", "regex"])
def test_greedy_constrained_row_equals_host_reference(hf, rt, tok, grammars, structured):
    res, _ = neuronfx.generate(rt, neuronfx.init_state(rt), PROMPTS[:2], max_new_tokens=12,
                               sampling=SamplingParams(structured=structured), tokenizer=tok)
    for prompt, tokens in zip(PROMPTS[:2], res.token_ids):
        assert list(tokens) == host_reference(hf, grammars, prompt, structured, 12)
    assert res.finish_reasons == ("stop", "stop")  # ends as soon as the grammar is complete, not at max tokens
    if structured is REGEX:
        assert all(len(t) == 6 and t[2] == "-" for t in res.texts)
    else:
        assert set(res.texts) <= {"yes", "no", "maybe"}


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(rt, tok):
    plain = [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.8, seed=11)]
    alone, _ = neuronfx.generate(rt, neuronfx.init_state(rt), PROMPTS[:2], max_new_tokens=10, sampling=plain, tokenizer=tok)
    mixed = [SamplingParams(structured=REGEX), plain[0], SamplingParams(structured=SCHEMA, temperature=0.7, seed=3), plain[1]]
    res, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[1]],
                               max_new_tokens=10, sampling=mixed, tokenizer=tok)
    assert (res.token_ids[1], res.token_ids[3]) == alone.token_ids


# --- seeded sampling never leaves the mask ---------------------------------------------------------


def test_sampled_tokens_always_obey_the_mask(rt, tok, grammars):
    """1,000+ seeded decode steps with top-k, top-p, min-p and penalties through the step API:
    each sampled token is checked against its matcher's mask at that step."""
    structured = StructuredOutputs(regex=r"(([a-f][0-9])|(x[yz]+ ))+")
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=mp, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.3, seed=s)
              for t, k, p, mp, s in [(1.5, 20, 0.9, 0.05, 1), (1.0, 256, 1.0, 0.0, 2), (2.0, 5, 0.5, 0.1, 3), (0.7, 50, 0.95, 0.02, 4)]]
    steps, distinct = 0, set()
    state = neuronfx.init_state(rt)
    for round_ in range(5):
        matchers = [grammars.matcher(structured) for _ in params]
        mask = torch.zeros(len(params), 8, dtype=torch.int32)
        batch = PrefillBatch(seq_ids=[0, 1, 2, 3], prompts=[p + [round_ + 20] for p in PROMPTS], sampling=params,
                             constraints=matchers)
        out, state = neuronfx.prefill_step(rt, state, batch)
        for _ in range(50):
            for r, m in enumerate(matchers):
                m.fill(mask, r)
            for r, (m, t) in enumerate(zip(matchers, out.tokens)):
                assert allowed(mask[r], t), (round_, r, t)
                assert m.consume([t])
                if m.is_stopped():  # the grammar was complete and eos came: start it again (the mask test goes on)
                    matchers[r] = grammars.matcher(structured)
                distinct.add(t)
            steps += len(matchers)
            out, state = neuronfx.decode_step(rt, state, DecodeBatch(seq_ids=[0, 1, 2, 3], input_ids=out.tokens, sampling=params,
                                                                     constraints=matchers))
        state = neuronfx.release(rt, state, [0, 1, 2, 3])
    assert steps >= 1000 and len(distinct) >= 12  # many different tokens were drawn, all inside the mask


# --- speculation, overlapped decode, the scheduler ------------------------------------------------


@pytest.mark.parametrize("draft", ["self", "draft-model", "ngram", "fused-draft-model"])
def test_speculation_yields_the_greedy_tokens_of_plain_decoding(hf, rt, tok, draft):
    """Constrained and free rows speculate to plain decoding's tokens; on a fused runtime
    (``fused_speculation``) the batch with grammar rows runs unfused."""
    sampling = [SamplingParams(structured=s) for s in (CHOICE, REGEX, SCHEMA)] + [SamplingParams()]
    plain, _ = neuronfx.generate(rt, neuronfx.init_state(rt), PROMPTS, max_new_tokens=24, sampling=sampling, tokenizer=tok)
    if draft == "self":
        spec_rt = tiny_runtime(hf, speculation_length=3, draft_layers=1)
    elif draft == "ngram":  # prompt lookup: drafts cut where the grammar refuses them, filler the mask allows
        spec_rt = tiny_runtime(hf, speculation_length=4, speculative_method="ngram")
    else:
        fused = draft == "fused-draft-model"
        spec_rt = neuronfx.with_draft(tiny_runtime(hf, speculation_length=4, fused_speculation=fused),
                                      tiny_runtime(tiny_hf_model("llama", seed=8)))
    spec, _ = neuronfx.generate(spec_rt, neuronfx.init_state(spec_rt), PROMPTS, max_new_tokens=24, sampling=sampling, tokenizer=tok)
    assert spec.token_ids == plain.token_ids and spec.finish_reasons == plain.finish_reasons
    assert sum(s.accepted for s in spec.speculation) > 0  # drafts were accepted, under the masks
    overlapped, _ = neuronfx.generate(spec_rt, neuronfx.init_state(spec_rt), PROMPTS, max_new_tokens=24, sampling=sampling,
                                      tokenizer=tok, async_decode=True)
    assert overlapped.token_ids == plain.token_ids


def test_scheduler_submit_checks_the_grammar_first(rt, grammars):
    queue = Queue(grammars=grammars)
    bad = Request(prompt=(1, 2), sampling=SamplingParams(structured=StructuredOutputs(regex="((")))
    with pytest.raises(SamplingParamsError, match=r"StructuredOutputs.regex='\(\(' is rejected by llguidance"):
        submit(queue, 0, bad, rt)
    with pytest.raises(InputError, match="tokenizer="):
        submit(Queue(), 0, bad, rt)
    good = submit(queue, 0, Request(prompt=(1, 2), sampling=SamplingParams(structured=CHOICE)), rt)
    assert len(good.waiting) == 1 and good.grammars is grammars


def test_model_eos_is_allowed_when_the_grammar_is_complete(rt, tok):
    """The tokenizer's eos is <eos> (id 0), the model's is id 2: a complete grammar allows both."""
    g = Grammars.for_runtime(rt, tok)
    m = g.matcher(StructuredOutputs(regex="a+"))
    mask = torch.zeros(1, 8, dtype=torch.int32)
    m.fill(mask, 0)
    assert not allowed(mask[0], 2) and not allowed(mask[0], 0)
    assert m.consume([ord("a")])
    m.fill(mask, 0)
    assert rt.plan.model.eos_token_ids == (2,)
    assert [t for t in range(256) if allowed(mask[0], t)] == [0, 2, ord("a")]
    # After "a" only the eos ids are left; min_tokens holding back both is a named error, never a NaN.
    only_eos = g.matcher(StructuredOutputs(regex="a"))
    assert only_eos.consume([ord("a")]) and only_eos.is_stopped()
    held = SamplingParams(min_tokens=3, stop_token_ids=[0])
    with pytest.raises(SamplingParamsError, match="row 0: .* min_tokens=3 holds back its stop tokens"):
        token_bitmask((only_eos,), [held], [1], (2,), 256)
    assert token_bitmask((only_eos,), [SamplingParams(min_tokens=3)], [1], (2,), 256) is not None  # <eos> (0) is still allowed



def test_a_tokenizer_llguidance_cannot_read_fails_only_structured_requests(rt):
    """Grammars are cheap to make (a server makes them for any tokenizer); a word-level
    tokenizer without a decoder fails at the first structured request, with an InputError."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    grammars = Grammars.for_runtime(rt, PreTrainedTokenizerFast(tokenizer_object=words))
    with pytest.raises(InputError, match="cannot drive structured outputs .* fast transformers tokenizer"):
        grammars.check(CHOICE)


def test_host_sampler_applies_the_same_mask(hf, rt, tok):
    """Without on-device sampling the graph returns logits and the same sampler runs on the
    host (``pipeline.sampled``), bitmask included: the same constrained tokens."""
    host = tiny_runtime(hf, on_device_sampling=False)
    sampling = [SamplingParams(structured=REGEX), SamplingParams(structured=SCHEMA, temperature=0.8, seed=5)]
    want, _ = neuronfx.generate(rt, neuronfx.init_state(rt), PROMPTS[:2], max_new_tokens=16, sampling=sampling, tokenizer=tok)
    got, _ = neuronfx.generate(host, neuronfx.init_state(host), PROMPTS[:2], max_new_tokens=16, sampling=sampling, tokenizer=tok)
    assert got.token_ids == want.token_ids and got.texts[0][2] == "-" and got.texts[1].startswith('{"')


def test_a_complete_grammar_ends_the_request_under_min_tokens(rt, tok):
    """regex "a" is complete after one token while min_tokens=3 still holds eos back: the
    scheduler ends the request at the grammar's end ("stop"), neither raising nor running a step
    whose row allows nothing; the unconstrained row beside it runs to its budget."""
    done = SamplingParams(structured=StructuredOutputs(regex="a"), min_tokens=3, max_tokens=6)
    free = SamplingParams(max_tokens=6, ignore_eos=True)
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), PROMPTS[:2], sampling=[done, free], tokenizer=tok)
    assert list(result.token_ids[0]) == [ord("a")] and result.finish_reasons == ("stop", "length")
    assert len(result.token_ids[1]) == 6
