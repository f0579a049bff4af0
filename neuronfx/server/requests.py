"""HTTP requests to engine requests (llama.cpp's server "task"): the served model and its checks,
prompts tokenized or put through the chat template, and one scheduler request per prompt, checked
as the scheduler checks it; every failure an ApiError with OpenAI's status and JSON."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from neuronfx.config.sampling import SamplingParams
from neuronfx.config.structured import StructuredOutputs
from neuronfx.errors import InputError, PromptTooLongError, SamplingParamsError, SequenceLengthExceededError
from neuronfx.runtime.checks import check_prompts
from neuronfx.runtime.embed import is_embedding
from neuronfx.runtime.generate import check_stop_strings
from neuronfx.runtime.requests import Request as EngineRequest
from neuronfx.runtime.requests import check_request
from neuronfx.server import protocol as p
from neuronfx.server.engine import Engine
from neuronfx.server.served import Served
from neuronfx.server.tools import tool_schemas


def served_by(engine: Engine) -> Served:
    """The engine's runtime and tokenizer; ApiError 503 while it loads or after it stopped."""
    served = engine.served
    if served is None:
        message = "the model is still loading or compiling; retry when GET /health answers 200."
        raise p.ApiError(503, message, type="server_error", code="model_not_ready", headers={"Retry-After": "5"})
    if not engine.ready:
        raise p.ApiError(503, "the server is shutting down; it takes no new request.", type="server_error", code="shutting_down")
    return served


def stream_usage(body: p.GenerationRequest) -> str | None:
    """Where a stream reports usage: None, "last" (include_usage: one last chunk) or "every"
    (vLLM's continuous_usage_stats with include_usage: every chunk too, so far)."""
    options = body.stream_options
    if options is None or not options.include_usage:
        return None
    return "every" if options.continuous_usage_stats else "last"


def model_card(model_name: str, created: int, served: Served) -> dict:
    """The served model as /v1/models lists it (OpenAI's model object and vLLM's extras)."""
    return {"id": model_name, "object": "model", "created": created, "owned_by": "neuronfx", "root": model_name, "parent": None,
            "max_model_len": served.runtime.plan.inference.sequence_length}


def check_model(name: str | None, served_name: str) -> None:
    """ApiError 404 (OpenAI's model_not_found) when ``name`` is given and is not the served model."""
    if name is not None and name != served_name:
        raise p.ApiError(404, f"The model `{name}` does not exist; this server serves `{served_name}` (GET /v1/models).",
                         param="model", code="model_not_found")


def completion_prompts(body: p.CompletionRequest, served: Served) -> list[list[int]]:
    """Token ids of each prompt: text is tokenized (special tokens added, as vLLM); ids pass."""
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts = [prompt]
    elif not prompt:
        raise p.ApiError(400, "prompt is an empty list; give a string, a list of strings or token ids.", param="prompt")
    elif isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = prompt
    return [list(served.tokenizer(check_chars(x, served, "prompt"))["input_ids"]) if isinstance(x, str) else list(x) for x in prompts]


def check_chars(text: str, served: Served, field: str) -> str:
    """``text``, or ApiError 400 (context_length_exceeded) when it has more characters than any
    prompt of max_context_length tokens can (:func:`served.prompt_char_limit`): refused before
    the tokenizer spends seconds on it."""
    if len(text) > served.max_prompt_chars:
        inf = served.runtime.plan.inference
        raise p.ApiError(400, f"{field} has {len(text)} characters, more than the {served.max_prompt_chars} that "
                              f"max_context_length={inf.max_context_length} tokens can hold; shorten it.", param=field,
                         code="context_length_exceeded")
    return text


def chat_ids(messages: Sequence[p.ChatMessage], served: Served, add_generation_prompt: bool,
              add_special_tokens: bool = False, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The messages (and ``tools``, OpenAI's tool dicts) through the model's chat template, as
    token ids; ApiError 400 for no messages, a template that refuses them (e.g. roles out of
    order) or no template."""
    if not messages:
        raise p.ApiError(400, "messages is empty; give at least one message.", param="messages")
    return template_ids(p.chat_messages(messages), served, add_generation_prompt, tools, add_special_tokens=add_special_tokens)


def template_ids(messages: list[dict[str, Any]], served: Served, add_generation_prompt: bool,
                 tools: list[dict[str, Any]] | None = None, field: str = "messages", add_special_tokens: bool = False) -> list[int]:
    """Template-ready message dicts (:func:`protocol.chat_messages`) and ``tools`` through the
    chat template, as token ids (the rendered text tokenized, as ``apply_chat_template`` does;
    ``add_special_tokens``: /tokenize's option, the tokenizer's own on top of the template's);
    ApiError 400 naming ``field`` when the template refuses them or there is none."""
    from jinja2 import TemplateError

    extra = {} if tools is None else {"tools": tools}
    try:
        text = served.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra)
        ids = served.tokenizer(check_chars(text, served, field), add_special_tokens=add_special_tokens)["input_ids"]
    except TemplateError as exc:
        raise p.ApiError(400, f"the model's chat template refused these messages: {exc}", param=field) from exc
    except ValueError as exc:  # transformers: no chat template
        raise p.ApiError(400, f"this model's tokenizer has no chat template ({exc}); use /v1/completions.", param=field) from exc
    return list(ids)


def room(prompt: Sequence[int], served: Served) -> int:
    """Tokens left in a slot after ``prompt`` (chat's default max_tokens); ApiError 400 when none."""
    try:
        check_prompts(served.runtime, [prompt])
    except InputError as exc:
        raise prompt_error(exc, "messages") from exc
    room = served.runtime.plan.inference.sequence_length - len(prompt)
    if room < 1:
        raise p.ApiError(400, f"the messages take {len(prompt)} tokens, which leaves no room to generate in sequence_length="
                              f"{served.runtime.plan.inference.sequence_length}; shorten them.", param="messages",
                         code="context_length_exceeded")
    return room


def engine_request(body: p.GenerationRequest, prompt: list[int], index: int, served: Served, logprobs: int | None,
                    max_tokens: int, prompt_field: str, structured: StructuredOutputs | None = None,
                    structured_field: str | None = None) -> EngineRequest:
    """The scheduler request for one prompt (constrained by ``structured``, which the request's
    ``structured_field`` gave), checked as :func:`checked_request` checks it, with the body's
    ``priority`` (vLLM's extra)."""
    sampling = p.sampling_params(body, logprobs, max_tokens, structured)
    return checked_request(prompt, sampling, index, served, prompt_field, lambda exc: p.sampling_param_name(body, exc),
                           structured_field, priority=body.priority)


def checked_request(prompt: list[int], sampling: SamplingParams, index: int, served: Served, prompt_field: str,
                    param_of: Callable[[SamplingParamsError], str | None], structured_field: str | None,
                    priority: int = 0) -> EngineRequest:
    """The scheduler request for ``prompt``, checked as the scheduler would check it
    (``check_request``), its stop strings against the tokenizer and its constraint by the
    grammar library (:func:`check_constraint`); ApiError 400 otherwise (``param_of`` names the
    field of a sampling error); ``priority``: the scheduler's (lower is admitted first)."""
    if is_embedding(served.runtime):  # no generation graphs: /v1/embeddings only
        raise p.ApiError(400, "this server serves an embedding model (neuronfx serve --task embed): it has no generation graphs; "
                              "POST /v1/embeddings, or serve the model without --task embed to generate.", param="model")
    request = EngineRequest(prompt=tuple(prompt), sampling=sampling, priority=priority)  # sampling.max_tokens is the budget
    check_constraint(served, sampling.structured, structured_field)  # first: its 400 names the request's field
    try:
        check_stop_strings(sampling, served.tokenizer)
        check_request(served.runtime, index, request, served.grammars)
    except SamplingParamsError as exc:
        raise p.ApiError(400, str(exc), param=param_of(exc)) from exc
    except InputError as exc:
        raise prompt_error(exc, prompt_field) from exc
    return request


def check_constraint(served: Served, structured: StructuredOutputs | None, field: str | None) -> None:
    """ApiError 400 naming ``field`` when the grammar library rejects ``structured`` (a bad
    schema, regex or grammar, or one that allows no token at the first step)."""
    if structured is None:
        return
    try:
        served.grammars.check(structured)
    except SamplingParamsError as exc:
        raise p.ApiError(400, f"{field}: {exc}", param=field) from exc


def check_tools(served: Served, tools: Sequence[p.Tool] | None, where: str = "tools.{i}.function.parameters") -> None:
    """ApiError 400 (param "tools") when the grammar library rejects a tool's parameters schema;
    ``where`` names the schema of tool ``i`` in the request."""
    for i, structured in tool_schemas(tools or ()):
        try:
            served.grammars.check(structured)
        except SamplingParamsError as exc:
            raise p.ApiError(400, f"{where.format(i=i)}: {exc}", param="tools") from exc


def prompt_error(exc: InputError, prompt_field: str) -> p.ApiError:
    """The 400 of a prompt the plan cannot take: too long (OpenAI's "context_length_exceeded"),
    empty, or ids outside the vocabulary."""
    if isinstance(exc, SequenceLengthExceededError):
        return p.ApiError(400, str(exc), param="max_tokens", code="context_length_exceeded")
    if isinstance(exc, PromptTooLongError):
        return p.ApiError(400, str(exc), param=prompt_field, code="context_length_exceeded")
    return p.ApiError(400, str(exc), param=prompt_field)
