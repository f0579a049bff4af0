"""Fused speculation (``InferenceConfig.fused_speculation``, ``runtime/fused.py``) on tiny models:
the same tokens, logprobs and states as unfused speculation for greedy and sampled rows with every
SamplingParams option (same uniforms), transformers' greedy tokens, the acceptance in tensors
against the target distribution (chi-square), and the default (inductor) backend. Rows with a
grammar speculate unfused on a fused runtime: tests/test_structured.py."""

from __future__ import annotations

import attrs
import pytest
import torch
from helpers import GREEDY, VOCAB, hf_greedy, random_prompt, tiny_hf_model, tiny_runtime
from test_sampling import reference_probs
from test_speculate import ALPHA, INDUCTOR_ONE_ROW, chi_square_p_value

import neuronfx
from neuronfx import SamplingParams
from neuronfx.config.inputs import FusedSpeculateInputs
from neuronfx.config.plan import bitmask_words
from neuronfx.config.sampling import pack_sampling
from neuronfx.errors import ConfigError
from neuronfx.graphs.phases.sampling import distribution
from neuronfx.graphs.phases.speculation import accept_rows, position_sampler, stack_positions
from neuronfx.runtime import speculate
from neuronfx.runtime.fused import fused_step

NO_EOS: list[int] = []


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=3)


@pytest.fixture(scope="module")
def unrelated():
    # An unrelated random model: it almost never agrees, which exercises every rejection path.
    return tiny_runtime(tiny_hf_model("llama", seed=99), "eager", output_logits=True)


def pair(hf, kind: str, unrelated, k: int = 4) -> tuple[neuronfx.Runtime, neuronfx.Runtime]:
    """(unfused, fused) runtimes of ``kind``: "self" (first layer drafts), "draft-model" (an
    unrelated model drafts: rejections) or "same-model" (the target drafts: every draft kept)."""
    extra = {"draft_layers": 1} if kind == "self" else {}
    plain = tiny_runtime(hf, "eager", speculation_length=k, **extra)
    fused = tiny_runtime(hf, "eager", speculation_length=k, fused_speculation=True, **extra)
    if kind == "self":
        return plain, fused
    draft = unrelated if kind == "draft-model" else tiny_runtime(hf, "eager", output_logits=True)
    return neuronfx.with_draft(plain, draft), neuronfx.with_draft(fused, draft)


@pytest.mark.parametrize("kind", ["self", "draft-model", "same-model"])
@pytest.mark.parametrize("k", [2, 5])
def test_fused_greedy_equals_transformers(hf, unrelated, kind, k):
    _, rt = pair(hf, kind, unrelated, k)
    prompts = [random_prompt(n, seed=40 + n) for n in (5, 9, 3)]
    result, state = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=15, eos_token_ids=NO_EOS)
    for p, tokens in zip(prompts, result.token_ids):
        assert list(tokens) == hf_greedy(hf, p, 15)
    assert all(s.drafted == (k - 1) * s.target_passes > 0 for s in result.speculation)
    if kind == "same-model":  # every draft kept: the draft cache caught up inside each call
        assert all(s.acceptance_rate == 1.0 for s in result.speculation)
    assert state.free_slots == (0, 1, 2, 3)


ROWS = [
    GREEDY,
    SamplingParams(temperature=1.0, seed=7, logprobs=2),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.4, presence_penalty=0.5),
    SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, min_tokens=6, logit_bias=((3, 2.5), (7, -5.0)), logprobs=1),
    SamplingParams(temperature=1.2, top_k=1),  # greedy by top_k
    SamplingParams(temperature=0.9, min_tokens=4, frequency_penalty=0.6, logit_bias=((11, 4.0),)),
]


@pytest.mark.parametrize("kind", ["self", "draft-model", "same-model"])
def test_fused_equals_unfused_for_every_option(hf, unrelated, kind, monkeypatch):
    """Greedy, seeded and unseeded sampled rows with penalties, top-k / top-p / min-p, min_tokens
    (an eos the rows meet) and logit_bias in one ragged batch: the same tokens, logprobs, finish
    reasons and acceptance statistics fused as unfused, from the same state seed; every speculate
    step of the fused runtime ran fused."""
    unfused_rt, fused_rt = pair(hf, kind, unrelated)
    calls = []
    monkeypatch.setattr(speculate, "fused_step", lambda *a: calls.append(a[6]) or fused_step(*a))
    prompts = [random_prompt(n, seed=60 + n) for n in (6, 11, 4, 9)]
    eos = [hf_greedy(hf, prompts[3], 3)[2]]  # met early by the min_tokens row: held back, then it may end the row
    runs = []
    for rt in (unfused_rt, fused_rt):
        state = neuronfx.init_state(rt, seed=3)
        first, state = neuronfx.generate(rt, state, prompts, sampling=ROWS[:4], max_new_tokens=16, eos_token_ids=eos)
        second, _ = neuronfx.generate(rt, state, prompts[:2], sampling=ROWS[4:], max_new_tokens=16, eos_token_ids=eos)
        runs.append((first, second))
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids and a.finish_reasons == b.finish_reasons
        assert a.speculation == b.speculation
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x == y
    assert runs[0][0].token_ids[1] != tuple(hf_greedy(hf, prompts[1], 16))  # the sampled rows did sample
    passes = sum(s.target_passes for r in runs[1] for s in r.speculation)
    assert len(calls) > 0 and sum(calls) == passes  # one fused call per step, its rows' passes


@pytest.mark.parametrize("kind", ["draft-model", "same-model"])
def test_plain_greedy_rows_accept_on_the_verify_graphs_argmax(hf, unrelated, kind, monkeypatch):
    """Rows that take the argmax of their raw logits (``acceptance.raw_argmax``) accept on the
    speculate graph's argmax, as unfused acceptance does: no penalty pass over the (n * k, V)
    logits runs, and the tokens and statistics are unfused speculation's and transformers'
    (drafts rejected at every position, or all kept). A greedy row with a repetition penalty
    still takes the penalty pass, with unfused speculation's tokens."""
    from neuronfx.graphs.phases import speculation

    unfused_rt, fused_rt = pair(hf, kind, unrelated)
    passes, original = [], speculation.penalized_logits
    monkeypatch.setattr(speculation, "penalized_logits", lambda *a: passes.append(1) or original(*a))
    prompts = [random_prompt(n, seed=80 + n) for n in (7, 4)]
    for params in (GREEDY, SamplingParams(repetition_penalty=1.3)):
        passes.clear()
        runs = [neuronfx.generate(rt, neuronfx.init_state(rt), prompts, sampling=params, max_new_tokens=12, eos_token_ids=NO_EOS)[0]
                for rt in (unfused_rt, fused_rt)]
        assert runs[0].token_ids == runs[1].token_ids and runs[0].speculation == runs[1].speculation
        assert bool(passes) == (params is not GREEDY)
        if params is GREEDY:
            assert [list(t) for t in runs[1].token_ids] == [hf_greedy(hf, p, 12) for p in prompts]
            accepted = sum(s.accepted for s in runs[1].speculation)
            assert accepted == (0 if kind == "draft-model" else sum(s.drafted for s in runs[1].speculation))


def test_fused_acceptance_keeps_the_target_distribution():
    """The first token a fused step emits is distributed as the target's sampler distribution at
    that position (temperature, top-k, top-p, min-p, penalties over the counts), against the
    naive float64 reference of tests/test_sampling.py, whatever the draft proposes: 4000 rows of
    one call of ``accept_rows`` over random draft logits, chi-square at alpha = 1e-3."""
    g = torch.Generator().manual_seed(0)
    n, k, width = 4000, 3, 64
    sp = SamplingParams(temperature=1.2, top_k=12, top_p=0.95, min_p=0.02, repetition_penalty=1.5, presence_penalty=0.7)
    counts = torch.zeros(n, VOCAB, dtype=torch.int32)
    counts[:, :40:3] = 2
    prompt_mask = torch.zeros(n, VOCAB, dtype=torch.bool)
    prompt_mask[:, 100:140] = True
    params = torch.tensor(pack_sampling([sp] * n, width), dtype=torch.float32)
    zeros = torch.zeros(n, VOCAB)
    inputs = FusedSpeculateInputs(
        input_ids=torch.zeros(n, dtype=torch.int32), position_ids=torch.zeros(n, dtype=torch.int32),
        seq_ids=torch.zeros(n, dtype=torch.int32), draft_seq_ids=torch.zeros(n, dtype=torch.int32),
        block_table=torch.zeros(n, 1, dtype=torch.int32), draft_block_table=torch.zeros(n, 1, dtype=torch.int32), sampling_params=params,
        draft_sampling_params=params, output_counts=counts, prompt_mask=prompt_mask, logits_bias=zeros,
        stop_mask=zeros.bool(), min_tokens_left=torch.zeros(n, dtype=torch.int32), draft_rand=torch.zeros(n, k - 1),
        accept_rand=torch.rand(n, k - 1, generator=g), final_rand=torch.rand(n, k, generator=g))
    target = torch.randn(1, k, VOCAB, generator=g)
    target[0, 0, :40:3] += 2.0  # penalized tokens among the likely ones: the penalty must show
    target = target.expand(n, k, VOCAB)
    draft_logits = torch.randn(1, k - 1, VOCAB, generator=g).expand(n, k - 1, VOCAB)
    words, rows_counts, drafts, samplers = bitmask_words(VOCAB), counts, [], []
    for i in range(k - 1):  # draft tokens drawn from the draft's distribution q at each position
        s = position_sampler(inputs, params, rows_counts, i, torch.zeros(n), words)
        q = distribution(draft_logits[:, i], s, width)
        drafts.append(torch.multinomial(q, 1, generator=g)[:, 0])
        samplers.append(s)
        rows_counts = rows_counts.scatter_add(1, drafts[-1][:, None], torch.ones(n, 1, dtype=torch.int32))
    targets = stack_positions([*samplers, position_sampler(inputs, params, rows_counts, k - 1, torch.zeros(n), words)])
    tokens, emitted = accept_rows(torch.stack(drafts, 1), target, draft_logits, targets, stack_positions(samplers),
                                  inputs.accept_rand, inputs.final_rand, width, width)
    assert ((emitted >= 1) & (emitted <= k)).all()
    expected = torch.tensor(reference_probs(target[0, 0].tolist(), pack_sampling([sp], width)[0], width, counts[0].tolist(),
                                            prompt_mask[0].tolist()))
    hits = torch.bincount(tokens[:, 0], minlength=VOCAB).float()
    assert hits[expected == 0].sum() == 0  # never a token the target's sampler drops
    p_value = chi_square_p_value(hits[expected > 0], expected[expected > 0] * n)
    assert p_value > ALPHA, f"p={p_value:.2g}"


@pytest.mark.parametrize("options", [{"speculation_length": 0}, {"speculation_length": 4, "speculative_method": "ngram"}])
def test_fused_speculation_needs_a_draft_model(options):
    with pytest.raises(ConfigError, match="fused_speculation=True fuses"):
        neuronfx.InferenceConfig(fused_speculation=True, **options)


def test_fused_runtime_without_a_draft_names_only_fixes_it_accepts(hf):
    """A fused runtime compiled with neither draft_layers nor a draft runtime: speculate_step
    names draft_layers and with_draft, not prompt lookup (fused_speculation refuses it)."""
    rt = tiny_runtime(hf, "eager", speculation_length=4, fused_speculation=True)
    out, state = neuronfx.prefill_step(rt, neuronfx.init_state(rt), neuronfx.PrefillBatch(seq_ids=[0], prompts=[[1, 2, 3]],
                                                                                         sampling=[GREEDY]))
    with pytest.raises(ConfigError, match=r"draft_layers=N \(self-speculation\), or attach a draft runtime") as exc:
        neuronfx.speculate_step(rt, state, neuronfx.SpeculateBatch(seq_ids=[0], input_ids=out.tokens, sampling=[GREEDY]))
    assert "ngram" not in str(exc.value)


def test_fused_on_inductor_equals_plain_greedy(hf):
    """The default backend: self-speculation and a draft model, fused, batch 1, k = 5: plain
    greedy's tokens (the plan's parts are test_speculate's k = 5 ones, from the kernel store)."""
    draft = tiny_runtime(tiny_hf_model("llama", seed=99), "inductor", output_logits=True, **INDUCTOR_ONE_ROW)
    rt = tiny_runtime(hf, "inductor", speculation_length=5, draft_layers=1, output_logits=True, fused_speculation=True,
                      **INDUCTOR_ONE_ROW)
    prompt = random_prompt(7, seed=4)
    for runtime in (rt, neuronfx.with_draft(attrs.evolve(rt), draft)):
        result, _ = neuronfx.generate(runtime, neuronfx.init_state(runtime), [prompt], max_new_tokens=17, eos_token_ids=NO_EOS)
        assert list(result.token_ids[0]) == hf_greedy(hf, prompt, 17)
        assert result.speculation[0].target_passes < 16
