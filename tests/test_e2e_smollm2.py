"""End to end on the real SmolLM2-135M-Instruct GGUF: `neuronfx generate` gives the tokens
transformers' greedy `generate` gives on the same GGUF and chat template."""

from __future__ import annotations

import json

import pytest
import torch

from neuronfx.checkpoints import default_model_path
from neuronfx.cli import main

pytestmark = pytest.mark.slow

QUESTIONS = {
    "What is the capital of France?": 24,
    "Write a haiku about the sea.": 32,
    "Explain in one sentence what a CPU does.": 32,
}


@pytest.fixture(scope="module")
def reference():
    """transformers' own GGUF loader and tokenizer: the golden reference (fp32, greedy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    directory, name = path.rsplit("/", 1)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    return tok, model


def hf_greedy(reference, question: str, max_new_tokens: int) -> list[int]:
    tok, model = reference
    ids = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def run_cli(capsys, *args: str) -> dict:
    assert main(["generate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_france_matches_transformers(reference, capsys):
    out = run_cli(capsys, "--chat", "What is the capital of France?", "--max-new-tokens", "24")
    assert out["token_ids"] == hf_greedy(reference, "What is the capital of France?", 24)
    assert "Paris" in out["text"]
    assert out["num_generated"] == len(out["token_ids"])
    assert out["prefill_s"] > 0 and out["decode_s"] > 0


def test_cli_batch_of_chat_prompts_matches_transformers(reference, capsys):
    questions = [q for q, n in QUESTIONS.items() if n == 32]
    args = [a for q in questions for a in ("--chat", q)]
    out = run_cli(capsys, *args, "--max-new-tokens", "32", "--batch-size", "2")
    for q, ids in zip(questions, out["token_ids"]):
        assert ids == hf_greedy(reference, q, 32), q


def test_cli_stream_prints_text_cut_at_stop_string(reference, capsys):
    tok, _ = reference
    q = "What is the capital of France?"
    full = tok.decode(hf_greedy(reference, q, 24), skip_special_tokens=True)
    assert "Paris" in full
    assert main(["generate", "--chat", q, "--max-new-tokens", "24", "--stream", "--stop", "Paris"]) == 0
    printed = capsys.readouterr().out
    assert printed == full[: full.index("Paris")] + "\n"


@pytest.mark.parametrize("draft", [["--draft-layers", "15"], ["--draft-model", "DEFAULT"]], ids=["self", "draft-model"])
def test_cli_speculative_greedy_matches_transformers(reference, capsys, draft):
    draft = [default_model_path() if a == "DEFAULT" else a for a in draft]
    q = "What is the capital of France?"
    # A smaller plan (buckets 128 / 128, 256) keeps the cold compile of the extra graphs short.
    out = run_cli(capsys, "--chat", q, "--max-new-tokens", "24", "--speculation-length", "4",
                  "--max-context-length", "128", "--sequence-length", "256", *draft)
    assert out["token_ids"] == hf_greedy(reference, q, 24)
    stats = out["speculation"]
    assert stats["emitted"] == len(out["token_ids"]) - 1 and stats["drafted"] == 3 * stats["target_passes"]
    if "--draft-model" in draft:  # the draft is the target itself: every draft is accepted
        assert stats["acceptance_rate"] == 1.0
