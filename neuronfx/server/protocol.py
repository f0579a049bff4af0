"""OpenAI's request and response shapes, as OpenAI's API and vLLM's OpenAI server define them.

Requests are pydantic models with strict types (no "0.5" for a float, no ``true`` for an int)
and unknown fields rejected, as OpenAI rejects them ("Unrecognized request argument"); vLLM's
sampling extras (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
include_stop_str_in_output) and return_tokens_as_token_ids are accepted in the body. An optional
field given as null takes its default, as OpenAI's and vLLM's servers do (clients send null for
"not set"). Every string is checked for lone UTF-16 surrogates (JSON allows ``"\\ud800"``; no
tokenizer takes one): a 400 naming the field and the character. Chat messages take OpenAI's
tool-calling shapes (an assistant message's ``tool_calls``, a tool message's ``tool_call_id``),
which go to the chat template (:func:`chat_messages`). Structured outputs (``response_format``,
vLLM's ``structured_outputs`` and its older ``guided_*`` fields) and tools (``tools``,
``tool_choice``, ``parallel_tool_calls``) are typed here and mapped in ``server/structured.py``
and ``server/tools.py``. ``logit_bias`` (OpenAI's: token ids as string keys, biases in [-100, 100]) becomes
``SamplingParams.logit_bias``; vLLM's ``priority`` extra (an int, lower is admitted first) goes to
the scheduler's request. OpenAI fields neuronfx does not implement (suffix,
best_of > 1) are accepted only at their neutral value and otherwise answered with a
400 naming the field. Completions' ``echo`` and vLLM's ``prompt_logprobs`` extra ask for the
prompt's logprobs (:func:`prompt_logprobs`; ``server/echo.py`` answers them).

Ranges are not checked here: :func:`sampling_params` builds a :class:`neuronfx.SamplingParams`,
whose named checks raise the 400s. Responses are built in ``server/responses.py``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator
from pydantic_core import PydanticCustomError

from neuronfx.config.sampling import SamplingParams, lone_surrogate
from neuronfx.config.structured import StructuredOutputs
from neuronfx.errors import SamplingParamsError
from neuronfx.runtime.fork import MAX_CHOICES

DEFAULT_TEMPERATURE = 1.0
"""Temperature of a request that gives none: OpenAI's and vLLM's 1.0 (not neuronfx's greedy 0)."""

COMPLETION_MAX_TOKENS = 16
"""max_tokens of a /v1/completions request that gives none (OpenAI's and vLLM's default)."""


class ApiError(Exception):
    """An error answered with ``status`` and OpenAI's error JSON (:func:`error_body`)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --- requests -----------------------------------------------------------------------------------


def check_text(text: str) -> str:
    """``text`` itself; PydanticCustomError "lone_surrogate" (a 400 through
    ``server.errors.validation_message``) naming the first lone UTF-16 surrogate and its character
    position: JSON's ``"\\ud800"`` decodes to one, which no tokenizer and no UTF-8 encoder takes."""
    found = lone_surrogate(text)
    if found is not None:
        raise PydanticCustomError("lone_surrogate", "a lone UTF-16 surrogate U+{code} at character {position}",
                                  {"code": f"{ord(found.group()):04X}", "position": found.start()})
    return text


Text = Annotated[StrictStr, AfterValidator(check_text)]
"""A request string: strictly a JSON string, valid Unicode (:func:`check_text`)."""


class RequestModel(BaseModel):
    """Unknown fields are errors (OpenAI: "Unrecognized request argument supplied"); an optional
    field given as null takes its default (OpenAI's and vLLM's servers accept null for every
    optional field; clients send it for "not set")."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # pydantic answers "a valid dictionary" for it
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class StreamOptions(RequestModel):
    include_usage: StrictBool = False  # one last chunk with the usage (and "usage": null on the others)
    continuous_usage_stats: StrictBool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class JsonSchemaFormat(RequestModel):
    """``response_format.json_schema`` (OpenAI's): the schema the answer's JSON follows."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Text
    description: Text | None = None
    schema_: dict[str, Any] | StrictBool | None = Field(None, alias="schema")  # None: any JSON
    strict: StrictBool | None = None  # accepted; a constrained answer always follows the schema


class ResponseFormat(RequestModel):
    """``response_format`` (OpenAI's): text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # with type "json_schema"


class StructuredOutputsBody(RequestModel):
    """vLLM's ``structured_outputs`` extra: exactly one of these (:class:`StructuredOutputs`)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | Text | StrictBool | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: StrictBool | None = None


class GenerationRequest(RequestModel):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: Text | None = None  # None: the served model (vLLM); another name is a 404
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None  # None: DEFAULT_TEMPERATURE
    top_p: StrictFloat = 1.0
    seed: StrictInt | None = None
    stop: Text | list[Text] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    n: StrictInt = 1  # choices per prompt (runtime/fork.py: the prompt is prefilled once)
    user: Text | None = None  # an end-user id: accepted and ignored (as vLLM)
    logit_bias: dict[str, StrictFloat] | None = None  # token id (a string, as JSON keys) -> bias in [-100, 100]
    # vLLM's extras
    top_k: StrictInt = 0
    min_p: StrictFloat = 0.0
    repetition_penalty: StrictFloat = 1.0
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    priority: StrictInt = 0  # vLLM's: lower is admitted first (ties in arrival order); no preemption
    return_tokens_as_token_ids: StrictBool = False  # logprobs name tokens "token_id:<id>" instead of their text
    response_format: ResponseFormat | None = None  # OpenAI's; vLLM takes it on /v1/completions too
    structured_outputs: StructuredOutputsBody | None = None  # vLLM's
    guided_json: dict[str, Any] | Text | None = None  # vLLM's older names of structured_outputs' kinds
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None


class CompletionRequest(GenerationRequest):
    """POST /v1/completions: one choice per prompt (a list of prompts gives several choices)."""

    prompt: Text | list[Text] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = None  # top-N logprobs per token
    echo: StrictBool = False  # the prompt before the completion (with logprobs: the prompt's logprobs first)
    prompt_logprobs: StrictInt | None = None  # vLLM's extra: top-N logprobs of every prompt token
    suffix: Text | None = None  # not supported: only null
    best_of: StrictInt | None = None  # not supported: only 1


class TextPart(RequestModel):
    type: Literal["text"]
    text: Text


class FunctionCall(RequestModel):
    name: Text
    arguments: Text  # the arguments as a JSON string (OpenAI's)


class ToolCall(RequestModel):
    """One call in an assistant message's ``tool_calls`` (OpenAI's shape)."""

    id: Text
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(RequestModel):
    """One chat message. ``tool_calls`` only on an assistant message (its content may then be
    null), ``tool_call_id`` only on a tool message; both go to the chat template
    (:func:`chat_messages`). Another role with either is a 400 naming the message."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # role "assistant": the calls it made
    tool_call_id: Text | None = None  # role "tool": the call this message answers

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("tool_field_role", "tool_calls is only allowed on a message with role 'assistant' "
                                      "(this one has role '{role}')", {"role": self.role})
        if self.tool_call_id is not None and self.role != "tool":
            raise PydanticCustomError("tool_field_role", "tool_call_id is only allowed on a message with role 'tool' "
                                      "(this one has role '{role}')", {"role": self.role})
        return self


class FunctionDef(RequestModel):
    """A tool's function (OpenAI's): its name and its arguments' JSON schema."""

    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # None: no arguments ({} is sent)
    strict: StrictBool | None = None  # accepted; a forced call always follows the schema


class Tool(RequestModel):
    """One of ``tools`` (OpenAI's): a function the model may call."""
    type: Literal["function"]
    function: FunctionDef


class ToolName(RequestModel):
    """The function a named ``tool_choice`` forces."""
    name: Text


class NamedToolChoice(RequestModel):
    """``tool_choice`` naming one function: the answer is a call of it."""

    type: Literal["function"]
    function: ToolName


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions: ``messages`` through the model's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None  # OpenAI's newer name of max_tokens; wins when both are given
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None  # needs logprobs: true
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: StrictBool = True  # False: at most one call per answer


class TokenizeRequest(RequestModel):
    """POST /tokenize (vLLM): ``prompt`` text, or ``messages`` through the chat template."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # default: true for a prompt, false for messages (vLLM)
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(RequestModel):
    """POST /detokenize (vLLM): token ids back to text."""

    model: Text | None = None
    tokens: list[StrictInt]


# --- requests -> neuronfx -------------------------------------------------------------------------


def check_unsupported(req: GenerationRequest) -> None:
    """ApiError 400 naming the first field set to something neuronfx does not implement."""
    if not 1 <= req.n <= MAX_CHOICES:
        raise ApiError(400, f"n={req.n} must be in [1, {MAX_CHOICES}] (choices per prompt); lower it.", param="n",
                       code="invalid_value")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true.", param="stream_options")
    if isinstance(req, CompletionRequest):
        if req.suffix is not None:
            raise ApiError(400, "suffix (insertion) is not supported by neuronfx; drop it.", param="suffix", code="unsupported_parameter")
        if req.best_of not in (None, 1):
            raise ApiError(400, f"best_of={req.best_of}: neuronfx returns one completion per prompt, so best_of must be 1.",
                           param="best_of", code="unsupported_value")
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, f"top_logprobs={req.top_logprobs} needs logprobs: true.", param="top_logprobs")


_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)=")


def sampling_params(req: GenerationRequest, logprobs: int | None, max_tokens: int,
                    structured: StructuredOutputs | None = None) -> SamplingParams:
    """The request's :class:`SamplingParams` (vLLM's defaults: temperature 1 unless given) with
    ``structured`` (``server/structured.py`` reads it from the request); ApiError 400 with the
    named check's message (and the field as ``param``) when a value is out of range."""
    try:
        return SamplingParams(
            temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature, top_k=req.top_k, top_p=req.top_p,
            min_p=req.min_p, repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=req.seed, min_tokens=req.min_tokens, max_tokens=max_tokens,
            stop=() if req.stop is None else req.stop, stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos, logprobs=logprobs, include_stop_str_in_output=req.include_stop_str_in_output,
            structured=structured, prompt_logprobs=prompt_logprobs(req), logit_bias=logit_bias(req),
        )
    except SamplingParamsError as exc:
        raise ApiError(400, str(exc), param=sampling_param_name(req, exc)) from exc


def logit_bias(req: GenerationRequest) -> dict[int, float]:
    """{token id: bias} of the request's ``logit_bias`` (JSON keys are strings: OpenAI sends ids as
    "50256"); ApiError 400 naming a key that is not an integer (ranges: SamplingParams' check)."""
    out = {}
    for key, bias in (req.logit_bias or {}).items():
        if re.fullmatch(r"-?[0-9]{1,18}", key) is None:  # not int()'s "1_0", " 5", other scripts' digits or 5000 digits
            raise ApiError(400, f"logit_bias key {key!r} is not a token id: keys must be integer token ids (as strings), "
                                "e.g. {\"50256\": -100}.", param="logit_bias")
        out[int(key)] = bias
    return out


def prompt_logprobs(req: GenerationRequest) -> int | None:
    """The top-N a completion asks of every prompt token: the larger of vLLM's ``prompt_logprobs``
    and, with ``echo``, ``logprobs`` (OpenAI's echo scores the prompt); None for neither (and for chat)."""
    if not isinstance(req, CompletionRequest):
        return None
    asked = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    return max(asked) if asked else None


def sampling_param_name(req: GenerationRequest, exc: SamplingParamsError) -> str | None:
    """The request field a SamplingParamsError names (its message starts with
    ``SamplingParams.<field>=``): chat's logprobs width is ``top_logprobs``."""
    found = _SAMPLING_FIELD.search(str(exc))
    if found is None:
        return None
    name = found.group(1)
    if name == "prompt_logprobs" and isinstance(req, CompletionRequest) and req.prompt_logprobs is None:
        return "echo"  # asked through echo with logprobs
    if name == "logprobs" and isinstance(req, ChatCompletionRequest):
        return "top_logprobs"
    if name == "max_tokens" and isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return "max_completion_tokens"
    return name


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as a chat template reads them: text parts joined by newlines and null content
    as "" (vLLM); ``name``, ``tool_calls`` and ``tool_call_id`` when given, each call's
    ``arguments`` as the JSON value its string holds (transformers' templates read a dict; vLLM
    does the same; a string that is not JSON stays a string)."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "\n".join(p.text for p in m.content)
        message: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls is not None:
            message["tool_calls"] = [_template_tool_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def _template_tool_call(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    return {"id": call.id, "type": call.type, "function": {"name": call.function.name, "arguments": arguments}}
