"""``neuronfx serve`` on the real SmolLM2-135M-Instruct (eager, one server for the module): a
greedy chat and a greedy completion through the openai client give the tokens ``neuronfx
generate`` gives (the library in this process on the session's SmolLM2, conftest.py), and
``client.chat.completions.parse`` with a pydantic ``response_format`` returns a parsed object
that validates for 10 schemas x 4 seeds at temperature 0.7 (40 requests sent at once, batched;
10 seeds, 100 requests, all parsed too when structured outputs were built, 2026-12-03)."""

from __future__ import annotations

import enum
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from helpers import start_server, stop_server
from pydantic import BaseModel, Field

import neuronfx

pytestmark = pytest.mark.slow

IDS = {"return_tokens_as_token_ids": True}  # logprobs name tokens "token_id:<id>"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(["--backend", "eager", "--batch-size", "16", "--max-context-length", "128", "--sequence-length", "256",
                           "--max-waiting", "100"], tmp_path_factory.mktemp("smollm2-server") / "server.log", timeout=300)
    yield server
    stop_server(server)
    assert server.proc.returncode == 0, server.output()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def generated(smollm2, smollm2_eager, ids: list[int], max_tokens: int) -> neuronfx.GenerateResult:
    result, _ = neuronfx.generate(smollm2_eager, neuronfx.init_state(smollm2_eager), [ids], max_new_tokens=max_tokens,
                                  tokenizer=smollm2.tokenizer, speculative=False)
    return result


def test_smollm2_chat_and_completion_equal_generate(smollm2, smollm2_eager, client):
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


# --- structured outputs: 10 pydantic schemas --------------------------------------------------------

Short = Field(max_length=16)  # a sampled string ends within the token budget


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: str = Short
    age: int = Field(ge=0, le=120)


class Address(BaseModel):
    city: str = Short
    country: str = Short


class Company(BaseModel):
    name: str = Short
    address: Address
    employees: int = Field(ge=1, le=100000)


class Tags(BaseModel):
    title: str = Short
    tags: list[Annotated[str, Short]] = Field(max_length=3)


class Paint(BaseModel):
    color: Color
    finish: Literal["matte", "gloss"]


class Weather(BaseModel):
    celsius: float = Field(ge=-50, le=50)
    humidity: int = Field(ge=0, le=100)


class Contact(BaseModel):
    email: str = Short
    nickname: str | None = Field(default=None, max_length=24)
    phone: str | None = Field(default=None, max_length=16)


class Item(BaseModel):
    name: str = Short
    quantity: int = Field(ge=1, le=9)


class Order(BaseModel):
    items: list[Item] = Field(min_length=1, max_length=3)
    paid: bool


class Scores(BaseModel):
    values: list[int] = Field(max_length=4)
    best: float = Field(ge=0, le=1)


class Event(BaseModel):
    day: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")
    attendees: list[Person] = Field(max_length=2)
    online: bool | None = None


SCHEMAS = [(Person, "Describe a famous scientist."), (Company, "Describe a car company."), (Tags, "Tag a blog post about cats."),
           (Paint, "Pick a paint for a kitchen."), (Weather, "Report the weather in Paris."), (Contact, "Give a contact card."),
           (Order, "Order some fruit."), (Scores, "Score three essays."), (Event, "Plan a meeting."),
           (Address, "Where is the Eiffel tower?")]


def test_parse_pydantic_response_formats(client):
    """10 schemas (nested objects, arrays, enums, bounded numbers, optional fields, a pattern) x
    2 seeds at temperature 0.7: every answer parses (the client's ``parsed``) and validates
    against the model's JSON schema."""
    name = client.models.list().data[0].id

    def ask(job: tuple[int, int]) -> tuple[type[BaseModel], object]:
        model, question = SCHEMAS[job[0]]
        messages = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": question}]  # a short prompt
        try:
            out = client.chat.completions.parse(model=name, messages=messages, response_format=model, temperature=0.7, seed=job[1],
                                                max_tokens=160)
        except openai.LengthFinishReasonError as exc:  # the budget ran out: reported below with its text
            out = exc.completion
        return model, out.choices[0]

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, [(k, seed) for k in range(len(SCHEMAS)) for seed in range(2)]))
    failures = [(m.__name__, c.finish_reason, c.message.content) for m, c in answers
                if c.finish_reason != "stop" or not isinstance(c.message.parsed, m)]
    assert not failures, failures
    for model, choice in answers:
        jsonschema.validate(json.loads(choice.message.content), model.model_json_schema())
