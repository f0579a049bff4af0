"""Prompt logprobs (``InferenceConfig.enable_prompt_logprobs``, ``SamplingParams.prompt_logprobs``):
at every prompt position the raw logprob of the next prompt token and the top-k alternatives
equal transformers' log_softmax within 1e-4, for ragged prefill batches, chunked prefill, a
long bucket whose LM head runs in blocks, tp=2; a plan without the option refuses them by name
and the compile cache keys on it."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import random_prompt, serving, tiny_hf_model, tiny_plan, tiny_runtime

import neuronfx
from neuronfx.config.sampling import SamplingParams
from neuronfx.errors import ConfigError, InputError, SamplingParamsError
from neuronfx.io.cache_key import cache_key
from neuronfx.runtime.chunked import ChunkBatch, chunk_step
from neuronfx.runtime.steps import PrefillBatch

K = 5
ASK = SamplingParams(prompt_logprobs=K)
ATOL = 1e-4


@torch.no_grad()
def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """transformers' log_softmax (len - 1, V) float32 of the logits predicting prompt tokens 1 .. len - 1."""
    return torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


def check_entries(hf, prompt: list[int], entries: tuple) -> None:
    """``entries`` (one per prompt token, None first) equal transformers' logprobs and top-K."""
    want = hf_prompt_logprobs(hf, prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for t, lp in enumerate(entries[1:]):
        assert lp.token_id == prompt[t + 1]
        assert abs(lp.logprob - float(want[t, prompt[t + 1]])) < ATOL, (t, lp.logprob)
        vals, ids = torch.topk(want[t], K)
        assert list(lp.top_ids) == ids.tolist(), t
        assert torch.allclose(torch.tensor(lp.top_logprobs), vals, atol=ATOL), t


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_ragged_prefill_matches_transformers(model_type: str) -> None:
    """Three prompts of different lengths in one prefill (gemma3: scaled embeddings, soft-capped
    logits); a row that did not ask gets None."""
    hf = tiny_hf_model(model_type)
    rt = tiny_runtime(hf, enable_prompt_logprobs=True, max_logprobs=K)
    prompts = [random_prompt(n, seed) for seed, n in enumerate((7, 13, 2))]
    batch = PrefillBatch(seq_ids=[0, 1, 2], prompts=prompts, sampling=[ASK, SamplingParams(), ASK])
    out, _ = neuronfx.prefill_step(rt, neuronfx.init_state(rt), batch)
    assert out.prompt_logprobs[1] is None
    for r in (0, 2):
        check_entries(hf, prompts[r], out.prompt_logprobs[r])


def test_long_bucket_runs_the_head_in_blocks() -> None:
    """A 300-token prompt in a 512 bucket: the LM head runs over blocks of 128 positions."""
    hf = tiny_hf_model("llama", max_position_embeddings=1024)
    rt = tiny_runtime(hf, enable_prompt_logprobs=True, max_logprobs=K, max_context_length=512, sequence_length=520,
                      prefill_buckets=(512,), decode_buckets=(520,), batch_size=1)
    prompt = random_prompt(300, 3)
    out, _ = neuronfx.prefill_step(rt, neuronfx.init_state(rt), PrefillBatch(seq_ids=[0], prompts=[prompt], sampling=[ASK]))
    check_entries(hf, prompt, out.prompt_logprobs[0])


def test_chunked_prefill_matches_transformers() -> None:
    """Ragged prompts prefilled in chunks of 4 (next_tokens name each chunk's successor): the
    steps' entries, concatenated, are the unchunked ones."""
    hf = tiny_hf_model("llama")
    rt = tiny_runtime(hf, enable_prompt_logprobs=True, max_logprobs=K, prefill_chunk_size=4, prefill_buckets=(4,))
    prompts = [random_prompt(n, seed) for seed, n in enumerate((11, 6, 3))]
    state, done, got = neuronfx.init_state(rt), [0, 0, 0], [[], [], []]
    while any(d < len(p) for d, p in zip(done, prompts)):
        rows = [r for r, p in enumerate(prompts) if done[r] < len(p)]
        chunks = [prompts[r][done[r]:done[r] + 4] for r in rows]
        ends = [done[r] + len(c) for r, c in zip(rows, chunks)]
        final = [e == len(prompts[r]) for r, e in zip(rows, ends)]
        after = [None if f else prompts[r][e] for r, e, f in zip(rows, ends, final)]
        batch = ChunkBatch(seq_ids=rows, chunks=chunks, sampling=[ASK] * len(rows), final=final, next_tokens=after)
        out, state = chunk_step(rt, state, batch)
        for i, r in enumerate(rows):
            got[r] += out.prompt_logprobs[i]
            done[r] = ends[i]
    for r, prompt in enumerate(prompts):
        check_entries(hf, prompt, tuple(got[r]))


def test_next_token_after_a_final_chunk_is_refused() -> None:
    rt = tiny_runtime(tiny_hf_model("llama"), enable_prompt_logprobs=True, prefill_chunk_size=4, prefill_buckets=(4,))
    batch = ChunkBatch(seq_ids=[0], chunks=[[1, 2]], sampling=[ASK], final=[True], next_tokens=[3])
    with pytest.raises(InputError, match="next_tokens"):
        chunk_step(rt, neuronfx.init_state(rt), batch)


def test_plan_without_the_option_refuses_by_name() -> None:
    """prefill_step and generate raise SamplingParamsError naming enable_prompt_logprobs; more
    than max_logprobs is refused too; the plan still serves requests that do not ask."""
    hf = tiny_hf_model("llama")
    rt = tiny_runtime(hf, max_logprobs=K)
    state = neuronfx.init_state(rt)
    with pytest.raises(SamplingParamsError, match="enable_prompt_logprobs"):
        neuronfx.prefill_step(rt, state, PrefillBatch(seq_ids=[0], prompts=[[1, 2, 3]], sampling=[ASK]))
    with pytest.raises(SamplingParamsError, match="enable_prompt_logprobs"):
        neuronfx.generate(rt, state, [[1, 2, 3]], sampling=ASK, max_new_tokens=2)
    on = tiny_runtime(hf, enable_prompt_logprobs=True, max_logprobs=K)
    with pytest.raises(SamplingParamsError, match="max_logprobs=5"):
        neuronfx.prefill_step(on, neuronfx.init_state(on), PrefillBatch(seq_ids=[0], prompts=[[1, 2]],
                                                                        sampling=[SamplingParams(prompt_logprobs=K + 1)]))
    result, _ = neuronfx.generate(rt, state, [[1, 2, 3]], max_new_tokens=2)
    assert len(result.token_ids[0]) == 2
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_cache_key_and_prefix_caching() -> None:
    """The compile cache keys on the option; prefix caching (no logits for a cached prefix) is refused with it."""
    hf = tiny_hf_model("llama")
    assert cache_key(tiny_plan(hf)) != cache_key(tiny_plan(hf, enable_prompt_logprobs=True))
    with pytest.raises(ConfigError, match="enable_prompt_logprobs"):
        tiny_plan(hf, enable_prompt_logprobs=True, enable_prefix_caching=True, prefill_chunk_size=16, prefill_buckets=(8, 16))


def tp_prompt_logprobs(prompts: list[list[int]]) -> tuple:
    """Prompt logprobs of a ragged prefill, and of prompt 0 in chunks of 4, at tp=2 (runs on every rank)."""
    hf = tiny_hf_model("llama", vocab_size=257)
    whole = neuronfx.compile(tiny_plan(hf, tp_degree=2, enable_prompt_logprobs=True, max_logprobs=K), hf.state_dict(),
                             progress=False, cache=False)
    batch = PrefillBatch(seq_ids=list(range(len(prompts))), prompts=prompts, sampling=[ASK] * len(prompts))
    out, _ = neuronfx.prefill_step(whole, neuronfx.init_state(whole), batch)
    plan = tiny_plan(hf, tp_degree=2, enable_prompt_logprobs=True, max_logprobs=K, prefill_chunk_size=4, prefill_buckets=(4,))
    chunked = neuronfx.compile(plan, hf.state_dict(), progress=False, cache=False)
    state, entries, p = neuronfx.init_state(chunked), (), prompts[0]
    for start in range(0, len(p), 4):
        end = min(start + 4, len(p))
        step = ChunkBatch(seq_ids=[0], chunks=[p[start:end]], sampling=[ASK], final=[end == len(p)],
                          next_tokens=[p[end] if end < len(p) else None])
        chunk_out, state = chunk_step(chunked, state, step)
        entries += chunk_out.prompt_logprobs[0]
    return out.prompt_logprobs, entries


def test_tensor_parallel_matches_transformers() -> None:
    """tp=2 (vocabulary 257: padded ids on the last rank), unchunked and chunked: each block's
    logits are gathered over the vocabulary."""
    prompts = [random_prompt(n, seed) for seed, n in enumerate((9, 4))]
    hf = tiny_hf_model("llama", vocab_size=257)
    rows, chunked = neuronfx.launch(tp_prompt_logprobs, prompts, tp_degree=2, threads=1)
    for prompt, entries in zip(prompts, rows):
        check_entries(hf, prompt, entries)
    check_entries(hf, prompts[0], chunked)


@pytest.mark.parametrize(("chunk", "async_decode"), [(None, False), (4, False), (4, True)])
def test_generate_returns_prompt_logprobs(chunk: int | None, async_decode: bool) -> None:
    """generate through the scheduler (and the overlapped one), whole prompts and prompts chunked
    by 4 (a 10-token prompt goes in 3 chunks): GenerateResult.prompt_logprobs per request, None
    for one that did not ask; the generated tokens are those of a run without prompt logprobs."""
    hf = tiny_hf_model("llama")
    extra = {} if chunk is None else dict(prefill_chunk_size=chunk, prefill_buckets=(chunk,))
    rt = tiny_runtime(hf, enable_prompt_logprobs=True, max_logprobs=K, **extra)
    prompts = [random_prompt(n, seed) for seed, n in enumerate((10, 3, 6))]
    sampling = [ASK, SamplingParams(), ASK]
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, sampling=sampling, max_new_tokens=3,
                                  async_decode=async_decode)
    plain, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=3)
    assert result.token_ids == plain.token_ids and plain.prompt_logprobs is None
    assert result.prompt_logprobs[1] is None
    for r in (0, 2):
        check_entries(hf, prompts[r], result.prompt_logprobs[r])


@pytest.mark.slow
def test_smollm2_prompt_logprobs_match_transformers(smollm2) -> None:
    """SmolLM2-135M (eager): a 40-token chat prompt's logprobs and top-K at every position equal
    transformers' log_softmax on the same GGUF within 1e-4."""
    ckpt = smollm2.checkpoint
    inference = neuronfx.InferenceConfig(batch_size=1, max_context_length=64, sequence_length=72, backend="eager",
                                         enable_prompt_logprobs=True, max_logprobs=K)
    rt = neuronfx.compile(neuronfx.make_plan(ckpt.config, inference), ckpt.state_dict, progress=False)
    prompt = smollm2.tokenizer("The quick brown fox jumps over the lazy dog. " * 4)["input_ids"][:40]
    result, _ = neuronfx.generate(rt, neuronfx.init_state(rt), [prompt], sampling=ASK, max_new_tokens=1)
    check_entries(smollm2.reference, prompt, result.prompt_logprobs[0])


def test_server_echo_and_prompt_logprobs() -> None:
    """/v1/completions echo with logprobs: the prompt's text, then its tokens' logprobs (null
    first) equal to transformers', before the completion's; vLLM's prompt_logprobs extra; a
    stream echoes the prompt in its first chunk."""
    hf = tiny_hf_model("llama")
    prompt_text = "hello world"
    prompt = list(prompt_text.encode())
    want = hf_prompt_logprobs(hf, prompt)
    with serving(tiny_runtime(hf, enable_prompt_logprobs=True, max_logprobs=K)) as client:
        body = {"prompt": prompt_text, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 2, "prompt_logprobs": 3}
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        assert choice["text"].startswith(prompt_text)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 2 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        got = torch.tensor(lp["token_logprobs"][1:len(prompt)])
        assert torch.allclose(got, want[torch.arange(len(prompt) - 1), prompt[1:]], atol=ATOL)
        assert lp["text_offset"][len(prompt)] == len(prompt_text) and all(1 <= len(d) <= 2 for d in lp["top_logprobs"][1:])
        extra = choice["prompt_logprobs"]
        assert extra[0] is None and len(extra) == len(prompt)
        assert abs(extra[1][str(prompt[1])]["logprob"] - float(want[0, prompt[1]])) < ATOL
        stream = client.post("/v1/completions", json=body | {"stream": True}).text
        first = json.loads(stream.split("data: ")[1])["choices"][0]
        assert first["text"].startswith(prompt_text) and first["logprobs"]["token_logprobs"][0] is None


def test_server_refuses_prompt_logprobs_without_the_option() -> None:
    """echo with logprobs (or prompt_logprobs) on a plan without the option: a 400 naming
    enable_prompt_logprobs, then the server keeps serving; echo alone works; echo on chat is a 400."""
    with serving(tiny_runtime(tiny_hf_model("llama"), max_logprobs=K)) as client:
        for extra, param in (({"echo": True, "logprobs": 1}, "echo"), ({"prompt_logprobs": 1}, "prompt_logprobs")):
            r = client.post("/v1/completions", json={"prompt": "hi there", "max_tokens": 1} | extra)
            assert r.status_code == 400 and "enable_prompt_logprobs" in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == param
        r = client.post("/v1/completions", json={"prompt": "hi there", "max_tokens": 2, "echo": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("hi there")
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "echo": True})
        assert r.status_code == 400, r.text
