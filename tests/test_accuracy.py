"""``neuronfx check-accuracy`` and ``neuronfx.bench.accuracy``: NxDI's tolerance map on exact values, a
float plan that matches transformers, a perturbed weight that the check catches, perplexity
against a naive computation, and the CLI on a tiny checkpoint directory (eager, tiny llama)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import hf_greedy, random_prompt, tiny_hf_model, tiny_plan, tiny_runtime, write_tiny_gguf

import neuronfx
from neuronfx.bench.accuracy import check_accuracy, perplexity, reference_model
from neuronfx.bench.accuracy_report import TOLERANCE_BANDS, compare_logits, first_divergence, position_errors
from neuronfx.cli import main
from neuronfx.errors import CheckpointError, ConfigError

PROMPTS = [random_prompt(5, seed=1), random_prompt(13, seed=2), random_prompt(9, seed=3)]  # 3 prompts > batch_size 2


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=11)


@pytest.fixture(scope="module")
def reference(hf):
    return reference_model(hf.config, hf.state_dict())


@pytest.fixture(scope="module")
def runtime(hf):
    """fp32 eager, batch_size 2 (fewer slots than PROMPTS), logits out."""
    return tiny_runtime(hf, batch_size=2)


def test_tolerance_map_semantics_on_exact_values():
    """NxDI's per-position check: a constant shift is removed, each band is normalised by its
    largest |reference logit|, a top-1 swap passes only as a near tie, -inf entries are dropped."""
    ref = torch.linspace(-1.0, 2.0, 1000)  # top-1 = 2.0 = max|ref| in every band
    bumped = ref.clone()
    bumped[-1] += 0.03  # 1.5% of max|ref| on the top-1 logit
    tie, swap = ref.clone(), ref.clone()
    tie[-2], swap[-2] = 2.0005, 2.002  # the reference's second token now leads by 0.0005 / 0.002
    masked = ref.clone()
    masked[:10] = -math.inf
    rows = torch.stack([ref + 3.0, bumped, tie, swap, masked + 1.0])
    errors, divergence = position_errors(torch.stack([ref, ref, ref, ref, masked]), rows)
    assert (errors[0] <= 0).all() and (errors[4] <= 0).all()  # a shift is no error, with or without -inf entries
    assert errors[1].tolist() == pytest.approx([0.015] * 4, abs=1e-4)
    assert [e <= b.rtol for e, b in zip(errors[1].tolist(), TOLERANCE_BANDS)] == [False, True, True, True]  # only top 5 fails
    assert divergence.tolist() == pytest.approx([0.0, 0.0, 0.0005, 0.002, 0.0], abs=2e-5)
    result = compare_logits([ref[None]] * 2, [tie[None], swap[None]])
    assert not result.divergence_passed and result.worst_divergence == pytest.approx(0.002, abs=2e-5)
    assert result.top1_agreement == 0.0 and result.max_abs_error == pytest.approx(2.002 - ref[-2].item(), abs=1e-6)
    assert (result.bands[0].worst_prompt, result.bands[0].worst_token) == (1, 0)
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None and first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_tolerance_map_equals_a_naive_per_position_computation():
    """The vectorised check against NxDI's steps written out per position with numpy's lstsq."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(6, 3000, generator=g) * 4
    ours = 1.02 * ref + 0.7 + 0.05 * torch.randn(6, 3000, generator=g)
    errors, divergence = position_errors(ref, ours)
    for t in range(6):
        r, a = ref[t].double().numpy(), ours[t].double().numpy()
        _, shift = np.linalg.lstsq(np.stack([r, np.ones_like(r)], 1), a, rcond=None)[0]
        a = a - shift
        for i, band in enumerate(TOLERANCE_BANDS):
            idx = np.argsort(-r)[: band.top_k or len(r)]
            expect = (np.abs(a[idx] - r[idx]) - band.atol).max() / np.abs(r[idx]).max()
            assert errors[t, i].item() == pytest.approx(expect, rel=1e-9)
        expect = 0.0 if a.argmax() == r.argmax() else a.max() - a[r.argmax()]
        assert divergence[t].item() == pytest.approx(expect, rel=1e-9)


def test_float_plan_matches_transformers(hf, reference, runtime):
    """fp32 eager plan: greedy tokens identical (and equal to transformers' own generate), logits
    within 1e-4, full top-1 agreement, every band passes; 3 prompts over batches of 2."""
    report = check_accuracy(runtime, reference, prompts=PROMPTS, max_new_tokens=8)
    assert report.greedy_identical and [p.divergence for p in report.prompts] == [None] * 3
    assert report.logits.positions == 24 and report.logits.max_abs_error < 1e-4
    assert report.logits.top1_agreement == 1.0 and report.logits.passed and not report.failed("tolerance")
    assert all(p.max_abs_error < 1e-4 and p.num_tokens == 8 for p in report.prompts)
    assert hf_greedy(hf, PROMPTS[1], 8) == hf_greedy(reference, PROMPTS[1], 8)  # the reference is the model
    assert "identical" in report.format() and "FAIL" not in report.format()


def test_perturbed_weight_is_caught(hf, reference):
    """One neuronfx weight off (1% noise on the LM head): greedy tokens diverge and the tight bands
    fail, so every --fail-on but never fails."""
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    sd["lm_head.weight"] += 0.01 * torch.randn(sd["lm_head.weight"].shape, generator=g)
    rt = neuronfx.compile(tiny_plan(hf), sd, progress=False)
    report = check_accuracy(rt, reference, prompts=PROMPTS, max_new_tokens=8)
    diverged = [p.divergence for p in report.prompts if p.divergence is not None]
    assert diverged and all(d.ours != d.theirs for d in diverged)
    assert not report.logits.bands[0].passed and not report.logits.passed and report.logits.top1_agreement < 1.0
    assert report.failed("greedy") and report.failed("tolerance") and not report.failed("never")
    assert f"diverges at token {diverged[0].index}" in report.format()


def test_perplexity_equals_naive_transformers(hf, reference):
    """75 tokens in chunks of sequence_length 32 (32 + 32 + 11), three rows of one batch: the
    transformers figure is exp(mean cross entropy) of each chunk's logits, neuronfx's within 1e-5."""
    rt = tiny_runtime(hf, sequence_length=32, decode_buckets=(16, 32))  # batch_size 4
    ids = random_prompt(75, seed=8)
    result = perplexity(rt, reference, ids)
    nll = []
    with torch.no_grad():
        for start in range(0, 75, 32):
            chunk = torch.tensor([ids[start:start + 32]])
            logits = hf(chunk).logits[0, :-1]
            nll.append(torch.nn.functional.cross_entropy(logits.double(), chunk[0, 1:], reduction="none"))
    naive = math.exp(torch.cat(nll).mean().item())
    assert (result.chunks, result.predicted, result.tokens) == (3, 72, 75)
    assert result.transformers == pytest.approx(naive, rel=1e-9)
    assert result.neuronfx == pytest.approx(naive, rel=1e-5)


def test_reference_model_refuses_a_state_dict_it_cannot_take(hf):
    sd = dict(hf.state_dict())
    del sd["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing_keys.*up_proj"):
        reference_model(hf.config, sd)


def test_a_reference_whose_generation_config_moves_tokens_is_refused(hf, runtime):
    """A reference that suppresses its own first greedy token would be compared on tokens its raw
    logits do not pick."""
    ref = reference_model(hf.config, hf.state_dict())
    first = hf_greedy(ref, PROMPTS[0], 1)[0]
    ref.generation_config.suppress_tokens = [first]
    with pytest.raises(ConfigError, match=rf"picked \[(?!{first})\d+.*raw logits' argmax is \[{first}"):
        check_accuracy(runtime, ref, prompts=PROMPTS[:1], max_new_tokens=2)


@pytest.fixture(scope="module")
def word_model_dir(tmp_path_factory, hf) -> Path:
    """The tiny llama saved with a word-level tokenizer (token i is "w{i}"; no chat template), and
    a text file of 80 words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-acc")
    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    (path / "text.txt").write_text(" ".join(f"w{i}" for i in random_prompt(80, seed=4)))
    return path


PLAN = ["--backend", "eager", "--batch-size", "2", "--max-context-length", "32", "--sequence-length", "64"]


def test_cli_check_accuracy(word_model_dir, capsys, monkeypatch):
    """The report of a float plan (exit 0 even with --fail-on tolerance), then JSON against a
    reference whose LM head is off: greedy tokens diverge, so the default --fail-on greedy exits 1."""
    args = ["check-accuracy", str(word_model_dir), *PLAN, "--prompt", "w5 w9 w11 w3 w200", "--prompt", "w7 w7 w1",
            "--max-new-tokens", "6"]
    assert main([*args, "--text-file", str(word_model_dir / "text.txt"), "--fail-on", "tolerance"]) == 0
    out = capsys.readouterr().out
    assert out.count("': identical") == 2 and "top 1000" in out and "tolerance map: pass" in out
    pp = re.search(r"perplexity \(78 tokens scored in 2 chunks\): neuronfx ([\d.]+), transformers ([\d.]+)", out)
    assert pp and float(pp[1]) == pytest.approx(float(pp[2]), rel=1e-4)

    def off(source, sd):
        sd = dict(sd) | {"lm_head.weight": sd["lm_head.weight"] + 0.01 * torch.randn(sd["lm_head.weight"].shape)}
        return reference_model(source, sd)

    monkeypatch.setattr("neuronfx.bench.accuracy.reference_model", off)
    assert main([*args, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)[0]
    assert not data["greedy_identical"] and not data["tolerance_passed"] and data["logits"]["positions"] == 12
    assert any(p["divergence"] is not None for p in data["prompts"])


def test_cli_check_accuracy_of_a_quantized_plan(word_model_dir, capsys):
    """An int8 plan: against transformers on its dequantized weights it is exact (greedy
    identical, fp32-order logits); a second report compares it with the float model."""
    assert main(["check-accuracy", str(word_model_dir), *PLAN, "--weight-format", "int8", "--json"]) == 0
    dequantized, floats = json.loads(capsys.readouterr().out)
    assert "int8 weights dequantized" in dequantized["reference"] and "float weights" in floats["reference"]
    assert dequantized["engine"] == "neuronfx eager float32 weights int8"
    assert dequantized["greedy_identical"] and dequantized["logits"]["max_abs_error"] < 1e-4
    assert floats["logits"]["max_abs_error"] > dequantized["logits"]["max_abs_error"]


def test_cli_int8_activations_on_the_default_backend(word_model_dir, capsys):
    """``--activation-format int8`` through the CLI on inductor (the default backend, which the
    option needs): the report names the int8 activations, tokens come out, and the logits move
    from the int8 weights' exact reference by more than fp32 order (x's rounding), but stay
    near it."""
    # one prompt: batch 1 compiles one graph per phase, where batch 2 compiles batch 1's graphs too
    plan = ["--backend", "inductor", "--batch-size", "1", *PLAN[4:]]
    assert main(["check-accuracy", str(word_model_dir), *plan, "--weight-format", "int8", "--activation-format", "int8",
                 "--prompt", "w5 w9 w11 w3 w200", "--max-new-tokens", "4", "--fail-on", "never", "--json"]) == 0
    dequantized, _ = json.loads(capsys.readouterr().out)
    assert dequantized["engine"] == "neuronfx inductor float32 weights int8 int8 activations"
    assert 1e-4 < dequantized["logits"]["max_abs_error"] < 0.5


def test_cli_check_accuracy_of_kept_gguf_blocks_is_one_report(tmp_path, capsys):
    """A gguf plan's kept blocks dequantized are the checkpoint's float weights: one report,
    exact against transformers on them, its engine naming the weights."""
    path = write_tiny_gguf(str(tmp_path / "tiny.gguf"), tiny_hf_model("llama", tie_word_embeddings=False))
    assert main(["check-accuracy", path, *PLAN, "--weight-format", "gguf", "--prompt", "a b", "--max-new-tokens", "4",
                 "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["engine"] == "neuronfx eager float32 weights gguf" and "gguf weights dequantized" in report["reference"]
    assert report["greedy_identical"] and report["logits"]["max_abs_error"] < 1e-4


def test_cli_check_accuracy_rejects_bad_options(word_model_dir, capsys):
    assert main(["check-accuracy", str(word_model_dir), *PLAN, "--max-new-tokens", "64"]) == 2
    assert "SequenceLengthExceededError" in capsys.readouterr().err
    assert main(["check-accuracy", str(word_model_dir), *PLAN, "--chat", "hi"]) == 2
    assert "InputError: chat messages need a chat template" in capsys.readouterr().err
    assert main(["check-accuracy", str(word_model_dir), *PLAN, "--tp-degree", "2"]) == 2
    assert "--tp-degree=2 is not supported" in capsys.readouterr().err
