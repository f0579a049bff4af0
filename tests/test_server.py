"""``neuronfx serve`` as a real subprocess on a loopback port (one per module), driven with the
official openai client and plain HTTP: greedy output token-identical to ``neuronfx generate``,
seeded sampling reproducible, usage exact, stop strings, logprobs, a load test against solo
runs and /metrics, bad input answered with OpenAI's error JSON (and the server serving on), a
client disconnecting mid-stream, a flood past --max-waiting, and SIGTERM ending in exit 0.

The model: a tiny random llama (hidden 64, 2 layers) whose vocabulary is SmolLM2's, saved with
SmolLM2's real tokenizer (from the embedded GGUF), so text, the chat template and stop strings
behave as with a real model; eager backend, 4 slots, prompts up to 64 tokens, 128 per slot.
"""

from __future__ import annotations

import asyncio
import gc
import http.client
import json
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import openai
import pytest
import uvicorn
from helpers import ServerProcess, http_request, rss_bytes, server_metrics, smollm2_vocab_model, start_server, stop_server

import neuronfx
from neuronfx import InferenceConfig, Request, SamplingParams, make_plan
from neuronfx.bench.serving_client import bench_server, inter_token_latencies, text_workload, ttft
from neuronfx.bench.workload import default_text
from neuronfx.cli import main
from neuronfx.io.checkpoints import load_checkpoint, load_tokenizer
from neuronfx.server.app import make_app
from neuronfx.server.engine import Engine, EngineOverloaded, EngineStopping, Sink
from neuronfx.server.metrics import make_metrics
from neuronfx.server.serve import GracefulServer
from neuronfx.server.served import Served

PLAN = ["--backend", "eager", "--batch-size", "4", "--max-context-length", "64", "--sequence-length", "128"]
MAX_WAITING = 12  # with 4 slots: 16 requests in the server at most
SHUTDOWN_TIMEOUT = 5
NAME = "tiny"
GREEDY = {"temperature": 0.0}
IDS = {"return_tokens_as_token_ids": True}  # logprobs name tokens "token_id:<id>": exact ids to compare
PROMPT = "The capital of France is"
QUESTION = "Write a haiku about the sea."
C, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny llama with SmolLM2's vocabulary and tokenizer, saved as an HF directory."""
    path = tmp_path_factory.mktemp("tiny-smollm2-vocab")
    smollm2_vocab_model(path, seed=11)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory) -> ServerProcess:
    server = start_server([str(model_dir), *PLAN, "--served-model-name", NAME, "--max-waiting", str(MAX_WAITING),
                           "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)], tmp_path_factory.mktemp("server") / "server.log")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@attrs.frozen(eq=False)
class Reference:
    """The same model and plan in this process: what ``neuronfx generate`` gives for a prompt alone."""

    runtime: neuronfx.Runtime
    tokenizer: object

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def chat_ids(self, question: str) -> list[int]:
        return list(self.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=True)["input_ids"])

    def solo(self, ids: list[int], max_tokens: int, **sampling: object) -> neuronfx.GenerateResult:
        result, _ = neuronfx.generate(self.runtime, neuronfx.init_state(self.runtime), [ids], max_new_tokens=max_tokens,
                                      sampling=SamplingParams(**sampling), tokenizer=self.tokenizer)
        return result


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    ckpt = load_checkpoint(model_dir)
    inference = InferenceConfig(batch_size=4, max_context_length=64, sequence_length=128, backend="eager")
    runtime = neuronfx.compile(make_plan(ckpt.config, inference), ckpt.state_dict, progress=False)
    return Reference(runtime=runtime, tokenizer=load_tokenizer(model_dir))


def token_ids(names: list[str]) -> list[int]:
    """Token ids from logprobs token names "token_id:<id>"."""
    return [int(n.removeprefix("token_id:")) for n in names]


def sse_events(resp: http.client.HTTPResponse) -> list[object]:
    """Read an SSE response to its end: the JSON of each ``data:`` line, "[DONE]" as is."""
    events = []
    for line in resp:
        line = line.decode().strip()
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# --- answers ------------------------------------------------------------------------------------


def test_health_models_tokenize_detokenize(server, client, reference):
    """503 while loading (the server listened before the model was ready), then 200; the log
    says what it compiled and when it was ready."""
    loading = _err("the model is still loading or compiling; retry when GET /health answers 200.", type="server_error",
                   code="model_not_ready")
    assert server.loading == [("/health", 503, loading), ("/v1/models", 503, loading)]
    assert "(eager, float32, 4 slots, max_context_length 64, sequence_length 128)" in server.output()  # what it loads
    assert "ready: 4 slots" in server.output()
    assert http_request(server, "GET", "/health")[::2] == (200, {"status": "ok"})
    models = client.models.list().data
    assert [(m.id, m.owned_by, m.max_model_len) for m in models] == [(NAME, "neuronfx", 128)]
    ids = reference.ids(PROMPT)
    status, _, body = http_request(server, "POST", "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert status == 200 and body == {"count": len(ids), "max_model_len": 128, "tokens": ids,
                                      "token_strs": reference.tokenizer.convert_ids_to_tokens(ids)}
    chat = reference.chat_ids(QUESTION)
    status, _, body = http_request(server, "POST", "/tokenize", {"messages": [{"role": "user", "content": QUESTION}]})
    assert status == 200 and body["tokens"] == chat
    status, _, body = http_request(server, "POST", "/detokenize", {"tokens": ids})
    assert status == 200 and body == {"prompt": PROMPT}


def test_chat_greedy_equals_neuronfx_generate(model_dir, client, capsys):
    """The same chat message through `neuronfx generate --chat` and the server (whole and
    streamed): the same tokens, text, usage and finish_reason."""
    assert main(["generate", "--model", str(model_dir), "--chat", QUESTION, "--max-new-tokens", "16", *PLAN, "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, logprobs=True, extra_body=IDS, **GREEDY)
    choice = whole.choices[0]
    assert token_ids([t.token for t in choice.logprobs.content]) == expected["token_ids"]
    assert choice.message.content == expected["text"] and choice.message.role == "assistant"
    assert choice.finish_reason == expected["finish_reason"] == "length"
    prompt_len = len(load_tokenizer(model_dir).apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                   return_dict=True)["input_ids"])
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (prompt_len, 16, prompt_len + 16)
    assert whole.id.startswith("chatcmpl-") and whole.model == NAME and whole.object == "chat.completion"
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens == prompt_len
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_greedy_logprobs_and_several_prompts(client, reference):
    ids = reference.ids(PROMPT)
    expected = reference.solo(ids, 12)
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, logprobs=3, extra_body=IDS, **GREEDY)
    choice = out.choices[0]
    assert choice.text == expected.texts[0] and choice.finish_reason == "length"
    assert token_ids(choice.logprobs.tokens) == list(expected.token_ids[0])
    assert [len(top) for top in choice.logprobs.top_logprobs] == [3] * 12
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 12)
    # token ids as the prompt, and two prompts in one request: one choice each, each its solo answer
    other = "Once upon a time"
    two = client.completions.create(model=NAME, prompt=[ids, reference.ids(other)], max_tokens=6, **GREEDY)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == [reference.solo(ids, 6).texts[0], reference.solo(reference.ids(other), 6).texts[0]]
    assert two.usage.prompt_tokens == len(ids) + len(reference.ids(other)) and two.usage.completion_tokens == 12


def test_n_choices_each_equal_its_seed_alone(client, reference):
    """n = 3 seeded: choices 0..2, choice c the prompt alone with seed + c (vLLM's rule), the
    prompt counted once in usage; two prompts x n = 2 are choices p * 2 + c; streamed chunks
    carry each choice's index and make the same texts; greedy choices are identical."""
    ids, other = reference.ids(PROMPT), reference.ids("Once upon a time")
    sampled = {"temperature": 1.0, "seed": 5}
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, n=3, **sampled)
    alone = [reference.solo(ids, 8, temperature=1.0, seed=5 + c).texts[0] for c in range(3)]
    assert [c.index for c in out.choices] == [0, 1, 2] and [c.text for c in out.choices] == alone
    assert len(set(alone)) > 1 and (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 24)
    two = client.completions.create(model=NAME, prompt=[ids, other], max_tokens=6, n=2, **sampled)
    assert [c.text for c in two.choices] == [reference.solo(p, 6, temperature=1.0, seed=5 + c).texts[0] for p in (ids, other)
                                             for c in range(2)]
    assert two.usage.prompt_tokens == len(ids) + len(other)
    chunks = list(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTION}], max_tokens=8, n=3,
                                                 stream=True, **sampled))
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == k) for k in range(3)]
    chat_ids = reference.chat_ids(QUESTION)
    assert texts == [reference.solo(chat_ids, 8, temperature=1.0, seed=5 + c).texts[0] for c in range(3)]
    greedy = client.chat.completions.create(model=NAME, messages=HI, max_tokens=6, n=2, **GREEDY)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_logprobs_equal_the_library(client, reference):
    ids = reference.ids(PROMPT)
    expected = reference.solo(ids, 5, logprobs=2)
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, logprobs=2, extra_body=IDS, **GREEDY)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs[0]], abs=1e-5)
    assert [list(top) for top in lp.top_logprobs] == [[f"token_id:{i}" for i in e.top_ids] for e in expected.logprobs[0]]
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTION}], max_tokens=3,
                                          logprobs=True, top_logprobs=2, extra_body=IDS, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    assert content[0].bytes == list(content[0].token.encode())


def test_default_max_tokens_and_streamed_choices(client, reference):
    """max_tokens defaults: 16 for a completion, the slot's room for a chat (vLLM's); several
    prompts streamed: each choice's chunks make its solo answer."""
    out = client.completions.create(model=NAME, prompt=PROMPT, extra_body={"ignore_eos": True}, **GREEDY)
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=NAME, messages=HI, extra_body={"ignore_eos": True}, **GREEDY)
    assert chat.usage.completion_tokens == 128 - chat.usage.prompt_tokens and chat.choices[0].finish_reason == "length"
    prompts = ["Once upon a time", PROMPT]
    texts = ["", ""]
    for chunk in client.completions.create(model=NAME, prompt=prompts, max_tokens=7, stream=True, **GREEDY):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [reference.solo(reference.ids(p), 7).texts[0] for p in prompts]


def test_seeded_sampling_is_reproducible(client, reference):
    """temperature 1 (the server's default) with a seed: the library's tokens for that seed,
    twice, and other tokens for another seed."""
    ids = reference.ids(PROMPT)
    expected = reference.solo(ids, 10, temperature=1.0, seed=7)

    def sample(seed: int) -> list[int]:
        out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, seed=seed, logprobs=0, extra_body=IDS)
        return token_ids(out.choices[0].logprobs.tokens)

    first = sample(7)
    assert first == list(expected.token_ids[0]) == sample(7)
    assert sample(8) != first


def test_logit_bias_and_priority(client, reference):
    """logit_bias (ids as string keys, OpenAI's) bans or forces tokens exactly as the library's
    SamplingParams.logit_bias does, on both endpoints; vLLM's priority extra is accepted."""
    ids = reference.ids(PROMPT)
    plain = list(reference.solo(ids, 6).token_ids[0])
    ban = {plain[0]: -100.0, plain[1]: -100.0}
    expected = list(reference.solo(ids, 6, logit_bias=ban).token_ids[0])
    assert expected != plain and not set(ban) & set(expected)
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, logprobs=0, logit_bias={str(t): -100 for t in ban},
                                    extra_body={**IDS, "priority": -3}, **GREEDY)
    assert token_ids(out.choices[0].logprobs.tokens) == expected
    chat_ids = reference.chat_ids(QUESTION)
    forced = reference.solo(chat_ids, 4, logit_bias={plain[2]: 100.0})
    assert list(forced.token_ids[0]) == [plain[2]] * 4
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTION}], max_tokens=4,
                                         logit_bias={str(plain[2]): 100}, extra_body={"priority": 2}, **GREEDY)
    assert out.choices[0].message.content == forced.texts[0] and out.usage.completion_tokens == 4
    for bad in ({"12x": 5}, {"49152": 1}, {"5": -100.5}):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, logit_bias=bad)
        assert info.value.body["param"] == "logit_bias", bad
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, extra_body={"priority": "high"})
    assert info.value.body["param"] == "priority"
    assert_serves(client)


def test_stop_string_honoured_whole_and_streamed(client, reference):
    ids = reference.ids(PROMPT)
    text = reference.solo(ids, 24).texts[0]
    stop = next(w for w in text.split()[2:] if w.isascii() and w.isalpha() and len(w) >= 3)
    expected = reference.solo(ids, 24, stop=(stop,))
    assert expected.texts[0] == text[: text.index(stop)] and expected.finish_reasons[0] == "stop"
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, stop=[stop, "\u00a7never\u00a7"], **GREEDY)
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason, choice.stop_reason) == (expected.texts[0], "stop", stop)
    assert out.usage.completion_tokens == len(expected.token_ids[0]) < 24
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, stop=stop, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == expected.texts[0] and chunks[-1].choices[0].finish_reason == "stop"


def partial_character_cut(reference: Reference, ids: list[int]) -> tuple[int, int, str]:
    """(seed, k, text): a seeded sample of the tiny model whose first k tokens end inside a
    multi-byte character (their decoded text ends in U+FFFD), and that text. Seed 35 does it
    (k 6) with this model; the others are tried should the model's random weights change."""
    for seed in (35, *range(100)):
        tokens = reference.solo(ids, 16, temperature=1.0, seed=seed).token_ids[0]
        for k in range(1, len(tokens) + 1):
            text = reference.tokenizer.decode(list(tokens[:k]), skip_special_tokens=True)
            if text.endswith("\ufffd"):
                return seed, k, text
    raise AssertionError("no seed in 0-99 samples a partial character")


def test_text_cut_inside_a_character_drops_its_bytes(client, reference):
    """max_tokens ending inside a multi-byte character: the text (whole, streamed, and from
    neuronfx.generate with a tokenizer) drops that character's bytes instead of ending in
    U+FFFD; its tokens still count in usage and logprobs (vLLM's behaviour)."""
    ids = reference.ids(PROMPT)
    seed, k, cut = partial_character_cut(reference, ids)
    expected = cut.rstrip("\ufffd")
    library = reference.solo(ids, k, temperature=1.0, seed=seed)
    assert library.texts[0] == expected and len(library.token_ids[0]) == k
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=k, seed=seed, logprobs=0, extra_body=IDS)
    choice = out.choices[0]
    assert choice.text == expected and not choice.text.endswith("\ufffd")
    assert out.usage.completion_tokens == k and token_ids(choice.logprobs.tokens) == list(library.token_ids[0])
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=k, seed=seed, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_explicit_null_means_the_default(server, client):
    """Every optional field of every request model given as null answers as if it were left
    out (OpenAI and vLLM accept null for "not set"); the openai client sends null for None."""
    from neuronfx.server import protocol as p

    def nulls(model: type) -> dict:
        return {name: None for name, field in model.model_fields.items() if not field.is_required()}

    seeded = {"max_tokens": 4, "seed": 5}
    for path, model, body in ((C, p.CompletionRequest, {"prompt": PROMPT}), (CHAT, p.ChatCompletionRequest, {"messages": HI}),
                              ("/tokenize", p.TokenizeRequest, {"prompt": PROMPT})):
        extra = seeded if path != "/tokenize" else {}
        status, _, with_nulls = http_request(server, "POST", path, nulls(model) | body | extra)
        status_omitted, _, omitted = http_request(server, "POST", path, body | extra)
        assert (status, status_omitted) == (200, 200), with_nulls
        key = "tokens" if path == "/tokenize" else "choices"
        assert with_nulls[key] == omitted[key] and with_nulls.get("usage") == omitted.get("usage")
    message = nulls(p.ChatMessage) | {"role": "user", "content": "hi"}
    stream = {"stream": True, "stream_options": nulls(p.StreamOptions)}
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("POST", CHAT, body=json.dumps({"messages": [message], **seeded, **stream}), headers={"Content-Type": "application/json"})
    events = sse_events(conn.getresponse())
    conn.close()
    assert events[-1] == "[DONE]" and all(e["usage"] is None for e in events[:-1])  # include_usage null: false
    whole = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, seed=5, top_p=None, n=None, logprobs=None,
                                      frequency_penalty=None, presence_penalty=None, best_of=None, echo=None, suffix=None,
                                      extra_body={"top_k": None, "min_p": None, "repetition_penalty": None, "min_tokens": None,
                                                  "ignore_eos": None, "include_stop_str_in_output": None})
    assert whole.choices[0].text == omitted_text(server, seeded)


def omitted_text(server: ServerProcess, fields: dict) -> str:
    status, _, body = http_request(server, "POST", C, {"prompt": PROMPT, **fields})
    assert status == 200, body
    return body["choices"][0]["text"]


TOOL_CHAT = [
    {"role": "user", "content": "What is 6 times 7?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'}}]},
    {"role": "tool", "content": "42", "tool_call_id": "call_1"},
]


def test_tool_messages_reach_the_chat_template(server, client, reference):
    """An assistant message with tool_calls (content null) and a tool message with its
    tool_call_id are accepted (openai client) and given to the chat template as OpenAI's
    dicts, each call's arguments parsed (as vLLM gives them); /tokenize says the same."""
    from neuronfx.server import protocol as p

    out = client.chat.completions.create(model=NAME, messages=TOOL_CHAT, max_tokens=3, **GREEDY)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    messages = p.chat_messages([p.ChatMessage.model_validate(m) for m in TOOL_CHAT])
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}]}
    assert messages[2] == {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    expected = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    status, _, body = http_request(server, "POST", "/tokenize", {"messages": TOOL_CHAT})
    assert status == 200 and body["tokens"] == list(expected["input_ids"]) and out.usage.prompt_tokens == body["count"]


def test_model_retrieve_and_head_health(server, client):
    """GET /v1/models/{id} (the openai client's models.retrieve): the served model, or OpenAI's
    404 model_not_found; HEAD /health: GET's status, no body."""
    model = client.models.retrieve(NAME)
    assert (model.id, model.object, model.owned_by, model.max_model_len) == (NAME, "model", "neuronfx", 128)
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.body == _err("The model `gpt-4o` does not exist; this server serves `tiny` (GET /v1/models).", "model",
                                      "model_not_found")["error"]
    assert http_request(server, "HEAD", "/health")[::2] == (200, "")


# guidellm 0.8.1's streamed request bodies, exactly (guidellm/backends/openai/request_handlers.py:
# TextCompletionsRequestHandler.format and ChatCompletionsRequestHandler.format, given a synthetic
# text prompt and output_tokens; its http.py drops the null "stop" before sending). httpx sends
# them with Content-Type application/json and no Authorization without an api key.
GUIDELLM_BODIES = {
    C: {"model": NAME, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "max_tokens": 16,
        "ignore_eos": True, "prompt": PROMPT},
    CHAT: {"model": NAME, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
           "max_completion_tokens": 16, "ignore_eos": True, "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]},
}


@pytest.mark.parametrize("path", list(GUIDELLM_BODIES))
def test_guidellm_stream_gives_ttft_itl_and_continuous_usage(server, path):
    """guidellm's exact body streams: its 16 tokens arrive in several chunks spread in time
    (non-zero TTFT and inter-token latencies), every chunk carries the usage so far
    (continuous_usage_stats) and the last one the total."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    t0 = time.perf_counter()
    conn.request("POST", path, body=json.dumps(GUIDELLM_BODIES[path]),
                 headers={"Content-Type": "application/json", "User-Agent": "python-httpx/0.29.0", "Accept": "*/*"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    arrivals, events = [], []
    for line in resp:
        if line.startswith(b"data: "):
            arrivals.append(time.perf_counter() - t0)
            data = line.decode().removeprefix("data: ").strip()
            events.append(data if data == "[DONE]" else json.loads(data))
    conn.close()
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    texts = [(t, c) for t, c in zip(arrivals, chunks) if c["choices"] and (c["choices"][0].get("text") or
                                                                          c["choices"][0].get("delta", {}).get("content"))]
    assert len(texts) >= 8 and texts[0][0] > 0  # TTFT
    gaps = [b[0] - a[0] for a, b in zip(texts, texts[1:])]
    assert all(g >= 0 for g in gaps) and sum(gaps) > 0  # ITL: the tokens came one step after another
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    generated = [u["completion_tokens"] for u in usages]
    assert generated == sorted(generated) and generated[-1] == 16 and usages[-1]["total_tokens"] == usages[-1]["prompt_tokens"] + 16
    assert chunks[-1]["choices"] == [] and len({u["prompt_tokens"] for u in usages}) == 1


# --- load ---------------------------------------------------------------------------------------

LOAD_PROMPTS = ["Hello", "The capital of France is", "Once upon a time there was a", "1, 2, 3, 4,",
                "def fibonacci(n):", "The quick brown fox jumps over", "Paris is", "In 1492, Columbus"]


def test_load_64_requests_16_concurrent(server, client, reference):
    """64 greedy requests (half streamed) from 16 threads, 8 bad ones among them: each good one
    gets its solo answer, each bad one its 400; /metrics counted every good request and token;
    resident memory stays within 10%."""
    jobs = [(LOAD_PROMPTS[i % 8], 4 + 2 * (i % 8), i % 2 == 1) for i in range(64)]
    solo = {(p, n): reference.solo(reference.ids(p), n) for p, n, _ in jobs[:8]}
    client.completions.create(model=NAME, prompt="warm up", max_tokens=2)
    rss_before, before = rss_bytes(server.proc.pid), server_metrics(server)

    def good(prompt: str, n: int, stream: bool) -> tuple[str, int, int]:
        if not stream:
            out = client.completions.create(model=NAME, prompt=prompt, max_tokens=n, **GREEDY)
            return out.choices[0].text, out.usage.prompt_tokens, out.usage.completion_tokens
        chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=n, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY))
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens

    def bad(prompt: str) -> object:  # temperature -1: a row that would poison its batch were it admitted
        try:
            client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=-1)
        except openai.BadRequestError as exc:
            return exc.body["param"]
        return "served"

    with ThreadPoolExecutor(16) as pool:  # one bad request after every 8 good ones, while they run
        futures = [(pool.submit(good, *job), pool.submit(bad, job[0]) if i % 8 == 7 else None) for i, job in enumerate(jobs)]
        results = [f.result() for f, _ in futures]
        bad_futures = [b for _, b in futures if b is not None]
    assert [f.result() for f in bad_futures] == ["temperature"] * 8
    for (prompt, n, _), (text, prompt_tokens, completion_tokens) in zip(jobs, results, strict=True):
        assert text == solo[prompt, n].texts[0], (prompt, n)
        assert (prompt_tokens, completion_tokens) == (len(reference.ids(prompt)), len(solo[prompt, n].token_ids[0]))
    after = server_metrics(server)

    def delta(name: str) -> float:
        return after[name] - before[name]

    finished = sum(delta(f'neuronfx_requests_total{{finish_reason="{r}"}}') for r in ("stop", "length", "abort", "error"))
    assert finished == 64 and delta('neuronfx_requests_total{finish_reason="abort"}') == 0
    assert delta("neuronfx_prompt_tokens_total") == sum(r[1] for r in results)
    assert delta("neuronfx_generation_tokens_total") == sum(r[2] for r in results)
    assert delta("neuronfx_time_to_first_token_seconds_count") == delta("neuronfx_e2e_request_latency_seconds_count") == 64
    assert delta("neuronfx_inter_token_latency_seconds_count") == sum(r[2] for r in results) - 64
    for name in ("prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_count",  # vLLM's names too
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_sum"):
        assert delta(f'vllm:{name}{{model_name="{NAME}"}}') == delta(f"neuronfx_{name}"), name
    assert (after["neuronfx_requests_running"], after["neuronfx_requests_waiting"], after["neuronfx_kv_slots_used"]) == (0, 0, 0)
    assert after["neuronfx_kv_slots"] == 4 and delta("neuronfx_requests_rejected_total") == 0
    rss_after = rss_bytes(server.proc.pid)
    assert abs(rss_after - rss_before) <= 0.10 * rss_before, (rss_before, rss_after)


# --- bad input ----------------------------------------------------------------------------------


def _err(message: str, param: str | None = None, code: str | None = None, type: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


BAD_INPUT = {
    "bad JSON": (C, b'{"prompt": "hi",', 400, _err("the request body is not valid JSON: Expecting property name enclosed in double quotes.")),
    "body not an object": (C, b"[1, 2]", 400, _err("the request body must be a JSON object (Input should be a valid dictionary or "
                                                   "object to extract fields from; got [1, 2]).")),
    "prompt missing": (C, {"max_tokens": 2}, 400, _err("prompt is required.", "prompt")),
    "prompt a number": (C, {"prompt": 5}, 400, _err("prompt must be a string, a list of strings, a list of token ids or a list of "
                                                    "lists of token ids; got 5.", "prompt")),
    "prompt ids mixed with text": (C, {"prompt": [1, "a"]}, 400, _err(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids; got [1, 'a'].", "prompt")),
    "prompt empty list": (C, {"prompt": []}, 400, _err("prompt is an empty list; give a string, a list of strings or token ids.",
                                                       "prompt")),
    "prompt empty text": (C, {"prompt": ""}, 400, _err("prompt of row 0 is empty; every prompt needs at least one token.", "prompt")),
    "token id outside the vocabulary": (C, {"prompt": [5, 49152]}, 400, _err(
        "token id 49152 is outside the vocabulary [0, 49152); check the tokenizer matches the model.", "prompt")),
    "temperature a string": (C, {"prompt": "hi", "temperature": "0.5"}, 400, _err(
        "temperature: Input should be a valid number (got '0.5').", "temperature")),
    "temperature negative": (C, {"prompt": "hi", "temperature": -1}, 400, _err(
        "SamplingParams.temperature=-1.0 must be a finite number >= 0 (<= 1e-5 means greedy).", "temperature")),
    "top_p zero": (C, {"prompt": "hi", "top_p": 0}, 400, _err("SamplingParams.top_p=0.0 must be in (0, 1]; 1 disables it.", "top_p")),
    "top_p above one": (C, {"prompt": "hi", "top_p": 1.5}, 400, _err("SamplingParams.top_p=1.5 must be in (0, 1]; 1 disables it.",
                                                                     "top_p")),
    "presence_penalty out of range": (C, {"prompt": "hi", "presence_penalty": 3}, 400, _err(
        "SamplingParams.presence_penalty=3.0 must be a finite number in [-2, 2] (vLLM's range); 0 disables it.", "presence_penalty")),
    "top_k above the plan": (C, {"prompt": "hi", "top_k": 1000}, 400, _err(
        "SamplingParams.top_k=1000 is > max_topk=256 compiled into the graphs; lower top_k or recompile with a larger max_topk.",
        "top_k")),
    "max_tokens a bool": (C, {"prompt": "hi", "max_tokens": True}, 400, _err("max_tokens: Input should be a valid integer (got True).",
                                                                             "max_tokens")),
    "max_tokens zero": (C, {"prompt": "hi", "max_tokens": 0}, 400, _err(
        "SamplingParams.max_tokens=0 must be None (until sequence_length) or an int >= 1.", "max_tokens")),
    "seed negative": (C, {"prompt": "hi", "seed": -1}, 400, _err(
        "SamplingParams.seed=-1 must be None or an int in [0, 9223372036854775807].", "seed")),
    "min_tokens over max_tokens": (C, {"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, 400, _err(
        "SamplingParams.min_tokens=9 must be <= max_tokens=4; lower min_tokens or raise max_tokens.", "min_tokens")),
    "logprobs over the plan": (C, {"prompt": "hi", "logprobs": 21}, 400, _err(
        "SamplingParams.logprobs=21 is > max_logprobs=20 compiled into the graphs; ask for fewer or recompile with a larger "
        "max_logprobs.", "logprobs")),
    "stop_token_ids outside the vocabulary": (C, {"prompt": "hi", "stop_token_ids": [49152]}, 400, _err(
        "SamplingParams.stop_token_ids=(49152,) must be a tuple/list of ints >= 0 and < vocab_size=49152.", "stop_token_ids")),
    "stop a number": (C, {"prompt": "hi", "stop": 7}, 400, _err("stop must be a string or a list of strings; got 7.", "stop")),
    "unknown field": (C, {"prompt": "hi", "best_of_all": 3}, 400, _err("Unrecognized request argument supplied: best_of_all.",
                                                                       "best_of_all")),
    "n zero": (C, {"prompt": "hi", "n": 0}, 400, _err("n=0 must be in [1, 128] (choices per prompt); lower it.", "n",
                                                      "invalid_value")),
    "n above the limit": (CHAT, {"messages": HI, "n": 129}, 400, _err("n=129 must be in [1, 128] (choices per prompt); lower it.",
                                                                      "n", "invalid_value")),
    "echo with logprobs without prompt logprobs graphs": (C, {"prompt": "hi", "echo": True, "logprobs": 1}, 400, _err(
        "SamplingParams.prompt_logprobs=1 needs graphs that return prompt logprobs; recompile with "
        "InferenceConfig(enable_prompt_logprobs=True) or drop prompt_logprobs (None).", "echo")),
    "echo on chat": (CHAT, {"messages": HI, "echo": True}, 400, _err("Unrecognized request argument supplied: echo.", "echo")),
    "logit_bias key not a token id": (C, {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, _err(
        "logit_bias key 'abc' is not a token id: keys must be integer token ids (as strings), e.g. {\"50256\": -100}.", "logit_bias")),
    "logit_bias id outside the vocabulary": (CHAT, {"messages": HI, "logit_bias": {"49152": -100}}, 400, _err(
        "SamplingParams.logit_bias={49152: -100.0} has token id 49152, outside the vocabulary: ids must be ints in [0, "
        "vocab_size=49152); drop it or use an id of this model's tokenizer.", "logit_bias")),
    "logit_bias value out of range": (C, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, _err(
        "SamplingParams.logit_bias={5: 101.0} has bias 101.0 for token 5: biases must be finite numbers in [-100, 100] (OpenAI's "
        "range); -100 bans the token, +100 forces it.", "logit_bias")),
    "priority not an integer": (C, {"prompt": "hi", "priority": 1.5}, 400, _err("priority: Input should be a valid integer (got 1.5).",
                                                                             "priority")),
    "stream_options without stream": (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, _err(
        "stream_options is only allowed with stream: true.", "stream_options")),
    "unknown model": (C, {"prompt": "hi", "model": "gpt-4o"}, 404, _err(
        "The model `gpt-4o` does not exist; this server serves `tiny` (GET /v1/models).", "model", "model_not_found")),
    "prompt longer than max_context_length": (C, {"prompt": [7] * 65}, 400, _err(
        "prompt of row 0 has 65 tokens > max_context_length=64; shorten it or compile with a larger max_context_length.",
        "prompt", "context_length_exceeded")),
    "prompt + max_tokens beyond sequence_length": (C, {"prompt": [7] * 60, "max_tokens": 69}, 400, _err(
        "prompt 0 has 60 tokens + max tokens 69 = 129 > sequence_length=128; lower max_new_tokens/max_tokens or compile with a "
        "larger sequence_length.", "max_tokens", "context_length_exceeded")),
    "messages empty": (CHAT, {"messages": []}, 400, _err("messages is empty; give at least one message.", "messages")),
    "messages missing": (CHAT, {"model": "tiny"}, 400, _err("messages is required.", "messages")),
    "message role unknown": (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, _err(
        "messages.0.role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool' (got 'robot').", "messages")),
    "message with an image": (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                              400, _err("messages.0.content must be text or a list of {\"type\": \"text\", \"text\": ...} parts "
                                        "(images and audio are not supported); got [{'type': 'image_url', 'image_url': {'url': "
                                        "'x'}}].", "messages")),
    "chat messages longer than max_context_length": (CHAT, {"messages": [{"role": "user", "content": "hi " * 70}]}, 400, _err(
        "prompt of row 0 has 101 tokens > max_context_length=64; shorten it or compile with a larger max_context_length.",
        "messages", "context_length_exceeded")),
    "top_logprobs without logprobs": (CHAT, {"messages": HI, "top_logprobs": 2}, 400, _err("top_logprobs=2 needs logprobs: true.",
                                                                                           "top_logprobs")),
    "chat logprobs an int": (CHAT, {"messages": HI, "logprobs": 3}, 400, _err("logprobs: Input should be a valid boolean (got 3).",
                                                                              "logprobs")),
    "response_format schema the grammar library rejects": (CHAT, {"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}, 400, _err(
        "response_format: StructuredOutputs.json='{\"type\":\"objekt\"}' is rejected by llguidance: Invalid type: objekt; fix the "
        "spec.", "response_format")),
    "response_format json_schema without a schema": (CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x"}}}, 400, _err("response_format of type 'json_schema' needs json_schema.schema (a JSON schema), e.g. {\"type\": "
                                  "\"json_schema\", \"json_schema\": {\"name\": \"answer\", \"schema\": {\"type\": \"object\"}}}.",
                                  "response_format")),
    "regex the grammar library rejects": (C, {"prompt": "hi", "structured_outputs": {"regex": "a("}}, 400, _err(
        "structured_outputs: StructuredOutputs.regex='a(' is rejected by llguidance: at 1(8): invalid regex \"a(\" (in regex): regex "
        "parse error: a( ^ error: unclosed group 1 | start: /a(/ ^; fix the spec.", "structured_outputs")),
    "empty choice list": (C, {"prompt": "hi", "structured_outputs": {"choice": []}}, 400, _err(
        "structured_outputs: StructuredOutputs.choice=() must be a non-empty list of non-empty strings.", "structured_outputs")),
    "grammar that allows no token at the first step": (C, {"prompt": "hi", "structured_outputs": {"grammar": "start: /[^\\s\\S]/"}},
                                                       400, _err(
        "structured_outputs: StructuredOutputs.grammar='start: /[^\\\\s\\\\S]/' allows no token at the first step (no token of this "
        "tokenizer starts a match); fix the spec.", "structured_outputs")),
    "two structured-output fields": (C, {"prompt": "hi", "response_format": {"type": "json_object"}, "guided_regex": "a"}, 400, _err(
        "response_format, guided_regex: give at most one structured-output constraint per request (response_format, "
        "structured_outputs or a guided_* field).", "guided_regex")),
    "tool with a malformed parameters schema": (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integr"}}}}}]}, 400, _err(
        "tools.0.function.parameters: StructuredOutputs.json='{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"integr\"}}}' "
        "is rejected by llguidance: Invalid type: integr; fix the spec.", "tools")),
    "tool_choice naming an unknown function": (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}],
                                                      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, _err(
        "tool_choice names function 'g', which is not in tools (f).", "tool_choice")),
    "tool_choice required without tools": (CHAT, {"messages": HI, "tool_choice": "required"}, 400, _err(
        "tool_choice='required' needs tools; give the functions in tools, or drop tool_choice.", "tool_choice")),
    "tools, and a template without a tool format": (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]},
                                                    400, _err(
        "tool_choice 'auto' needs a tool-call parser, and this model's chat template writes no known tool format; start the server "
        "with --tool-call-parser (hermes, llama3_json) and a tools-aware --chat-template, or send tool_choice 'required' or a named "
        "function.", "tool_choice")),
    "responses: unknown previous_response_id": ("/v1/responses", {"input": "hi", "previous_response_id": "resp_x"}, 404, _err(
        "Previous response with id 'resp_x' not found (responses live in this server's memory, the last 1024, and only with store: "
        "true).", "previous_response_id", "previous_response_not_found")),
    "responses: empty input": ("/v1/responses", {"input": []}, 400, _err("input is empty; give text or at least one input item.",
                                                                         "input")),
    "unknown path": ("/v1/audio/speech", {"input": "hi"}, 404, _err(
        "Invalid URL (POST /v1/audio/speech): no such endpoint; see /docs.", code="unknown_url")),
    "embeddings on a generation runtime": ("/v1/embeddings", {"input": "hi"}, 400, _err(
        "this server generates: it has no embed graphs; serve an embedding runtime with neuronfx serve --task embed "
        "(--pooling last or mean) for /v1/embeddings.", "model")),
    "detokenize outside the vocabulary": ("/detokenize", {"tokens": [1, -3]}, 400, _err(
        "token id -3 is outside the vocabulary [0, 49152); check the tokenizer matches the model.", "tokens")),
    "tokenize neither prompt nor messages": ("/tokenize", {}, 400, _err("give exactly one of prompt (text) and messages (a chat).",
                                                                        "prompt")),
    "prompt with a lone surrogate": (C, {"prompt": "\ud800", "max_tokens": 3}, 400, _err(
        "prompt has a lone UTF-16 surrogate U+D800 at character 0; send valid Unicode (a surrogate only as one half of a pair).",
        "prompt")),
    "chat content with a lone surrogate": (CHAT, {"messages": [{"role": "user", "content": "hi \udc00"}]}, 400, _err(
        "messages.0.content has a lone UTF-16 surrogate U+DC00 at character 3; send valid Unicode (a surrogate only as one half of "
        "a pair).", "messages")),
    "stop with a lone surrogate": (C, {"prompt": "hi", "stop": ["\ud800"]}, 400, _err(
        "stop.0 has a lone UTF-16 surrogate U+D800 at character 0; send valid Unicode (a surrogate only as one half of a pair).",
        "stop")),
    "tokenize a lone surrogate": ("/tokenize", {"prompt": "\ud800"}, 400, _err(
        "prompt has a lone UTF-16 surrogate U+D800 at character 0; send valid Unicode (a surrogate only as one half of a pair).",
        "prompt")),
    "field name with a lone surrogate": (C, {"prompt": "hi", "\ud800": 1}, 400, _err(
        "a field name of the request body has a lone UTF-16 surrogate (got '\\ud800'); send valid Unicode (a surrogate only as one "
        "half of a pair).")),
    "tool_call_id on a user message": (CHAT, {"messages": [{"role": "user", "content": "hi", "tool_call_id": "x"}]}, 400, _err(
        "messages.0: tool_call_id is only allowed on a message with role 'tool' (this one has role 'user') (got {'role': 'user', "
        "'content': 'hi', 'tool_call_id': 'x'}).", "messages")),
    "tool call without its function": (CHAT, {"messages": HI + [{"role": "assistant", "tool_calls": [{"id": "x", "type": "function"}]}]},
                                       400, _err("messages.1.tool_calls.0.function is required.", "messages.1.tool_calls.0.function")),
    "max_tokens 2**70": (C, {"prompt": [7], "max_tokens": 2**70}, 400, _err(
        "prompt 0 has 1 tokens + max tokens 1180591620717411303424 = 1180591620717411303425 > sequence_length=128; lower "
        "max_new_tokens/max_tokens or compile with a larger sequence_length.", "max_tokens", "context_length_exceeded")),
    "max_tokens 1e308": (C, {"prompt": "hi", "max_tokens": 1e308}, 400, _err("max_tokens: Input should be a valid integer (got 1e+308).",
                                                                             "max_tokens")),
    "continuous_usage_stats a string": (C, {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": "yes"}}, 400,
                                        _err("stream_options.continuous_usage_stats: Input should be a valid boolean (got 'yes').",
                                             "stream_options")),
}


DOC = Path(__file__).resolve().parents[1] / "docs" / "misuse.md"


def bad_input_table() -> str:
    """BAD_INPUT as the markdown table of docs/misuse.md ("The server's bad requests")."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| # | case | request | status | error message (`param`, `code`) |", "| --- | --- | --- | --- | --- |"]
    for i, (name, (path, body, status, error)) in enumerate(BAD_INPUT.items(), 1):
        raw = body.decode() if isinstance(body, bytes) else json.dumps(body)
        shown = raw if len(raw) <= 90 else raw[:87] + "..."
        e = error["error"]
        tags = ", ".join(f"`{v}`" for v in (e["param"], e["code"]) if v is not None)
        rows.append(f"| {i} | {name} | `POST {path}` `{cell(shown)}` | {status} | {cell(e['message'])}{f' ({tags})' if tags else ''} |")
    return "\n".join(rows)


def test_docs_list_the_bad_requests():
    """docs/misuse.md's server table is BAD_INPUT (regenerate it with ``python tests/test_server.py``)."""
    assert bad_input_table() in DOC.read_text()


def assert_serves(client) -> None:
    """A good request right after: the server is unharmed."""
    out = client.completions.create(model=NAME, prompt="Hello", max_tokens=2, **GREEDY)
    assert out.usage.completion_tokens == 2 and out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("case", BAD_INPUT, ids=list(BAD_INPUT))
def test_bad_input_gets_the_documented_error(server, client, case):
    path, body, status, error = BAD_INPUT[case]
    got_status, headers, got = http_request(server, "POST", path, body)
    assert (got_status, got) == (status, error)
    assert headers["content-type"] == "application/json"
    assert_serves(client)


@pytest.mark.parametrize(("path", "field"), [(C, "prompt"), (CHAT, "messages")])
def test_a_text_too_long_for_any_tokenization_is_refused_before_tokenizing(server, client, reference, path, field):
    """A text with more characters than max_context_length tokens of this vocabulary can hold
    (4 x its longest entry per token) is a 400 naming its characters, refused before the
    tokenizer runs; one character less is tokenized and refused by its token count."""
    tok = reference.tokenizer
    limit = 4 * max(len(entry) for entry in tok.get_vocab()) * 64
    empty_chat = [{"role": "user", "content": ""}]  # the chat template's own characters count too
    overhead = 0 if field == "prompt" else len(tok.apply_chat_template(empty_chat, add_generation_prompt=True, tokenize=False))
    for chars, message in ((limit + 1, f"{field} has {limit + 1} characters, more than the {limit} that max_context_length=64 "
                                       "tokens can hold; shorten it."), (limit, "tokens > max_context_length=64")):
        text = "a" * (chars - overhead)
        body = {"prompt": text} if field == "prompt" else {"messages": [{"role": "user", "content": text}]}
        status, _, got = http_request(server, "POST", path, body)
        assert (status, got["error"]["code"], got["error"]["param"]) == (400, "context_length_exceeded", field)
        assert message in got["error"]["message"], got
    assert_serves(client)


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain"])
def test_a_json_body_sent_as_another_content_type_names_the_header(server, client, content_type):
    """curl -d '{...}' without -H sends a form: the 400 names the Content-Type and the fix, not
    "must be a JSON object" about a body that is one."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        conn.request("POST", C, body=json.dumps({"prompt": "hi", "max_tokens": 2}), headers={"Content-Type": content_type})
        resp = conn.getresponse()
        status, got = resp.status, json.loads(resp.read())
    finally:
        conn.close()
    assert (status, got) == (400, _err(f"the request body was sent with Content-Type {content_type!r}; send it as JSON with the "
                                       "header Content-Type: application/json (curl: -H 'Content-Type: application/json')."))
    assert_serves(client)


def test_bench_serving_client(model_dir, server, reference, capsys):
    """6 requests, 3 concurrent: every one completes with exactly its length (ignore_eos and
    min_tokens honoured, counted from usage), its streamed text is the greedy text neuronfx
    generates for the same prompt, TTFT and ITLs come from real chunk times; the CLI's JSON
    says the same."""
    tok = reference.tokenizer
    work = text_workload(tok, default_text(), 6, (8, 32), (4, 8), seed=3)
    result, timings = bench_server(server.url, work, concurrency=3)
    assert (result.completed, result.failed, result.short) == (6, 0, 0)
    assert result.output_tokens == sum(r.max_tokens for r in work) and result.prompt_tokens == sum(r.prompt_len for r in work)
    assert all(t.usage_reported and t.output_tokens == r.max_tokens for t, r in zip(timings, work))
    assert all(0 < ttft(t) < t.done - t.sent and len(inter_token_latencies(t)) == len(t.chunks) - 1 for t in timings)
    runtime = reference.runtime  # the served plan
    ids = [tok(r.prompt)["input_ids"] for r in work]
    sampling = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in work]
    expected, _ = neuronfx.generate(runtime, neuronfx.init_state(runtime), ids, sampling=sampling, tokenizer=tok)
    assert [t.text for t in timings] == list(expected.texts)

    assert main(["bench-serving", "--server", f"tiny={server.url}", "--tokenizer", str(model_dir), "--num-requests", "6", "--concurrency",
                 "3", "--prompt-lens", "8", "32", "--gen-lens", "4", "8", "--seed", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (row,) = data["results"]
    assert (row["server"], row["completed"], row["output_tokens"]) == ("tiny", 6, result.output_tokens)
    assert data["requested_output_tokens"] == result.output_tokens


def test_wrong_method_and_the_openai_client_errors(server, client):
    assert http_request(server, "GET", C)[::2] == (405, _err("Method not allowed (GET /v1/completions); see /docs.",
                                                             code="method_not_allowed"))
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=NAME, prompt="hi", temperature=-0.5)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=HI)
    assert_serves(client)


def full_gauges(server: ServerProcess) -> dict[str, float]:
    """/metrics once the gauges show every slot taken and every waiting place filled (they are
    set once per engine iteration, so a scrape may see the iteration before); the last scrape
    after 10 s otherwise."""
    deadline = time.monotonic() + 10
    while True:
        got = server_metrics(server)
        if (got["neuronfx_requests_running"], got["neuronfx_requests_waiting"]) == (4, MAX_WAITING) or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def router_gauges(got: dict[str, float]) -> tuple[float, ...]:
    """(running, waiting, KV cache use) as neuronfx names them, then as vLLM's names do (what
    routers read: the model-server protocol's queue and KV-cache gauges)."""
    vllm = [got[f'vllm:{name}{{model_name="{NAME}"}}'] for name in ("num_requests_running", "num_requests_waiting",
                                                                        "kv_cache_usage_perc", "gpu_cache_usage_perc")]
    return got["neuronfx_requests_running"], got["neuronfx_requests_waiting"], got["neuronfx_kv_cache_usage_perc"], *vllm


def test_disconnect_frees_the_slot_and_a_flood_gets_503(server, client):
    """16 streams fill the 4 slots and the 12 waiting places; the 17th request gets 503 with
    Retry-After at once. Meanwhile the router gauges read full (4 running, 12 waiting, KV cache
    use 1.0, under neuronfx's and vLLM's names) and the limits read 4 slots, 12 waiting places and
    128 tokens. Every client then disconnects (one mid-stream): every request is aborted, every
    slot freed (/metrics: the gauges back to 0), and the server serves on."""
    before = server_metrics(server)
    body = json.dumps({"prompt": "Hello", "max_tokens": 120, "ignore_eos": True, "stream": True, **GREEDY})
    conns, resps = [], []
    for _ in range(4 + MAX_WAITING):
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        conn.request("POST", C, body=body, headers={"Content-Type": "application/json"})
        resps.append(conn.getresponse())
        conns.append(conn)
    assert [r.status for r in resps] == [200] * 16
    first = resps[0].readline().decode()  # mid-stream: the first request has its first chunk
    assert first.startswith("data: ") and json.loads(first.removeprefix("data: "))["choices"][0]["finish_reason"] is None
    t0 = time.perf_counter()
    status, headers, error = http_request(server, "POST", C, {"prompt": "Hello", "max_tokens": 1})
    assert time.perf_counter() - t0 < 2  # at once, not after a wait
    assert (status, headers["retry-after"]) == (503, "1")
    assert error == _err("the server is busy: all 4 slots are taken and 12 requests wait (--max-waiting); retry in 1 s.",
                         type="server_error", code="overloaded")
    full = full_gauges(server)
    assert router_gauges(full) == (4, MAX_WAITING, 1.0, 4, MAX_WAITING, 1.0, 1.0)
    assert (full["neuronfx_kv_slots"], full["neuronfx_requests_waiting_limit"], full["neuronfx_max_model_len"]) == (4, MAX_WAITING, 128)
    for resp, conn in zip(resps, conns):
        resp.close()
        conn.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        after = server_metrics(server)
        if after['neuronfx_requests_total{finish_reason="abort"}'] - before['neuronfx_requests_total{finish_reason="abort"}'] == 16:
            break
        time.sleep(0.05)
    assert after['neuronfx_requests_total{finish_reason="abort"}'] - before['neuronfx_requests_total{finish_reason="abort"}'] == 16
    assert after['neuronfx_requests_total{finish_reason="length"}'] == before['neuronfx_requests_total{finish_reason="length"}']
    assert (after["neuronfx_requests_running"], after["neuronfx_requests_waiting"], after["neuronfx_kv_slots_used"]) == (0, 0, 0)
    assert router_gauges(after) == (0,) * 7
    assert after["neuronfx_requests_rejected_total"] - before["neuronfx_requests_rejected_total"] == 1
    assert_serves(client)


def test_serve_rejects_bad_options_at_once(capsys):
    for args, error in ((["--max-waiting", "-1"], "InputError: --max-waiting=-1 must be >= 0"),
                        (["--port", "70000"], "InputError: --port=70000 must be in [0, 65535]"),
                        (["--tp-degree", "2"], "InputError: --tp-degree=2: serve runs in one process"),
                        (["/a", "--model", "/b"], "InputError: MODEL '/a' and --model '/b' differ"),
                        (["--chat-template", "/no/such.jinja"], "InputError: --chat-template '/no/such.jinja' is not a file"),
                        (["--backend", "neuron"], "BackendUnavailableError"),
                        (["/nonexistent/model.gguf"], "CheckpointError")):
        t0 = time.perf_counter()
        assert main(["serve", *args]) == 2, args
        assert time.perf_counter() - t0 < 5 and f"error: {error}" in capsys.readouterr().err


def test_a_chat_template_that_is_not_utf8_or_does_not_render_stops_serve(model_dir, tmp_path, capsys):
    """--chat-template in Latin-1: exit 2 before loading, naming the byte; one with a Jinja syntax
    error: the server stops when it has loaded (the template rendered once), exit 2 naming the
    template and the line, where it used to serve and answer every chat request 400."""
    latin1, broken = tmp_path / "latin1.jinja", tmp_path / "broken.jinja"
    latin1.write_bytes(b"{{ 'caf\xe9' }}")
    broken.write_text("{% if %}broken")
    t0 = time.perf_counter()
    assert main(["serve", "--chat-template", str(latin1)]) == 2
    assert time.perf_counter() - t0 < 5
    assert f"error: InputError: --chat-template '{latin1}' is not UTF-8 (byte 0xE9 at offset 7)" in capsys.readouterr().err
    assert main(["serve", str(model_dir), *PLAN, "--port", "0", "--chat-template", str(broken)]) == 2
    assert (f"neuronfx: error: InputError: --chat-template '{broken}' does not render a one-message conversation: "
            "TemplateSyntaxError (line 1): Expected an expression") in capsys.readouterr().err


def test_serve_on_a_busy_port_fails_before_loading(model_dir, capsys):
    """A second server on a port in use: exit 2 at once with one line naming the port and
    --port, before it says "serving" or loads anything."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.perf_counter()
        assert main(["serve", str(model_dir), *PLAN, "--port", str(port)]) == 2
        assert time.perf_counter() - t0 < 5
    err = capsys.readouterr().err
    assert err.splitlines() == [f"neuronfx: error: InputError: cannot listen on 127.0.0.1:{port} (--host 127.0.0.1 --port {port}): "
                                "Address already in use; another process listens there (another neuronfx serve?): stop it, or "
                                "pick a free port with --port."]


def test_signals_drain_then_a_second_sigint_stops_at_once(reference):
    """The server's signal handler (no process needed): SIGTERM starts the drain (the engine
    takes no new request, uvicorn's loop runs on while requests are in flight), another
    SIGTERM changes nothing, a SIGINT then stops at once (uvicorn's force_exit)."""
    engine = Engine(lambda: Served(runtime=reference.runtime, tokenizer=reference.tokenizer), max_waiting=0, metrics=make_metrics())
    server = GracefulServer(uvicorn.Config(make_app(engine, NAME)), engine, drain_timeout=10)
    server.handle_exit(signal.SIGTERM, None)
    assert server.drain_started is not None and not server.should_exit and not engine.ready
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(EngineStopping):
            engine.submit([Request(prompt=(1,), sampling=SamplingParams(max_tokens=1))], Sink(loop, asyncio.Queue()))
    finally:
        loop.close()
    server.handle_exit(signal.SIGTERM, None)
    assert not server.should_exit and not server.force_exit
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and server.force_exit


def test_engine_stop_aborts_what_runs_and_refuses_new_requests(reference):
    """The engine in this process: a full engine refuses at once (nothing queued); stop()
    aborts the running request (finish_reason "abort") and refuses later submits. While it
    serves, the heap is frozen (``memory.frozen_heap``); once it stops, no longer."""

    async def scenario() -> None:
        metrics = make_metrics()
        engine = Engine(lambda: Served(runtime=reference.runtime, tokenizer=reference.tokenizer), max_waiting=0, metrics=metrics)
        engine.start()
        while engine.served is None:
            await asyncio.sleep(0.01)
        long = Request(prompt=(1, 2, 3), sampling=SamplingParams(ignore_eos=True, max_tokens=120))
        sink = Sink(asyncio.get_running_loop(), asyncio.Queue())
        engine.submit([long], sink)
        assert (await sink.queue.get())[1].finish_reason is None  # running
        assert gc.get_freeze_count() > 0
        with pytest.raises(EngineOverloaded):
            engine.submit([long] * 4, Sink(asyncio.get_running_loop(), asyncio.Queue()))  # 1 + 4 > 4 slots + 0 waiting
        engine.stop(timeout=10)
        while (event := (await sink.queue.get())[1]).finish_reason is None:
            pass
        assert event.finish_reason == "abort" and event.token_id is None
        assert metrics.requests.labels("abort")._value.get() == 1 and metrics.rejected._value.get() == 1
        assert gc.get_freeze_count() == 0  # the engine thread has left its frozen block (stop joined it)
        with pytest.raises(EngineStopping):
            engine.submit([long], sink)

    asyncio.run(scenario())


# --- last: the module's server stops -------------------------------------------------------------


def stream_then_signal(server: ServerProcess, sig: int, max_tokens: int = 120) -> tuple[list[object], float]:
    """Start a greedy stream of ``max_tokens`` (usage asked), signal the server once its first
    chunk arrived, and check that the server keeps listening and answers new requests with 503
    shutting_down meanwhile; returns (the stream's events, seconds from the signal to its end)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("POST", C, body=json.dumps({"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                                             "stream_options": {"include_usage": True}, **GREEDY}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    t0 = time.perf_counter()
    server.proc.send_signal(sig)
    stopping = _err("the server is shutting down; it takes no new request.", type="server_error", code="shutting_down")
    while (health := http_request(server, "GET", "/health", timeout=5))[0] == 200 and time.perf_counter() - t0 < 5:
        time.sleep(0.01)  # the signal is handled between two ticks of uvicorn's loop
    assert health[::2] == (503, stopping)
    assert http_request(server, "POST", C, {"prompt": "Hi", "max_tokens": 2})[::2] == (503, stopping)
    events = sse_events(resp)
    conn.close()
    return events, time.perf_counter() - t0


def test_sigterm_past_the_timeout_ends_the_stream_with_an_error(model_dir, tmp_path_factory):
    """--shutdown-timeout 0: a stream still running when SIGTERM's drain times out ends with an
    error event (shutting_down), its usage and [DONE]; no traceback, exit 0."""
    server = start_server([str(model_dir), *PLAN, "--served-model-name", NAME, "--shutdown-timeout", "0"],
                          tmp_path_factory.mktemp("server-cut") / "server.log")
    try:
        events, took = stream_then_signal(server, signal.SIGTERM)
        assert events[-3] == _err("the server stopped before this request finished (its --shutdown-timeout ran out); retry.",
                                  type="server_error", code="shutting_down")
        assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and 0 < events[-2]["usage"]["completion_tokens"] < 120
        assert took < 5 and server.proc.wait(30) == 0
        log = server.output()
        assert "1 requests still running after 0.0 s (--shutdown-timeout): aborting them" in log
        assert "stopped" in log and "Traceback" not in log and "CancelledError" not in log
    finally:
        stop_server(server)


# --- last: the module's server stops -------------------------------------------------------------


def test_sigterm_finishes_in_flight_requests_and_exits_0(server):
    """SIGTERM while a request streams: the server keeps listening and answers new requests
    (and /health) with 503 shutting_down while the stream runs to its end (final chunk, usage,
    [DONE]); then it drains, stops listening and exits 0, with no traceback."""
    events, took = stream_then_signal(server, signal.SIGTERM)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 120
    assert events[-3]["choices"][0]["finish_reason"] == "length" and took < SHUTDOWN_TIMEOUT
    # the interpreter's own teardown (torch and friends) takes 1-6 s on a busy machine after serve returns
    assert server.proc.wait(SHUTDOWN_TIMEOUT + 20) == 0
    log = server.output()
    assert "signal SIGTERM: new requests get 503; finishing 1 in-flight ones" in log and "drained in" in log
    assert "stopped" in log and "Traceback" not in log


if __name__ == "__main__":
    sys.stdout.write(bad_input_table() + "\n")
