"""Greedy graphs (``InferenceConfig.greedy_graphs``): decode graphs whose epilogue only takes the
argmax, run for steps whose rows are all plain greedy. They must give the decode graph's tokens,
logits and finiteness bit for bit (eager and inductor), run only for such steps, and leave the
state (RNG key, counts) as the decode graph does."""

from __future__ import annotations

import attrs
import pytest
import torch
from helpers import GREEDY, byte_tokenizer, random_prompt, run_steps, tiny_hf_model, tiny_runtime

import neuronfx
from neuronfx import DecodeBatch, PrefillBatch, SamplingParams, StructuredOutputs
from neuronfx.graphs.backends.compile_workers import units
from neuronfx.runtime.pipeline import plan_rows, row_sampler, run_rows
from neuronfx.runtime.steps import decode_phase
from neuronfx.runtime.structured import Grammars

PROMPTS = [random_prompt(5, 1), random_prompt(13, 2), random_prompt(9, 3)]


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama")


@pytest.fixture(scope="module")
def rt(hf):
    return tiny_runtime(hf)


def prefilled(rt, sampling=GREEDY):
    state = neuronfx.init_state(rt)
    out, state = neuronfx.prefill_step(rt, state, PrefillBatch(seq_ids=[0, 1, 2], prompts=PROMPTS, sampling=[sampling] * 3))
    return out, state


@pytest.mark.parametrize("row", [
    SamplingParams(temperature=0.7, seed=1), SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=0.5),
    SamplingParams(frequency_penalty=-0.5), SamplingParams(logit_bias=((3, 2.0),)), SamplingParams(logprobs=0),
    SamplingParams(min_tokens=5),
])
def test_one_row_with_a_sampler_option_takes_the_decode_graph(rt, row):
    out, state = prefilled(rt)
    plain = DecodeBatch(seq_ids=[0, 1, 2], input_ids=list(out.tokens), sampling=[GREEDY] * 3)
    assert decode_phase(rt, state, plain) == "greedy"
    assert decode_phase(rt, state, attrs.evolve(plain, sampling=[GREEDY, row, GREEDY])) == "decode"


def test_min_tokens_reached_and_grammars(rt):
    out, state = prefilled(rt)
    reached = SamplingParams(min_tokens=1)  # the prefill generated the first token
    assert decode_phase(rt, state, DecodeBatch(seq_ids=[0, 1, 2], input_ids=list(out.tokens), sampling=[reached] * 3)) == "greedy"
    grammars = Grammars.for_runtime(rt, byte_tokenizer())
    matcher = grammars.matcher(StructuredOutputs(choice=["yes", "no"]))
    batch = DecodeBatch(seq_ids=[0, 1, 2], input_ids=list(out.tokens), sampling=[GREEDY] * 3, constraints=[None, matcher, None])
    assert decode_phase(rt, state, batch) == "decode"
    assert decode_phase(rt, state, attrs.evolve(batch, constraints=[None, None, None])) == "greedy"


def test_plans_without_greedy_graphs_decode(hf):
    for overrides in ({"greedy_graphs": False}, {"on_device_sampling": False}):
        rt = tiny_runtime(hf, **overrides)
        assert not [g for g in rt.plan.graphs if g.phase == "greedy"]
        out, state = prefilled(rt)
        assert decode_phase(rt, state, DecodeBatch(seq_ids=[0, 1, 2], input_ids=list(out.tokens), sampling=[GREEDY] * 3)) == "decode"


def both_graphs(rt, state, tokens):
    """The decode and the greedy graph on the same inputs and KV cache (each writes the same
    K/V at the same positions): their outputs."""
    slots = [0, 1, 2]
    starts = [state.cache_lens[s] for s in slots]
    rows = plan_rows(rt, "decode", rt.plan.decode_buckets, slots, [(t,) for t in tokens], starts, width=1)
    sampler, _ = row_sampler(rt, state, rows, [GREEDY] * 3, [state.generated[s] for s in slots])
    return run_rows(rt, state, rows, sampler), run_rows(rt, state, attrs.evolve(rows, phase="greedy"))


def check_same_outputs(decode, greedy, n=3, logits=True):
    """The first ``n`` rows' outputs of the two graphs, bit for bit (logits when returned)."""
    assert torch.equal(greedy["tokens"][:n], decode["tokens"][:n])
    assert torch.equal(greedy["finite"][:n], decode["finite"][:n])
    assert ("logits" in greedy) == ("logits" in decode) == logits
    if logits:
        assert torch.equal(greedy["logits"][:n], decode["logits"][:n])
        assert torch.equal(greedy["tokens"][:n], decode["logits"][:n].argmax(-1).to(torch.int32))


def test_greedy_graph_equals_the_decode_graph_eager(rt):
    out, state = prefilled(rt)
    check_same_outputs(*both_graphs(rt, state, out.tokens))


def test_greedy_graph_equals_the_decode_graph_inductor(inductor_qwen2):
    """The default backend: a compiled argmax epilogue beside the compiled sampler, on the
    same compiled prologue and layers (``inductor_parts`` shares them)."""
    _, rt = inductor_qwen2
    assert {g.key[1:] for g in rt.plan.graphs if g.phase == "greedy"} == {g.key[1:] for g in rt.plan.graphs if g.phase == "decode"}
    state = neuronfx.init_state(rt)
    prompts = [random_prompt(5, 4), random_prompt(20, 5), random_prompt(11, 6)]
    out, state = neuronfx.prefill_step(rt, state, PrefillBatch(seq_ids=[0, 1, 2], prompts=prompts, sampling=[GREEDY] * 3))
    check_same_outputs(*both_graphs(rt, state, out.tokens))


def test_greedy_graph_equals_the_decode_graph_without_logits_out():
    """The default plan returns no logits: inductor may then fuse the family's logits transform
    (granite divides by ``logits_scaling``) into the argmax; the tokens stay the decode graph's."""
    hf = tiny_hf_model("granite", seed=3)
    rt = tiny_runtime(hf, "inductor", batch_size=3, output_logits=False, max_context_length=16, sequence_length=32,
                      prefill_buckets=(16,), decode_buckets=(32,))
    state = neuronfx.init_state(rt)
    out, state = neuronfx.prefill_step(rt, state, PrefillBatch(seq_ids=[0, 1, 2], prompts=PROMPTS, sampling=[GREEDY] * 3))
    for _ in range(3):
        decode, greedy = both_graphs(rt, state, out.tokens)
        check_same_outputs(decode, greedy, logits=False)
        out, state = neuronfx.decode_step(rt, state, DecodeBatch(seq_ids=[0, 1, 2], input_ids=list(out.tokens), sampling=[GREEDY] * 3))
        assert list(out.tokens) == greedy["tokens"][:3].tolist()


def test_greedy_graphs_compile_with_their_decode_graphs(rt):
    """One compile unit per (decode, batch) holds its greedy graphs: they reuse its compiled
    prologue and layers (``inductor_parts._wrapper``), which another process would compile again."""
    for unit in units(rt.plan):
        phases = {spec.phase for spec in unit}
        assert phases in ({"prefill"}, {"decode", "greedy"})
        assert {s.key[1:] for s in unit if s.phase == "greedy"} == ({s.key[1:] for s in unit if s.phase == "decode"})


def recording(rt, phases):
    """``rt`` whose graphs append their phase to ``phases`` on every call."""
    def wrap(phase, graph):
        def call(*args):
            phases.append(phase)
            return graph(*args)
        return call
    return attrs.evolve(rt, graphs={k: wrap(k[0], g) for k, g in rt.graphs.items()})


def test_greedy_steps_equal_decode_steps_and_keep_the_state(hf):
    """Whole runs: greedy tokens and logits, and the state after them (RNG key, output counts),
    equal with and without greedy graphs; a penalised run (decode graph throughout) too. The
    decode steps run the greedy graphs only where every row is plain greedy."""
    on, off = tiny_runtime(hf), tiny_runtime(hf, greedy_graphs=False)
    for sampling, want in ((GREEDY, "greedy"), (SamplingParams(repetition_penalty=1.5), "decode")):
        runs = []
        for rt in (on, off):
            phases = []
            tokens, logits, _, state = run_steps(recording(rt, phases), neuronfx.init_state(rt), [0, 1, 2], PROMPTS, 8, sampling)
            assert phases == ["prefill"] + [want if rt is on else "decode"] * 7
            runs.append((tokens, logits, state.rng_key, state.output_counts.clone()))
        assert runs[0][0] == runs[1][0] and runs[0][2] == runs[1][2]
        assert all(torch.equal(a, b) for ra, rb in zip(runs[0][1], runs[1][1]) for a, b in zip(ra, rb))
        assert torch.equal(runs[0][3], runs[1][3])
