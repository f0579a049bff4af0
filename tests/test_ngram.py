"""Prompt-lookup (n-gram) speculation, vLLM's ``method="ngram"``, on tiny eager models: the
proposer against a naive reference and vLLM's own example, greedy speculation token-identical to
transformers' greedy output (the step API with padded proposals, generate and the scheduler),
sampled rows keeping the target's distribution (chi-square) and seeded ones reproducible, and
the config, step and CLI errors raised before any change."""

from __future__ import annotations

import json
import time
from unittest import mock

import attrs
import pytest
import torch
from helpers import GREEDY, VOCAB, hf_greedy, random_prompt, serving, tiny_hf_model, tiny_runtime
from hypothesis import given
from hypothesis import strategies as st
from test_sampling import reference_probs
from test_speculate import ALPHA, chi_square_p_value

import neuronfx
from neuronfx import InferenceConfig, PrefillBatch, SamplingParams, SpeculateBatch
from neuronfx.cli import main
from neuronfx.config.sampling import pack_sampling
from neuronfx.errors import ConfigError, InputError
from neuronfx.runtime.acceptance import RowFacts, Uniforms, accept
from neuronfx.runtime.drafts import ngram_proposal
from neuronfx.runtime.ngram import ngram_propose
from neuronfx.runtime.speculate import verify

NO_EOS: list[int] = []


# --- the proposer ---------------------------------------------------------------------------------


def naive_propose(history: list[int], num_tokens: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """For n = max_n down to min_n: the first start s < len - n with history[s:s+n] equal to the
    last n tokens; the tokens after it."""
    for n in range(max_n, min_n - 1, -1):
        for s in range(len(history) - n):
            if history[s : s + n] == history[len(history) - n :]:
                return tuple(history[s + n : s + n + num_tokens])
    return ()


@given(st.lists(st.integers(0, 3), max_size=40), st.integers(0, 6), st.integers(1, 4), st.integers(0, 3))
def test_ngram_propose_matches_naive(history, num_tokens, min_n, extra):
    assert ngram_propose(history, num_tokens, min_n, min_n + extra) == naive_propose(history, num_tokens, min_n, min_n + extra)


def test_ngram_propose_hand_cases():
    assert ngram_propose([1, 2, 3, 4, 2, 3], 4, 2, 3) == (4, 2, 3)  # vLLM's docstring example: fewer than k follow
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3], 2, 1, 4) == (9, 1)  # the 3-gram [1, 2, 3]
    assert ngram_propose([7, 2, 8, 2, 1, 2], 3, 1, 4) == (8, 2, 1)  # [1, 2] has no earlier match: the 1-gram [2], earliest
    assert ngram_propose([5, 5, 5, 5], 3, 1, 2) == (5, 5)  # overlapping: [5, 5] at 0 is followed by two tokens
    assert ngram_propose([1, 2, 3], 3, 1, 4) == ()  # no earlier occurrence
    assert ngram_propose([1, 2, 1], 3, 2, 4) == ()  # only a 1-gram matches, below min_n
    assert ngram_propose([1, 2, 1], 0, 1, 4) == () and ngram_propose([], 3, 1, 4) == ()


# --- tiny models ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=3)


@pytest.fixture(scope="module")
def ngram_rt(hf):
    return tiny_runtime(hf, "eager", speculation_length=4, speculative_method="ngram", prompt_lookup_min=1, prompt_lookup_max=3)


def repeating(seed: int) -> list[int]:
    """A prompt with repeated spans (prompt lookup finds matches in it)."""
    span = random_prompt(5, seed)
    return random_prompt(3, seed + 100) + span + random_prompt(2, seed + 200) + span


def test_greedy_steps_with_padded_proposals_equal_transformers(hf, ngram_rt):
    """The step API: rows with and without a match go through the speculate step together
    (proposals padded to k - 1); num_drafted is each row's lookup length."""
    prompts = [repeating(1), random_prompt(6, seed=2)]
    want = [hf_greedy(hf, p, 14) for p in prompts]
    out, state = neuronfx.prefill_step(ngram_rt, neuronfx.init_state(ngram_rt),
                                       PrefillBatch(seq_ids=[0, 3], prompts=prompts, sampling=[GREEDY] * 2))
    got = [[t] for t in out.tokens]
    drafted = []
    while min(len(g) for g in got) < 14:
        history = [p + g for p, g in zip(prompts, got)]
        lookups = tuple(len(ngram_propose(h, 3, 1, 3)) for h in history)
        out, state = neuronfx.speculate_step(ngram_rt, state, SpeculateBatch(seq_ids=[0, 3], input_ids=[g[-1] for g in got],
                                                                             sampling=[GREEDY] * 2, history=history))
        assert out.num_drafted == lookups
        drafted.append(lookups)
        for g, new in zip(got, out.new_tokens):
            g += new
    assert [g[:14] for g in got] == want
    assert any(d[1] == 0 for d in drafted) and any(d[0] > 0 for d in drafted)  # both paths ran


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_greedy_generate_equals_transformers(hf, k):
    rt = tiny_runtime(hf, "eager", speculation_length=k, speculative_method="ngram")
    prompts = [repeating(k), repeating(k + 10)[:9], random_prompt(4, seed=k)]
    result, state = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=16, eos_token_ids=NO_EOS)
    for p, tokens in zip(prompts, result.token_ids):
        assert list(tokens) == hf_greedy(hf, p, 16)
    assert state.free_slots == (0, 1, 2, 3)
    for s in result.speculation:
        assert s.emitted == 15 and 0 <= s.accepted <= s.drafted <= (k - 1) * s.target_passes
    assert sum(s.accepted for s in result.speculation) > 0


def test_inductor_speculate_graphs_equal_plain_decode(inductor_speculative):
    """The default backend: prompt lookup verifies with a compiled speculate graph (the shared
    inductor runtime's, k = 4, viewed under an ngram plan: its speculate graphs do not depend
    on the draft, and its draft graphs go unused), greedy and seeded, batch of 4 with rows
    with and without matches: plain decoding's greedy tokens, and the seeded rows reproducible."""
    _, compiled = inductor_speculative
    inference = attrs.evolve(compiled.plan.inference, draft_layers=0, speculative_method="ngram", prompt_lookup_min=1,
                                prompt_lookup_max=3)
    rt = attrs.evolve(compiled, plan=attrs.evolve(compiled.plan, inference=inference))
    prompts = [repeating(7), repeating(8)[:10], random_prompt(6, seed=1), repeating(9)]
    plain, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=12, eos_token_ids=NO_EOS, speculative=False)
    got, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=12, eos_token_ids=NO_EOS)
    assert got.token_ids == plain.token_ids and plain.speculation is None and sum(s.accepted for s in got.speculation) > 0
    seeded = [SamplingParams(temperature=0.8, seed=i) for i in range(4)]
    runs = [neuronfx.generate(rt, neuronfx.init_state(rt, seed=i), prompts, max_new_tokens=12, eos_token_ids=NO_EOS,
                              sampling=seeded)[0].token_ids for i in range(2)]
    assert runs[0] == runs[1]


def test_compiled_verify_pass_gives_the_argmax_and_finiteness_of_its_logits(inductor_speculative):
    """The speculate graph hands acceptance each position's argmax and finiteness (on the host
    each was a pass over (n, k, V) logits, 0.3-0.4 ms a SmolLM2 step): on inductor they equal
    ``torch.argmax`` and ``torch.isfinite`` of the logits it returns, rows of three lengths."""
    _, rt = inductor_speculative
    prompts = [random_prompt(n, seed=n) for n in (5, 9, 3)]
    first, state = neuronfx.prefill_step(rt, neuronfx.init_state(rt),
                                         PrefillBatch(seq_ids=[0, 1, 2], prompts=prompts, sampling=[GREEDY] * 3))
    _, got = verify(rt, state, [0, 1, 2], list(first.tokens), [random_prompt(3, seed=20 + r) for r in range(3)])
    assert got["logits"].shape[:2] == got["argmax"].shape == got["finite"].shape == (3, 4)
    assert torch.equal(got["argmax"].long(), got["logits"].argmax(-1))
    assert torch.equal(got["finite"], torch.isfinite(got["logits"]).all(-1)) and bool(got["finite"].all())


def test_scheduler_batch_of_requests_equals_plain(hf, ngram_rt):
    """More prompts than slots, greedy, through the scheduler (plain and overlapped): prompt
    lookup changes no token."""
    prompts = [repeating(s) for s in range(3)] + [random_prompt(n, seed=n) for n in (3, 7, 12)]
    plain = tiny_runtime(hf, "eager")
    want, _ = neuronfx.generate(plain, neuronfx.init_state(plain), prompts, max_new_tokens=12, eos_token_ids=NO_EOS)
    for async_decode in (False, True):
        got, _ = neuronfx.generate(ngram_rt, neuronfx.init_state(ngram_rt), prompts, max_new_tokens=12, eos_token_ids=NO_EOS,
                                   async_decode=async_decode)
        assert got.token_ids == want.token_ids and got.finish_reasons == want.finish_reasons
        assert sum(s.drafted for s in got.speculation) > 0


def test_server_completions_equal_plain(hf, ngram_rt, monkeypatch):
    """The OpenAI server over a prompt-lookup runtime: plain greedy's text, streamed or not,
    with speculate steps drafting."""
    from neuronfx.runtime import scheduler

    drafted = []

    def counted(runtime, state, batch):
        out, state = speculate(runtime, state, batch)
        drafted.append(sum(out.num_drafted))
        return out, state

    speculate = scheduler.PIPELINES["speculate"]
    monkeypatch.setitem(scheduler.PIPELINES, "speculate", counted)
    body = {"prompt": "abcabcabd abcab", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    texts = []
    for rt in (tiny_runtime(hf, "eager"), ngram_rt):
        with serving(rt) as client:
            texts.append(client.post("/v1/completions", json=body).json()["choices"][0]["text"])
            chunks = client.post("/v1/completions", json=body | {"stream": True}).text.split("data: ")[1:-1]
            assert "".join(json.loads(c)["choices"][0]["text"] for c in chunks) == texts[-1]
    assert texts[0] == texts[1] and len(texts[0]) > 0 and sum(drafted) > 0


def test_seeded_sampled_rows_are_reproducible(ngram_rt):
    seeded = SamplingParams(temperature=0.8, seed=77, max_tokens=14)
    prompt = repeating(5)
    alone, _ = neuronfx.generate(ngram_rt, neuronfx.init_state(ngram_rt, seed=0), [prompt], sampling=seeded, eos_token_ids=NO_EOS)
    again, _ = neuronfx.generate(ngram_rt, neuronfx.init_state(ngram_rt, seed=1), [prompt], sampling=seeded, eos_token_ids=NO_EOS)
    others = [repeating(9), random_prompt(5, seed=4)]
    mixed, _ = neuronfx.generate(ngram_rt, neuronfx.init_state(ngram_rt, seed=3), others + [prompt], eos_token_ids=NO_EOS,
                                 sampling=[SamplingParams(temperature=1.1), GREEDY, seeded], max_new_tokens=14)
    assert alone.token_ids == again.token_ids and mixed.token_ids[2] == alone.token_ids[0] and len(alone.token_ids[0]) == 14


def test_sampled_acceptance_keeps_the_target_distribution(ngram_rt):
    """A prompt-lookup proposal is one-hot: the first token a speculate step emits is still
    distributed as the target's sampler distribution (4000 acceptances, chi-square at
    alpha = 1e-3), the draft accepted with probability p(draft)."""
    g = torch.Generator().manual_seed(0)
    k, width = 4, ngram_rt.plan.topk_width
    sp = SamplingParams(temperature=1.3, top_k=12, repetition_penalty=1.3)
    counts, prompt_mask = torch.zeros(1, VOCAB, dtype=torch.int32), torch.zeros(1, VOCAB, dtype=torch.bool)
    rows = RowFacts(slots=[0], params=[sp], generated=[3], counts=counts, prompt_mask=prompt_mask)
    target = torch.randn(1, k, VOCAB, generator=g)
    expected = torch.tensor(reference_probs(target[0, 0].tolist(), pack_sampling([sp], width)[0], width, counts[0].tolist(),
                                            prompt_mask[0].tolist()))
    draft = int(expected.argmax())  # a likely first draft, so acceptance and rejection both happen
    history = [250, 251, 252, draft, 253, 250, 251, 252]  # [250, 251, 252] matched: drafts draft, 253, 250
    u0 = Uniforms(draft=torch.zeros(1, k - 1), accept=torch.zeros(1, k - 1), final=torch.zeros(1, k))
    proposal = ngram_proposal(ngram_rt, rows, [history[-1]], [history], u0)
    assert proposal.tokens == [[draft, 253, 250]] and proposal.drafted == (3,) and expected[draft] < 0.9
    n, hits = 4000, torch.zeros(VOCAB)
    for _ in range(n):
        u = Uniforms(draft=u0.draft, accept=torch.rand(1, k - 1, generator=g), final=torch.rand(1, k, generator=g))
        hits[accept(ngram_rt, width, rows, proposal, target, u)[0][0]] += 1
    assert hits[expected == 0].sum() == 0
    p_value = chi_square_p_value(hits[expected > 0], expected[expected > 0] * n)
    assert p_value > ALPHA, f"p={p_value:.2g}"


# greedy with nothing that changes the logits once min_tokens (if any) is reached; generated is 0-6
RAW_OPTIONS = [{}, {"top_k": 1, "temperature": 0.8}, {"min_tokens": 2, "stop_token_ids": (7, 9)},
               {"min_tokens": 5, "stop_token_ids": (7,)}]


@given(st.sampled_from([*RAW_OPTIONS, {"repetition_penalty": 1.2}, {"presence_penalty": 0.5}, {"frequency_penalty": -0.7},
                        {"logit_bias": {7: 100.0}}, {"logit_bias": {9: -100.0}}, {"temperature": 0.8, "seed": 1}]),
       st.integers(0, 6), st.lists(st.sampled_from([7, 9, 3, 11]), min_size=4, max_size=4), st.integers(0, 2**31 - 1))
def test_acceptance_without_a_penalty_pass_equals_the_penalized_one(ngram_rt, fields, generated, tops, seed):
    """Greedy rows with nothing that changes their logits (``acceptance.raw_argmax``) skip the
    penalty pass and their proposal carries no sampler inputs; the same step with that shortcut
    off (``raw_argmax`` patched to False) must emit the same tokens, whichever options the row
    has. Each position's top token (``tops``) sits just above the rest, so a bias, a penalty or a
    pending min_tokens on it changes the answer, and the drafts [7, 9, 3] are accepted to
    different depths."""
    g = torch.Generator().manual_seed(seed)
    k, sp = 4, SamplingParams(**fields)
    counts = torch.randint(0, 3, (1, VOCAB), generator=g, dtype=torch.int32)
    rows = RowFacts(slots=[0], params=[sp], generated=[generated], counts=counts, prompt_mask=torch.rand(1, VOCAB, generator=g) < 0.3)
    logits = torch.randn(1, k, VOCAB, generator=g)
    for i, t in enumerate(tops):
        logits[0, i, t] = logits[0, i].max() + 0.05
    u = Uniforms(draft=torch.rand(1, k - 1, generator=g), accept=torch.rand(1, k - 1, generator=g), final=torch.rand(1, k, generator=g))
    history, width = [3, 7, 7, 9, 3, 7], ngram_rt.plan.topk_width

    def emitted() -> tuple[bool, list[list[int]]]:
        proposal = ngram_proposal(ngram_rt, rows, [history[-1]], [history], u)
        return proposal.raw_greedy, accept(ngram_rt, width, rows, proposal, logits, u)

    shortcut, fast = emitted()
    with mock.patch("neuronfx.runtime.drafts.raw_argmax", return_value=False), \
            mock.patch("neuronfx.runtime.acceptance.raw_argmax", return_value=False):
        assert emitted() == (False, fast)
    assert shortcut == (fields in RAW_OPTIONS and generated >= fields.get("min_tokens", 0))


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    ({"speculative_method": "eagle", "speculation_length": 3}, r"speculative_method='eagle' is not one of None, 'ngram'"),
    ({"speculative_method": "ngram"}, "speculative_method='ngram' needs speculation_length"),
    ({"speculative_method": "ngram", "speculation_length": 3, "draft_layers": 1}, "drop draft_layers"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min=3 > prompt_lookup_max=2"),
    ({"prompt_lookup_min": 0}, "prompt_lookup_min=0 must be a positive int"),
])
def test_config_errors_name_the_values(fields, message):
    with pytest.raises(ConfigError, match=message):
        InferenceConfig(**fields)


def test_step_errors_before_any_change(hf, ngram_rt):
    assert ngram_rt.can_speculate and ngram_rt.plan.inference.draft_layers == 0
    with pytest.raises(ConfigError, match="speculative_method='ngram'"):
        neuronfx.with_draft(ngram_rt, tiny_runtime(hf, "eager"))
    out, state = neuronfx.prefill_step(ngram_rt, neuronfx.init_state(ngram_rt), PrefillBatch(seq_ids=[1], prompts=[[4, 5, 4]],
                                                                                             sampling=[GREEDY]))
    x = out.tokens[0]
    for history, message in ((None, "pass SpeculateBatch\\(history=...\\)"), ([[4, 5, 4]], "history of row 0 ends with \\[4\\]"),
                             ([[4, x], [x]], "history has 2 rows"), ([[VOCAB, x]], "outside the vocabulary")):
        with pytest.raises(InputError, match=message):
            neuronfx.speculate_step(ngram_rt, state, SpeculateBatch(seq_ids=[1], input_ids=[x], sampling=[GREEDY], history=history))
    assert not state.consumed and state.cache_lens[1] == 3


# --- the CLI --------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, error", [
    (["--speculative-method", "ngram"], "InputError: --speculative-method ngram needs --num-speculative-tokens"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--draft-layers", "1"], "InputError: --speculative-method"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--draft-model", "/x"], "InputError: --speculative-method ngram drafts by prompt lookup"),
    (["--num-speculative-tokens", "3", "--speculation-length", "3"], "InputError: --num-speculative-tokens=3 means --speculation-length=4"),
    (["--num-speculative-tokens", "0"], "InputError: --num-speculative-tokens=0 must be >= 1"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "2", "--prompt-lookup-min", "3", "--prompt-lookup-max", "2"],
     "ConfigError: prompt_lookup_min=3 > prompt_lookup_max=2"),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_rejects_bad_ngram_options_before_loading(command, args, error, capsys):
    """generate checks its draft flags first (InputError); serve, which has no --draft-model,
    gets the plan's ConfigError for a missing length."""
    if command == "serve" and "--draft-model" in args:
        return
    if command == "serve" and args == ["--speculative-method", "ngram"]:
        error = "ConfigError: speculative_method='ngram' needs speculation_length=k >= 2"
    t0 = time.perf_counter()
    assert main([command, *args]) == 2
    assert time.perf_counter() - t0 < 5
    assert f"error: {error}" in capsys.readouterr().err


def test_cli_generate_with_prompt_lookup_equals_plain(tmp_path, hf, capsys):
    """`neuronfx generate --speculative-method ngram --num-speculative-tokens 3` gives plain
    greedy's tokens and drafts (eager here; prompt lookup on the default inductor backend:
    :func:`test_inductor_speculate_graphs_equal_plain_decode`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(tmp_path)
    prompt = " ".join(f"w{t}" for t in repeating(4))
    base = ["generate", "--model", str(tmp_path), "--prompt", prompt, "--backend", "eager", "--max-new-tokens", "12", "--ignore-eos",
            "--batch-size", "1", "--max-context-length", "32", "--sequence-length", "64", "--json"]
    runs = []
    for extra in ([], ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--prompt-lookup-min", "2",
                       "--prompt-lookup-max", "3"]):
        assert main([*base, *extra]) == 0, capsys.readouterr().err
        runs.append(json.loads(capsys.readouterr().out))
    plain, spec = runs
    assert spec["token_ids"] == plain["token_ids"] and plain["speculation"] is None and spec["speculation"]["drafted"] > 0
