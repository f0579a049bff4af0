"""``neuronfx chat``: multi-turn conversations through a real chat template (SmolLM2's tokenizer,
read from the embedded GGUF) on a tiny random llama with SmolLM2's vocabulary, eager: what the
model receives each turn, /reset, the over-length message, piped stdin and a pseudo-terminal."""

from __future__ import annotations

import gc
import io
import os
import sys
from pathlib import Path

import pytest
from helpers import smollm2_vocab_model, tiny_runtime

import neuronfx
from neuronfx import SamplingParams
from neuronfx.cli import main
from neuronfx.cli.chat import ChatOptions, Turn, chat_loop, conversation_ids

ROOT = Path(__file__).resolve().parents[1]
PLAN = dict(batch_size=1, max_context_length=64, sequence_length=96, prefill_buckets=(32, 64), decode_buckets=(64, 96),
            output_logits=False)
PLAN_ARGS = ["--backend", "eager", "--batch-size", "1", "--max-context-length", "64", "--sequence-length", "96"]
NEW = 6  # reply tokens (the random model never says eos, so every reply has exactly NEW)
SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """(directory, HF model, tokenizer): a tiny random llama with SmolLM2's vocabulary and eos,
    saved with SmolLM2's tokenizer and chat template."""
    path = tmp_path_factory.mktemp("chat")
    hf, tokenizer = smollm2_vocab_model(path)
    return path, hf, tokenizer


@pytest.fixture(scope="module")
def runtime(chat_model):
    return tiny_runtime(chat_model[1], "eager", **PLAN)


def greedy(runtime, ids: list[int]) -> tuple[int, ...]:
    result, _ = neuronfx.generate(runtime, neuronfx.init_state(runtime), [ids], max_new_tokens=NEW)
    return result.token_ids[0]


def run_session(runtime, tokenizer, lines: list[str], system: str | None = None,
                max_new_tokens: int = NEW) -> tuple[list[Turn], str, str, list[str]]:
    """(turns, stdout, stderr, lines never read) of a chat_loop over ``lines`` (piped, no tty)."""
    pending, out, err = list(lines), io.StringIO(), io.StringIO()

    def read_line(prompt: str) -> str | None:
        out.write(prompt)
        return pending.pop(0) if pending else None

    options = ChatOptions(sampling=SamplingParams(), max_new_tokens=max_new_tokens, system=system)
    turns = chat_loop(runtime, tokenizer, options, read_line, out, err)
    return turns, out.getvalue(), err.getvalue(), pending


def test_turns_carry_the_conversation_reset_forgets_and_overlength_goes_on(chat_model, runtime):
    _, _, tok = chat_model
    long = " ".join(["word"] * 40)
    turns, out, err, unread = run_session(runtime, tok, ["hello", "", "how are you", long, "/reset", "hello", "/exit", "never"])
    assert unread == ["never"]  # /exit ended the session
    assert len(turns) == 3
    first, second, after_reset = turns
    # turn 1: SmolLM2's template (its default system message), the reply is the greedy tokens
    assert tok.decode(first.prompt_ids) == SMOL_SYSTEM + "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert first.token_ids == greedy(runtime, list(first.prompt_ids)) and len(first.token_ids) == NEW
    assert first.text == tok.decode(list(first.token_ids), skip_special_tokens=True) and first.finish_reason == "length"
    # turn 2: the model received the whole conversation, turn 1's reply included
    assert tok.decode(second.prompt_ids) == (SMOL_SYSTEM + "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
                                             f"{first.text}<|im_end|>\n<|im_start|>user\nhow are you<|im_end|>\n"
                                             "<|im_start|>assistant\n")
    assert second.token_ids == greedy(runtime, list(second.prompt_ids))
    # the long message did not fit: a message with the numbers and the fix, no turn, and the
    # session went on; after /reset the conversation starts over (same prompt, same reply)
    over = len(conversation_ids(tok, [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first.text},
                                      {"role": "user", "content": "how are you"}, {"role": "assistant", "content": second.text},
                                      {"role": "user", "content": long}]))
    assert (f"[the conversation with your message is {over} tokens, more than the longest prompt the plan takes "
            "(max_context_length=64); your message was not sent. /reset to start a new conversation, or start chat again "
            "with a larger --max-context-length.]\n") in err
    assert "[conversation cleared]\n" in err
    assert after_reset.prompt_ids == first.prompt_ids and after_reset.token_ids == first.token_ids
    # prompts: hello, the empty line, how are you, the long message, /reset, hello, /exit
    assert out == f"> {first.text}\n> > {second.text}\n> > > {first.text}\n> "


def test_system_message_and_no_room_for_the_reply(chat_model, runtime):
    """--system replaces the template's default; a first message that fits max_context_length
    but leaves no room for the reply in sequence_length says so, naming the numbers and the fix."""
    _, _, tok = chat_model
    msg = " ".join(["word"] * 43)
    turns, _, err, _ = run_session(runtime, tok, [msg, "hi"], system="Be brief.", max_new_tokens=40)
    n = len(conversation_ids(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": msg}]))
    assert n == 60  # <= max_context_length 64, but 60 + 40 > sequence_length 96
    assert err.startswith(f"[the conversation with your message is {n} tokens; with a reply of up to --max-new-tokens=40 that is "
                          f"{n + 40} > sequence_length=96; your message was not sent. Shorten your message, or start chat again "
                          "with a lower --max-new-tokens or a larger --sequence-length.]\n")
    assert len(turns) == 1 and len(turns[0].token_ids) == 40
    assert tok.decode(turns[0].prompt_ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                                               "<|im_start|>assistant\n")


class InterruptOnce(io.StringIO):
    """stdout whose first reply text raises KeyboardInterrupt (Ctrl-C while a reply streams)."""

    interrupted = False

    def write(self, text: str) -> int:
        if text not in ("> ", "\n") and not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return super().write(text)


def test_interrupted_reply_and_failing_turn_leave_the_session_usable(chat_model, runtime):
    """Ctrl-C during a reply: the reply and its message are dropped, the next turn runs on a
    fresh state and sees a conversation without them; a turn whose request fails says why."""
    _, _, tok = chat_model
    out, err, pending = InterruptOnce(), io.StringIO(), ["first", "hello"]

    def read_line(prompt: str) -> str | None:
        out.write(prompt)
        return pending.pop(0) if pending else None

    turns = chat_loop(runtime, tok, ChatOptions(sampling=SamplingParams(), max_new_tokens=NEW), read_line, out, err)
    assert "[interrupted; the reply was not kept]\n" in err.getvalue()
    (turn,) = turns
    assert turn.prompt_ids == tuple(conversation_ids(tok, [{"role": "user", "content": "hello"}]))
    assert turn.token_ids == greedy(runtime, list(turn.prompt_ids))
    # min_tokens over the reply's budget: every turn's request fails, says why, the session goes on
    bad = ChatOptions(sampling=SamplingParams(min_tokens=NEW + 1), max_new_tokens=NEW)
    pending, err = ["one", "two"], io.StringIO()
    turns = chat_loop(runtime, tok, bad, lambda prompt: pending.pop(0) if pending else None, io.StringIO(), err)
    assert turns == [] and not pending and err.getvalue().count(f"[SamplingParamsError: SamplingParams.min_tokens={NEW + 1} of prompt 0 is > "
                                                f"its token budget {NEW}") == 2


class FreezeRecordingInput(io.StringIO):
    """Piped stdin that notes the collector's frozen-object count at each line read."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.frozen: list[int] = []

    def readline(self, *args: object) -> str:
        self.frozen.append(gc.get_freeze_count())
        return super().readline(*args)


def test_cli_piped_stdin(chat_model, runtime, monkeypatch, capsys):
    """``neuronfx chat DIR`` with piped stdin: only "> " prompts and the streamed replies on
    stdout, /help, unknown commands, end of input exits 0. The conversation runs with the heap
    frozen (``neuronfx.frozen_heap``), which is unfrozen again when chat returns."""
    path, _, tok = chat_model
    stdin = FreezeRecordingInput("hi\n/help\n/nope\n")
    monkeypatch.setattr(sys, "stdin", stdin)
    assert main(["chat", str(path), *PLAN_ARGS, "--max-new-tokens", str(NEW), "--system", "Be brief."]) == 0
    assert len(stdin.frozen) == 4 and min(stdin.frozen) > 0 and gc.get_freeze_count() == 0
    out, err = capsys.readouterr()
    ids = conversation_ids(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    reply = tok.decode(list(greedy(runtime, ids)), skip_special_tokens=True)
    help_lines = ("/help    list these commands\n/reset   forget the conversation (the --system message stays)\n"
                  "/exit    leave (so do /quit and end of input, Ctrl-D)\nAny other line is your message.\n")
    assert out == f"> {reply}\n> {help_lines}> > \n"
    assert "[unknown command /nope; /help lists the commands]" in err and "neuronfx chat:" not in err  # no banner when piped


@pytest.mark.parametrize("args, error", [
    (["MODEL", "--model", "MODEL"], "InputError: the model is given twice"),
    (["--tp-degree", "2"], "InputError: chat runs in one process"),
    (["--temperature", "-1"], "SamplingParamsError"),
    (["--max-new-tokens", "600"], "SequenceLengthExceededError"),
    (["--min-tokens", "9", "--max-new-tokens", "8"], "SamplingParamsError: --min-tokens=9 is > --max-new-tokens=8"),
    # b"caf\xe9" from a Latin-1 shell: Python's argv decoding (surrogateescape) makes the byte U+DCE9
    (["--system", "caf\udce9"], "InputError: --system 'caf\\udce9' has byte 0xE9 at character 3, which is not UTF-8"),
])
def test_cli_rejects_bad_options_before_loading(chat_model, capsys, args, error):
    assert main(["chat", *[str(chat_model[0]) if a == "MODEL" else a for a in args]]) == 2
    assert f"neuronfx: error: {error}" in capsys.readouterr().err


def test_a_line_that_is_not_utf8_is_refused_and_the_session_goes_on(chat_model, runtime):
    """A piped line holding a byte that is not UTF-8 (stdin's surrogateescape: 0xFF -> U+DCFF) is
    not sent (the tokenizer would raise on it); the session answers the next line."""
    _, _, tok = chat_model
    turns, _, err, pending = run_session(runtime, tok, ["\udcff\udcfe x", "hi"])
    assert "[your message has byte 0xFF at character 0, which is not UTF-8; it was not sent. Type UTF-8 text.]" in err
    assert pending == [] and len(turns) == 1
    assert turns[0].token_ids == greedy(runtime, conversation_ids(tok, [{"role": "user", "content": "hi"}]))


def test_piped_bytes_that_are_not_utf8_under_a_strict_stdin(chat_model, runtime):
    """Under a stdin that decodes strictly (PYTHONIOENCODING=utf-8:strict, as a UTF-8 locale other
    than C.UTF-8 gives) a piped line holding a byte that is not UTF-8 is refused and the session
    answers the next line (chat reconfigures stdin to surrogateescape), where it used to end on a
    UnicodeDecodeError."""
    import subprocess

    path, _, tok = chat_model
    done = subprocess.run([sys.executable, "-m", "neuronfx", "chat", "--model", str(path), *PLAN_ARGS, "--max-new-tokens", str(NEW)],
                          input=b"\xff\xfe x\nhi\n", capture_output=True, cwd=str(ROOT), timeout=120,
                          env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8:strict"})
    assert done.returncode == 0, done.stderr.decode()
    reply = tok.decode(list(greedy(runtime, conversation_ids(tok, [{"role": "user", "content": "hi"}]))), skip_special_tokens=True)
    assert done.stdout.decode() == f"> > {reply}\n> \n"
    assert "[your message has byte 0xFF at character 0, which is not UTF-8; it was not sent. Type UTF-8 text.]" in done.stderr.decode()


def test_pseudo_terminal_session(chat_model, runtime):
    """A real terminal: the banner, "> " prompts, a streamed reply, /reset, /exit, exit status 0."""
    import pexpect

    path, _, tok = chat_model
    child = pexpect.spawn(sys.executable, ["-m", "neuronfx", "chat", "--model", str(path), *PLAN_ARGS, "--max-new-tokens",
                                           str(NEW)], cwd=str(ROOT), encoding="utf-8", timeout=90, env=os.environ | {"OMP_NUM_THREADS": "1"})
    try:
        child.expect_exact("/help lists the commands, /exit or Ctrl-D leaves.")
        child.expect_exact("> ")
        child.sendline("hello")
        ids = conversation_ids(tok, [{"role": "user", "content": "hello"}])
        reply = tok.decode(list(greedy(runtime, ids)), skip_special_tokens=True)
        child.expect_exact(reply)
        child.expect_exact("> ")
        child.sendline("/reset")
        child.expect_exact("[conversation cleared]")
        child.expect_exact("> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before


def test_no_chat_template_is_an_error(runtime):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))
    with pytest.raises(neuronfx.errors.InputError, match=r"chat needs a chat template \(tokenizer.chat_template\)"):
        chat_loop(runtime, plain, ChatOptions(sampling=SamplingParams(), max_new_tokens=2), lambda p: "hi", io.StringIO(), io.StringIO())
