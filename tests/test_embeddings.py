"""Embeddings (``InferenceConfig(task="embed")``, ``neuronfx.embed``, /v1/embeddings): pooled
vectors of tiny random llama and qwen3 models within 1e-5 of transformers' final hidden states
pooled the same way, on every backend, through the compile cache and save/load, read from a
Qwen3-Embedding-style checkpoint (bare decoder, sentence-transformers config), and served to the
official openai client; each misuse a named error or a 400, and the server serves on."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from helpers import TINY_INFERENCE, byte_tokenizer, random_prompt, serving, tiny_hf_model, tiny_runtime

import neuronfx
from neuronfx.config import InferenceConfig, ModelConfig, make_plan
from neuronfx.errors import ConfigError, EmptyPromptError, InputError, PromptTooLongError
from neuronfx.io.checkpoints import load_checkpoint
from neuronfx.io.sentence_transformers import pooling_config

LENGTHS = (5, 1, 32, 9, 17, 3)  # ragged, more prompts than batch_size (4): two graph calls, longest first
PROMPTS = [random_prompt(n, seed=n) for n in LENGTHS]


def hf_pooled(hf, prompts, pooling: str, normalize: bool) -> torch.Tensor:
    """transformers' ``model.model(ids).last_hidden_state`` (final norm included) of each
    prompt alone, pooled by its last token or its mean, L2-normalised when asked."""
    rows = []
    with torch.no_grad():
        for p in prompts:
            h = hf.model(torch.tensor([p])).last_hidden_state[0]
            rows.append(h[-1] if pooling == "last" else h.mean(0))
    out = torch.stack(rows)
    return torch.nn.functional.normalize(out, dim=-1) if normalize else out


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize(("pooling", "normalize"), [("last", True), ("last", False), ("mean", True), ("mean", False)])
def test_pooled_vectors_match_transformers(model_type, pooling, normalize):
    hf = tiny_hf_model(model_type)
    rt = tiny_runtime(hf, task="embed", pooling=pooling, normalize=normalize)
    assert {g.phase for g in rt.plan.graphs} == {"embed"} and rt.plan.kv.nbytes < 2**16  # no generation graphs, no real cache
    got = neuronfx.embed(rt, PROMPTS)
    assert got.dtype == torch.float32 and got.shape == (len(PROMPTS), hf.config.hidden_size)
    torch.testing.assert_close(got, hf_pooled(hf, PROMPTS, pooling, normalize), atol=1e-5, rtol=0)
    if normalize:
        torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(PROMPTS)), atol=1e-6, rtol=0)


def test_export_through_the_compile_cache_and_save_load(tmp_path):
    """export: the vectors of eager; a second compile loads the cache entry; a saved runtime
    loads to the same plan and the same vectors."""
    hf = tiny_hf_model("qwen3")
    want = hf_pooled(hf, PROMPTS, "last", True)
    plan_args = {"task": "embed", "prefill_buckets": (8, 32)}
    plan = make_plan(ModelConfig.from_hf(hf.config), InferenceConfig(**(TINY_INFERENCE | plan_args | {"backend": "export",
                                                                                                     "batch_buckets": (4,)})))
    rt = neuronfx.compile(plan, hf.state_dict(), progress=False, cache=tmp_path / "cache")
    torch.testing.assert_close(neuronfx.embed(rt, PROMPTS), want, atol=1e-5, rtol=0)
    again = neuronfx.compile(plan, hf.state_dict(), progress=False, cache=tmp_path / "cache")
    assert again.from_cache and torch.equal(neuronfx.embed(again, PROMPTS), neuronfx.embed(rt, PROMPTS))
    loaded = neuronfx.load(neuronfx.save(rt, tmp_path / "rt"))
    assert loaded.plan == rt.plan
    assert torch.equal(neuronfx.embed(loaded, PROMPTS), neuronfx.embed(rt, PROMPTS))


def test_inductor_matches_transformers():
    hf = tiny_hf_model("llama")
    # one graph (batch 2, bucket 32): three prompts take two calls, the second padded
    rt = tiny_runtime(hf, "inductor", task="embed", pooling="mean", batch_size=2, batch_buckets=(2,), prefill_buckets=(32,))
    prompts = PROMPTS[:3]
    torch.testing.assert_close(neuronfx.embed(rt, prompts), hf_pooled(hf, prompts, "mean", True), atol=1e-5, rtol=0)


def write_qwen3_embedding_dir(path, pooling_flag: str, normalize: bool) -> object:
    """A tiny Qwen3-Embedding-style directory: the bare decoder (transformers' Qwen3Model: no
    ``model.`` prefix, no LM head, untied) and its sentence-transformers modules."""
    hf = tiny_hf_model("qwen3", tie_word_embeddings=False)
    hf.model.save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    flags = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": False}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64} | flags | {pooling_flag: True}))
    return hf


def test_qwen3_embedding_layout_and_sentence_transformers_config(tmp_path):
    hf = write_qwen3_embedding_dir(tmp_path, "pooling_mode_lasttoken", normalize=True)
    assert pooling_config(tmp_path) == {"pooling": "last", "normalize": True}
    assert pooling_config(tmp_path / "1_Pooling") is None  # no modules.json
    checkpoint = load_checkpoint(tmp_path)
    assert "model.embed_tokens.weight" in checkpoint.state_dict
    plan = make_plan(checkpoint.config, InferenceConfig(**(TINY_INFERENCE | {"backend": "eager", "task": "embed"}
                                                           | pooling_config(tmp_path))), checkpoint=str(tmp_path))
    rt = neuronfx.compile(plan, progress=False)
    torch.testing.assert_close(neuronfx.embed(rt, PROMPTS), hf_pooled(hf, PROMPTS, "last", True), atol=1e-5, rtol=0)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(neuronfx.errors.UnsupportedModelError, match="--pooling last or mean"):
        pooling_config(tmp_path)


def test_misuse_is_a_named_error_before_anything_changes():
    hf = tiny_hf_model("llama")
    embedder, generator = tiny_runtime(hf, task="embed"), tiny_runtime(hf)
    with pytest.raises(ConfigError, match="task='embed'"):
        neuronfx.embed(generator, PROMPTS)
    with pytest.raises(ConfigError, match=r"neuronfx.embed\(runtime, ids\)"):
        neuronfx.init_state(embedder)
    with pytest.raises(PromptTooLongError, match="33 tokens > max_context_length=32"):
        neuronfx.embed(embedder, [[1, 2], [1] * 33])
    with pytest.raises(EmptyPromptError):
        neuronfx.embed(embedder, [[1], []])
    for bad in ([], "hello", [1, 2]):
        with pytest.raises(InputError):
            neuronfx.embed(embedder, bad)
    with pytest.raises(ConfigError, match="speculation_length=2"):
        InferenceConfig(task="embed", speculation_length=2)
    with pytest.raises(ConfigError, match="pooling"):
        InferenceConfig(task="embed", pooling="cls")
    assert neuronfx.embed(embedder, PROMPTS[:1]).shape == (1, 64)  # still serves


def test_server_embeddings_with_the_openai_client():
    """client.embeddings.create over a list of inputs (the client asks for base64): the vectors
    of neuronfx.embed, in input order, with usage; float encoding too; a completion on the
    embedding server and a bad input are 400s, and the server serves on."""
    hf = tiny_hf_model("qwen3")
    rt = tiny_runtime(hf, task="embed")
    texts = ["hello world", "a", "the quick brown fox"]
    ids = [list(t.encode()) for t in texts]
    want = neuronfx.embed(rt, ids)
    with serving(rt) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="embedding model"):
            client.completions.create(model="tiny", prompt="hi", max_tokens=1)
        with pytest.raises(openai.BadRequestError, match="max_context_length"):
            client.embeddings.create(model="tiny", input=["x" * 40])
        limit = 4 * max(len(entry) for entry in byte_tokenizer().get_vocab()) * 32  # refused before it is tokenized
        with pytest.raises(openai.BadRequestError, match=f"input has {limit + 1} characters, more than the {limit} that "):
            client.embeddings.create(model="tiny", input=["x" * (limit + 1)])
        out = client.embeddings.create(model="tiny", input=texts)
        assert [d.index for d in out.data] == [0, 1, 2] and out.model == "tiny"
        torch.testing.assert_close(torch.tensor([d.embedding for d in out.data]), want, atol=1e-6, rtol=0)
        assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
        body = http.post("/v1/embeddings", json={"input": ids[1], "encoding_format": "float"}).json()
        assert torch.allclose(torch.tensor(body["data"][0]["embedding"]), want[1], atol=1e-6)


def test_server_generation_runtime_refuses_embeddings():
    hf = tiny_hf_model("llama")
    with serving(tiny_runtime(hf)) as http:
        bad = http.post("/v1/embeddings", json={"input": "hi"})
        assert bad.status_code == 400 and "--task embed" in bad.json()["error"]["message"]
        good = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2
