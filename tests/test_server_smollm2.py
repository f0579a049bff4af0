"""``neuronfx serve`` on the real SmolLM2-135M-Instruct (eager, one server start): a greedy chat
and a greedy completion through the openai client give the tokens ``neuronfx generate`` gives
(the library in this process on the session's SmolLM2, conftest.py)."""

from __future__ import annotations

import openai
import pytest
from helpers import start_server, stop_server

import neuronfx

pytestmark = pytest.mark.slow

IDS = {"return_tokens_as_token_ids": True}  # logprobs name tokens "token_id:<id>"


def generated(smollm2, smollm2_eager, ids: list[int], max_tokens: int) -> neuronfx.GenerateResult:
    result, _ = neuronfx.generate(smollm2_eager, neuronfx.init_state(smollm2_eager), [ids], max_new_tokens=max_tokens,
                                  tokenizer=smollm2.tokenizer, speculative=False)
    return result


def test_smollm2_chat_and_completion_equal_generate(smollm2, smollm2_eager, tmp_path):
    server = start_server(["--backend", "eager", "--batch-size", "2", "--max-context-length", "128", "--sequence-length", "256"],
                          tmp_path / "server.log", timeout=300)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        question = "What is the capital of France?"
        chat_ids = list(smollm2.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                              tokenize=True, return_dict=True)["input_ids"])
        expected = generated(smollm2, smollm2_eager, chat_ids, 16)
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": question}], max_tokens=16,
                                              temperature=0, logprobs=True, extra_body=IDS)
        choice = chat.choices[0]
        assert [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content] == list(expected.token_ids[0])
        assert choice.message.content == expected.texts[0] and "Paris" in choice.message.content
        assert choice.finish_reason == expected.finish_reasons[0]
        assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(chat_ids), len(expected.token_ids[0]))
        prompt = "The capital of France is"
        expected = generated(smollm2, smollm2_eager, list(smollm2.tokenizer(prompt)["input_ids"]), 8)
        out = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0, logprobs=0, extra_body=IDS)
        assert [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens] == list(expected.token_ids[0])
        assert out.choices[0].text == expected.texts[0]
    finally:
        stop_server(server)
    assert server.proc.returncode == 0, server.output()
