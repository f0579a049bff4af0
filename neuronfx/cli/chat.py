"""``neuronfx chat [MODEL]``: an interactive multi-turn conversation with a compiled runtime, the front end
people know from ``llama-cli``, ``mlx_lm.chat`` and ``transformers chat``.

Each user line joins the conversation, the whole conversation goes through the tokenizer's chat
template (``add_generation_prompt=True``) and is generated from with
:func:`neuronfx.stream_generate`; the reply's text deltas are printed as they come and the reply
(its text, stop strings cut) joins the conversation as the assistant's message. Nothing is kept
between turns but that text: every turn prefills the whole conversation again (no prefix reuse),
so the conversation must fit the plan's ``max_context_length``, and with the reply's
``max_new_tokens``, its ``sequence_length``. A turn that would not fit is refused with a message
saying so (and to ``/reset``); the session goes on.

Output: replies and ``/help`` on ``out``; notices (the banner, over-length, ``/reset``, a reply
cut at max tokens) on ``err``. With piped input nothing but a ``"> "`` prompt decorates the
replies.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs

import neuronfx
from neuronfx.cli.loading import load_runtime, plan_inference, with_draft_model
from neuronfx.cli.options import (
    MODEL_HELP,
    add_draft_options,
    add_plan_options,
    add_sampling_options,
    check_cli_flags,
    check_request_options,
    not_utf8,
)
from neuronfx.cli.types import Subcommand
from neuronfx.config.inference import InferenceConfig
from neuronfx.config.sampling import SamplingParams
from neuronfx.errors import InputError, NeuronfxError
from neuronfx.memory import frozen_heap
from neuronfx.runtime.generate import check_stop_strings
from neuronfx.runtime.runtime import Runtime
from neuronfx.runtime.state import State

PROMPT = "> "

SLASH_COMMANDS = {
    "/help": "list these commands",
    "/reset": "forget the conversation (the --system message stays)",
    "/exit": "leave (so do /quit and end of input, Ctrl-D)",
}
QUIT = ("/exit", "/quit")

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": text}


@attrs.frozen(kw_only=True)
class ChatOptions:
    """What every reply of a session is generated with."""

    sampling: SamplingParams
    max_new_tokens: int  # tokens per reply at most
    system: str | None = None  # the system message that starts the conversation, if any
    speculative: bool = True  # speculate when the runtime can (False: one token per step)


@attrs.frozen(kw_only=True)
class Turn:
    """One generated reply."""

    prompt_ids: tuple[int, ...]  # [T] the templated conversation the model was given
    token_ids: tuple[int, ...]  # [n] generated ids (a stopping eos included)
    text: str  # the reply as printed (stop strings cut)
    finish_reason: str  # "stop", "length" or "error" (NaN/inf logits; the reply is dropped)


def start_messages(system: str | None) -> tuple[Message, ...]:
    """The conversation before any user message: the system message, if any."""
    return () if system is None else ({"role": "system", "content": system},)


def conversation_ids(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, ending with the prompt of
    the assistant's reply. Raises InputError when the tokenizer has no chat template."""
    try:
        out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=True)
    except ValueError as exc:  # transformers: "Cannot use chat template functions ... no chat template"
        raise InputError(f"chat needs a chat template (tokenizer.chat_template) and this tokenizer has none ({exc}); pass a "
                         "tokenizer with one, or use plain prompts: neuronfx generate --prompt TEXT.") from exc
    return list(out["input_ids"])


def room_problem(runtime: Runtime, prompt_len: int, max_new_tokens: int, first_turn: bool) -> str | None:
    """Why a conversation of ``prompt_len`` tokens cannot get a reply of up to ``max_new_tokens``
    tokens from ``runtime``'s plan (a message naming the numbers and the fix), or None."""
    inference = runtime.plan.inference
    fix = ("shorten your message" if first_turn else "/reset to start a new conversation") + ", or start chat again with "
    if prompt_len > inference.max_context_length:
        return (f"the conversation with your message is {prompt_len} tokens, more than the longest prompt the plan takes "
                f"(max_context_length={inference.max_context_length}); your message was not sent. "
                f"{fix[0].upper()}{fix[1:]}a larger --max-context-length.")
    if prompt_len + max_new_tokens > inference.sequence_length:
        return (f"the conversation with your message is {prompt_len} tokens; with a reply of up to --max-new-tokens="
                f"{max_new_tokens} that is {prompt_len + max_new_tokens} > sequence_length={inference.sequence_length}; "
                f"your message was not sent. {fix[0].upper()}{fix[1:]}a lower --max-new-tokens or a larger --sequence-length.")
    return None


def stream_reply(runtime: Runtime, state: State, tokenizer: Any, prompt_ids: Sequence[int], options: ChatOptions,
                 write: Callable[[str], None]) -> tuple[Turn, State]:
    """Generate the reply to ``prompt_ids``, calling ``write`` with each text delta as it comes;
    returns the Turn and the new state (``state`` is consumed). Raises the errors of
    :func:`neuronfx.stream_generate` before any state change."""
    events = neuronfx.stream_generate(runtime, state, [list(prompt_ids)], max_new_tokens=options.max_new_tokens,
                                      sampling=options.sampling, tokenizer=tokenizer, speculative=options.speculative)
    tokens, text, reason = [], "", "length"
    for ev in events:
        if isinstance(ev, neuronfx.Finished):
            turn = Turn(prompt_ids=tuple(prompt_ids), token_ids=tuple(tokens), text=text, finish_reason=reason)
            return turn, ev.state
        if ev.token_id is not None:
            tokens.append(ev.token_id)
        if ev.text:
            text += ev.text
            write(ev.text)
        if ev.finish_reason is not None:
            reason = ev.finish_reason
    raise RuntimeError("stream_generate ended without a Finished event")  # unreachable: a schedule always ends with one


def help_text() -> str:
    """The /help text: one line per command."""
    return "".join(f"{name:8s} {what}\n" for name, what in SLASH_COMMANDS.items()) + "Any other line is your message.\n"


def chat_loop(runtime: Runtime, tokenizer: Any, options: ChatOptions, read_line: Callable[[str], str | None],
              out: TextIO, err: TextIO, seed: int = 0) -> list[Turn]:
    """Run a session until ``/exit`` or end of input (``read_line`` returns None); returns its
    turns (replies dropped by ``/reset`` included). ``read_line(prompt)`` shows ``prompt`` and
    returns the next line without its newline. Raises InputError before the first prompt when
    the tokenizer has no chat template or a stop string cannot be produced; a turn's own error
    is printed and the session goes on. Ctrl-C during a reply stops it (the reply is not kept)."""
    check_stop_strings(options.sampling, tokenizer)
    conversation_ids(tokenizer, [*start_messages(options.system), {"role": "user", "content": "hi"}])  # a template?
    state = neuronfx.init_state(runtime, seed=seed)
    messages, turns = start_messages(options.system), []
    while True:
        line = read_line(PROMPT)
        if line is None or line.strip() in QUIT:
            return turns
        message = line.strip()
        if not message:
            continue
        if message == "/help":
            out.write(help_text())
        elif message == "/reset":
            messages = start_messages(options.system)
            err.write("[conversation cleared]\n")
        elif message.startswith("/") and " " not in message:
            err.write(f"[unknown command {message}; /help lists the commands]\n")
        elif (problem := not_utf8(message)) is not None:
            err.write(f"[your message has {problem}; it was not sent. Type UTF-8 text.]\n")
        else:
            asked = (*messages, {"role": "user", "content": message})
            turn, state = _one_turn(runtime, state, tokenizer, asked, options, out, err, seed)
            if turn is not None:
                turns.append(turn)
                if turn.finish_reason != "error":
                    messages = (*asked, {"role": "assistant", "content": turn.text})
        out.flush()
        err.flush()


def _one_turn(runtime: Runtime, state: State, tokenizer: Any, messages: Sequence[Message], options: ChatOptions,
              out: TextIO, err: TextIO, seed: int) -> tuple[Turn | None, State]:
    """Reply to ``messages`` (printing it), or print why not: (the Turn or None, the state to go
    on with)."""
    ids = conversation_ids(tokenizer, messages)
    first_turn = sum(m["role"] == "user" for m in messages) == 1
    problem = room_problem(runtime, len(ids), options.max_new_tokens, first_turn)
    if problem is not None:
        err.write(f"[{problem}]\n")
        return None, state

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    try:
        turn, state = stream_reply(runtime, state, tokenizer, ids, options, write)
    # Either way the schedule may have stopped mid-way (a step error, Ctrl-C), its state consumed or
    # its slot live: go on with a fresh state (the conversation is all the next turn needs).
    except NeuronfxError as exc:
        out.write("\n")
        err.write(f"[{type(exc).__name__}: {exc}; the reply was not kept]\n")
        return None, neuronfx.init_state(runtime, seed=seed)
    except KeyboardInterrupt:
        out.write("\n")
        err.write("[interrupted; the reply was not kept]\n")
        return None, neuronfx.init_state(runtime, seed=seed)
    out.write("\n")
    if turn.finish_reason == "length":
        err.write(f"[reply cut at --max-new-tokens={options.max_new_tokens}]\n")
    elif turn.finish_reason == "error":
        err.write("[the model's logits turned NaN/inf; the reply was dropped]\n")
    return turn, state


def line_reader(stream: TextIO, out: TextIO, interactive: bool) -> Callable[[str], str | None]:
    """``read_line`` for :func:`chat_loop`: at a terminal ``input()`` (line editing through
    readline, Ctrl-D is end of input); else the prompt is written to ``out`` and a line read
    from ``stream``."""
    if interactive:
        import readline  # noqa: F401 - imported for its effect: input() gets line editing and history

        def read_tty(prompt: str) -> str | None:
            try:
                return input(prompt)
            except EOFError:
                out.write("\n")
                return None

        return read_tty

    def read_pipe(prompt: str) -> str | None:
        out.write(prompt)
        out.flush()
        line = stream.readline()
        if not line:
            out.write("\n")  # end the last prompt's line
            return None
        return line.rstrip("\n")

    return read_pipe


# --- the command ---------------------------------------------------------------------------------

DESCRIPTION = ("Chat with a model: each line you type is a user message; the reply is streamed as it is generated. Commands: "
               "/help, /reset (forget the conversation), /exit (or end of input). Reads piped stdin too (one message per "
               "line). The whole conversation is the prompt of each reply, so it must fit --max-context-length, and with "
               "--max-new-tokens, --sequence-length.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL, the system message, the sampling, draft and plan options."""
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    p.add_argument("--model", dest="model_option", default=None, metavar="MODEL", help="the same as MODEL")
    p.add_argument("--system", default=None, metavar="PROMPT", help="system message that starts the conversation (and every /reset)")
    add_sampling_options(p, max_new_tokens=256)
    add_draft_options(p)
    add_plan_options(p)
    # generate's options that a chat reply does not take (sampling_from_args reads them)
    p.set_defaults(ignore_eos=False, logprobs=None)


def check_chat_options(args: argparse.Namespace) -> tuple[ChatOptions, Path | None, InferenceConfig]:
    """chat's options checked before the load: (ChatOptions, saved runtime or None, inference
    config). Raises InputError (the model given twice, --tp-degree > 1) and the errors of the
    shared checks."""
    if args.model is not None and args.model_option is not None:
        raise InputError(f"the model is given twice ({args.model!r} and --model {args.model_option!r}); give it once.")
    args.model = args.model if args.model is not None else args.model_option
    check_cli_flags(args)
    saved, inference = plan_inference(args)
    if inference.tp_degree > 1:
        raise InputError(f"chat runs in one process; --tp-degree={inference.tp_degree} is not supported (use neuronfx "
                         "generate --chat MESSAGE, which launches the ranks).")
    options = ChatOptions(sampling=check_request_options(args, inference), max_new_tokens=args.max_new_tokens,
                          system=args.system, speculative=not args.no_speculation)
    return options, saved, inference


def run(args: argparse.Namespace) -> int:
    """Load (or compile) the runtime, then converse on stdin/stdout until /exit or end of
    input; returns the exit status (130 after Ctrl-C at the prompt)."""
    options, saved, inference = check_chat_options(args)
    if isinstance(sys.stdin, io.TextIOWrapper):  # a byte that is not UTF-8: a surrogate chat_loop refuses, not a UnicodeDecodeError
        sys.stdin.reconfigure(errors="surrogateescape")
    interactive, progress = sys.stdin.isatty(), sys.stderr.isatty()
    loaded = load_runtime(args, saved, inference, progress=progress)
    runtime = with_draft_model(args, loaded.runtime, inference, progress)
    if interactive:
        print(f"neuronfx chat: {loaded.model} ({inference.backend}, {inference.dtype}; conversations up to "
              f"{inference.max_context_length} tokens, replies up to {args.max_new_tokens}). /help lists the commands, "
              "/exit or Ctrl-D leaves.", file=sys.stderr)
    try:
        with frozen_heap():  # no full garbage collection stalls a reply (memory.py)
            chat_loop(runtime, loaded.tokenizer, options, line_reader(sys.stdin, sys.stdout, interactive), sys.stdout, sys.stderr,
                      seed=args.seed)
    except KeyboardInterrupt:  # Ctrl-C at the prompt (during a reply it only stops the reply)
        print(file=sys.stderr)
        return 130
    return 0


COMMAND = Subcommand(name="chat", help="interactive multi-turn chat through the model's chat template, replies streamed",
                     description=DESCRIPTION, add_arguments=add_arguments, run=run)
