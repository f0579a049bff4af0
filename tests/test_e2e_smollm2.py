"""End to end on the real SmolLM2-135M-Instruct GGUF, loaded once per session (conftest.py):
neuronfx gives the tokens transformers' greedy ``generate`` gives on the same GGUF and chat
template: through the CLI with the default (inductor) backend on a small plan, and through the
API on the eager backend for batches, streaming, stop strings and speculative decoding (self-draft
and a draft model), with every sampling option speculation must honour."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from helpers import chunked_prefill

import neuronfx
from neuronfx import SamplingParams
from neuronfx.cli import main

pytestmark = pytest.mark.slow

QUESTIONS = {
    "What is the capital of France?": 24,
    "Write a haiku about the sea.": 32,
    "Explain in one sentence what a CPU does.": 32,
}
FRANCE = "What is the capital of France?"


def chat_ids(tokenizer, question: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])


@functools.cache  # several tests ask for the same reference generation
def hf_greedy(smollm2, question: str, max_new_tokens: int) -> list[int]:
    ids = torch.tensor([chat_ids(smollm2.reference_tokenizer, question)])
    with torch.no_grad():
        out = smollm2.reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_cli_france_matches_transformers(smollm2, capsys):
    """The CLI end to end (GGUF load, tokenizer, chat template, compile, generate) on the default
    inductor backend, with self-speculation (k = 4, a 3-layer draft: the command of a bug report,
    where a draft step's input reached the compiled draft graph with strides its guards refused)
    and then without it (``--no-speculation``, the same plan loaded from the compile cache)."""
    command = ["generate", "--chat", FRANCE, "--max-new-tokens", "24", "--max-context-length", "128", "--sequence-length", "128",
               "--speculation-length", "4", "--draft-layers", "3", "--json"]
    assert main(command) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == "inductor"
    assert out["token_ids"] == hf_greedy(smollm2, FRANCE, 24)
    assert "Paris" in out["text"]
    assert out["num_generated"] == len(out["token_ids"])
    assert out["prefill_s"] > 0 and out["decode_s"] > 0
    assert out["speculation"]["drafted"] == 3 * out["speculation"]["target_passes"] > 0
    assert main([*command, "--no-speculation"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["token_ids"] == out["token_ids"] and plain["speculation"] is None


def test_batch_of_chat_prompts_matches_transformers(smollm2, smollm2_eager):
    questions = [q for q, n in QUESTIONS.items() if n == 32]
    prompts = [chat_ids(smollm2.tokenizer, q) for q in questions]
    rt = smollm2_eager
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=32, speculative=False)
    for q, ids in zip(questions, result.token_ids, strict=True):
        assert list(ids) == hf_greedy(smollm2, q, 32), q


@pytest.fixture(scope="module")
def smollm2_gguf(smollm2):
    """SmolLM2 with the GGUF's Q4_1 (layers) and Q8_0 (tied embeddings and head) blocks kept,
    eager: every product dequantizes its blocks (the reference ops)."""
    from neuronfx.io.checkpoints import default_model_path, load_checkpoint

    ckpt = load_checkpoint(default_model_path(), gguf_blocks=True)
    inference = neuronfx.InferenceConfig(batch_size=3, max_context_length=64, sequence_length=128, backend="eager",
                                         weight_format="gguf")
    return neuronfx.compile(neuronfx.make_plan(ckpt.config, inference), ckpt.state_dict, progress=False)


def test_gguf_blocks_kept_greedy_matches_transformers(smollm2, smollm2_gguf):
    """The file's blocks, never re-quantized, give transformers' greedy tokens on the GGUF it
    dequantizes (3 chat prompts x 32 tokens)."""
    from neuronfx.graphs.models.quant import Q4_1Blocks, Q8_0Blocks

    rt = smollm2_gguf
    assert isinstance(rt.weights["layers"][0]["wq"], Q4_1Blocks) and isinstance(rt.weights["layers"][29]["down"], Q4_1Blocks)
    assert isinstance(rt.weights["lm_head"], Q8_0Blocks) and rt.weights["embed"] is rt.weights["lm_head"]
    prompts = [chat_ids(smollm2.tokenizer, q) for q in QUESTIONS]
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=32, speculative=False)
    for q, ids in zip(QUESTIONS, result.token_ids, strict=True):
        assert list(ids) == hf_greedy(smollm2, q, 32), q


def test_stream_text_cut_at_stop_string(smollm2, smollm2_eager):
    full = smollm2.reference_tokenizer.decode(hf_greedy(smollm2, FRANCE, 24), skip_special_tokens=True)
    assert "Paris" in full
    rt = smollm2_eager
    events = neuronfx.stream_generate(rt, neuronfx.init_state(rt), [chat_ids(smollm2.tokenizer, FRANCE)], max_new_tokens=24,
                                      sampling=SamplingParams(stop="Paris"), tokenizer=smollm2.tokenizer, speculative=False)
    text = "".join(e.text for e in events if isinstance(e, neuronfx.TokenEvent))
    assert text == full[: full.index("Paris")]


@pytest.mark.parametrize("draft", ["self", "draft-model"])
def test_speculative_greedy_matches_transformers(smollm2, smollm2_eager, draft):
    rt = smollm2_eager  # self-draft: the first 15 of 30 layers
    if draft == "draft-model":  # the model itself as its draft: every draft is accepted
        ckpt = smollm2.checkpoint
        target = neuronfx.compile(neuronfx.make_plan(ckpt.config, neuronfx.InferenceConfig(
            batch_size=2, max_context_length=128, sequence_length=256, backend="eager", speculation_length=4)), ckpt.state_dict,
            progress=False)
        rt = neuronfx.with_draft(target, neuronfx.compile(neuronfx.make_plan(ckpt.config, neuronfx.InferenceConfig(
            batch_size=2, max_context_length=128, sequence_length=256, backend="eager", output_logits=True)), ckpt.state_dict,
            progress=False))
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [chat_ids(smollm2.tokenizer, FRANCE)], max_new_tokens=24)
    assert list(result.token_ids[0]) == hf_greedy(smollm2, FRANCE, 24)
    stats = result.speculation[0]
    assert stats.emitted == len(result.token_ids[0]) - 1 and stats.drafted == 3 * stats.target_passes
    if draft == "draft-model":
        assert stats.acceptance_rate == 1.0


def test_speculative_greedy_with_every_option_equals_plain(smollm2, smollm2_eager):
    """Penalties, min_p, logprobs, a stop string and streaming: the same tokens, text and
    logprobs with speculation (self-draft) as without."""
    rt, tok = smollm2_eager, smollm2.tokenizer
    sp = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2, min_p=0.05, logprobs=3,
                        stop=["Paris", "sea"], min_tokens=2)
    prompts = [chat_ids(tok, q) for q in (FRANCE, "Write a haiku about the sea.")]

    def run(speculative: bool) -> tuple:
        events = list(neuronfx.stream_generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=28, sampling=sp,
                                               tokenizer=tok, speculative=speculative))
        tokens = [e for e in events if isinstance(e, neuronfx.TokenEvent)]
        per_row = [[e for e in tokens if e.index == i] for i in range(len(prompts))]
        return ([[e.token_id for e in row] for row in per_row], ["".join(e.text for e in row) for row in per_row],
                [[e.logprobs for e in row] for row in per_row], [row[-1].finish_reason for row in per_row])

    spec, plain = run(True), run(False)
    assert spec[0] == plain[0] and spec[1] == plain[1] and spec[3] == plain[3]
    assert any(len(t) < 28 for t in plain[0])  # a stop string ended something
    for row_a, row_b in zip(spec[2], plain[2], strict=True):
        for a, b in zip(row_a, row_b, strict=True):
            assert a.token_id == b.token_id and a.top_ids == b.top_ids and a.logprob == pytest.approx(b.logprob, abs=1e-3)


def test_chunked_prefill_of_a_long_prompt_matches_transformers(smollm2):
    """max_context_length 2048 with prefill_chunk_size 128: no prefill graph over 128 tokens
    (chunk graphs of 128 tokens attend 128 .. 2048), and a 600-token prompt (real English text)
    prefilled in 5 chunks, the last partial, gives transformers' greedy tokens (eager). The
    2000-token prompt runs on a tiny model (test_chunked.py): on SmolLM2 both engines' 2000-token
    forward passes would cost a minute of the suite."""
    ckpt = smollm2.checkpoint
    inference = neuronfx.InferenceConfig(batch_size=1, max_context_length=2048, sequence_length=2048, backend="eager",
                                         prefill_chunk_size=128)
    rt = neuronfx.compile(neuronfx.make_plan(ckpt.config, inference), ckpt.state_dict, progress=False)
    assert max(g.bucket for g in rt.plan.graphs if g.phase == "prefill") == 128
    assert sorted({g.bucket for g in rt.plan.graphs if g.phase == "chunk"}) == [128, 256, 512, 1024, 2048]
    text = (Path(neuronfx.__file__).parent / "data" / "bench_text.txt").read_text()
    prompt = smollm2.tokenizer(text)["input_ids"][:600]
    assert len(prompt) == 600
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [prompt], max_new_tokens=3)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = smollm2.reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert list(result.token_ids[0]) == want[0, 600:].tolist()


@pytest.mark.parametrize("size", [1, 7, 32])
def test_chunked_prefill_equals_unchunked(smollm2, size):
    """A 38-token chat prompt prefilled in chunks of 1, 7 and 32 tokens (eager, fp32): the first
    token of one unchunked prefill, and its logits within 1e-5 of the largest logit's magnitude.
    A chunk's products have other row counts than the prompt's, so the BLAS may take another
    kernel and summation order (which one depends on the CPU: chunks of 7 matched bit for bit on
    an AMD EPYC and differed by 2.8e-5 on an Intel Xeon); each fp32 dot product of K terms then
    moves by a few units of roundoff times sqrt(K) of its terms' magnitude, and 30 layers carry
    that to the logits as a relative error near 1e-6 (2.8e-5 to 3.6e-5 measured on logits of
    magnitude 10-30, every CPU and chunk size). The bound is ten times that."""
    ckpt = smollm2.checkpoint

    def runtime(**options):
        inference = neuronfx.InferenceConfig(batch_size=1, max_context_length=64, sequence_length=128, backend="eager",
                                             output_logits=True, **options)
        return neuronfx.compile(neuronfx.make_plan(ckpt.config, inference), ckpt.state_dict, progress=False)

    prompt = chat_ids(smollm2.tokenizer, "Write a haiku about the sea.")
    greedy = SamplingParams(temperature=0.0)
    ref = runtime()
    want, _ = neuronfx.prefill_step(ref, neuronfx.init_state(ref), neuronfx.PrefillBatch(seq_ids=[0], prompts=[prompt], sampling=[greedy]))
    rt = runtime(prefill_chunk_size=size, prefill_buckets=None)
    tokens, logits, _ = chunked_prefill(rt, neuronfx.init_state(rt), [0], [prompt], size, greedy)
    assert tokens == [want.tokens[0]]
    atol = 1e-5 * float(want.logits[0].abs().max())  # about 3e-4 for SmolLM2's logits
    torch.testing.assert_close(logits[0], want.logits[0], atol=atol, rtol=0)
