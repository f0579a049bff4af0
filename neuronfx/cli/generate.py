"""``neuronfx generate``: run prompts (raw text or chat messages) through the compiled graphs
of a checkpoint or a saved runtime; print the text (or stream it) and a timing line, or one
JSON object. ``--json-schema FILE | --regex R | --choice A B ... | --grammar FILE`` constrain
the output (structured outputs)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator

import attrs

import neuronfx
from neuronfx.cli.loading import graphs_time, load_runtime, plan_inference, saved_inference, saved_runtime, with_draft_model
from neuronfx.cli.options import (
    MODEL_HELP,
    add_async_option,
    add_draft_options,
    add_plan_options,
    add_sampling_options,
    add_structured_options,
    check_cli_flags,
    check_cli_limits,
    check_fused_flag,
    check_request_options,
    inference_from_args,
    structured_from_args,
)
from neuronfx.cli.types import Subcommand
from neuronfx.errors import InputError
from neuronfx.runtime.generate import collect


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--model, the prompts, the sampling, async, draft and plan options."""
    p.add_argument("--model", default=None, help=MODEL_HELP)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="raw prompt text; repeat for a batch")
    src.add_argument("--chat", action="append", help="user message, wrapped in the model's chat template; repeat for a batch")
    add_sampling_options(p, max_new_tokens=64)
    add_structured_options(p)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's eos")
    p.add_argument("--logprobs", type=int, default=None, metavar="N", help="return the top-N raw logprobs of every token (JSON)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    add_async_option(p)
    add_draft_options(p)
    add_plan_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def check_generate_flags(args: argparse.Namespace) -> None:
    """:func:`check_cli_flags` and generate's own: InputError for --stream with --json, and for
    --logprobs without --json (only its object prints them)."""
    check_cli_flags(args)
    if args.stream and args.json:
        raise InputError("--stream prints text as it comes; --json prints one object at the end: pick one.")
    if args.logprobs is not None and not args.json:
        raise InputError(f"--logprobs {args.logprobs}: the logprobs are printed in --json's object only; add --json.")


def tp_degree(args: argparse.Namespace) -> int:
    """The --tp-degree generate runs with (a saved runtime's when --model names one); checks
    the options first, so a bad value fails before any rank starts."""
    check_generate_flags(args)
    saved = saved_runtime(args.model)
    if saved is None:
        check_fused_flag(args)
    inference = saved_inference(args, saved) if saved is not None else inference_from_args(args)
    check_cli_limits(args, inference)
    return inference.tp_degree


def prompt_ids(tokenizer: object, args: argparse.Namespace) -> list[list[int]]:
    """Token ids of --chat messages (through the model's chat template) or --prompt texts.
    Raises InputError for --chat with a tokenizer that has no chat template."""
    if args.chat:
        try:
            return [list(tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=True)["input_ids"]) for c in args.chat]
        except ValueError as exc:  # transformers: "Cannot use chat template functions ... no chat template"
            raise InputError(f"--chat needs a chat template and this model's tokenizer has none ({exc}); use --prompt TEXT.") from exc
    texts = args.prompt or ["What is the capital of France?"]
    return [list(tokenizer(t)["input_ids"]) for t in texts]


def print_stream(events: Iterator, n: int) -> Iterator:
    """Print each text delta as it arrives (prefixed by the prompt index when several), pass the
    events on."""
    for ev in events:
        if isinstance(ev, neuronfx.TokenEvent) and ev.text:
            sys.stdout.write(ev.text if n == 1 else f"[{ev.index}] {ev.text}\n")
            sys.stdout.flush()
        elif isinstance(ev, neuronfx.Finished) and n == 1:
            sys.stdout.write("\n")
        yield ev


def run_generate(args: argparse.Namespace) -> dict:
    """Load, compile and generate; returns the JSON-able result. Options are checked before the
    (slow) load so a typo fails at once; timings exclude load and compile."""
    check_generate_flags(args)
    saved, inference = plan_inference(args)
    sampling = attrs.evolve(check_request_options(args, inference), structured=structured_from_args(args))
    loaded = load_runtime(args, saved, inference, progress=not args.json)
    runtime = with_draft_model(args, loaded.runtime, inference, progress=not args.json)
    prompts = prompt_ids(loaded.tokenizer, args)
    state = neuronfx.init_state(runtime, seed=args.seed)
    events = neuronfx.stream_generate(runtime, state, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                      tokenizer=loaded.tokenizer, speculative=not args.no_speculation,
                                      async_decode=args.async_decode)
    result, _ = collect(print_stream(events, len(prompts)) if args.stream else events, with_text=True)
    return result_json(result, len(prompts), args.stream) | {
        "load_s": loaded.load_s, "compile_s": loaded.compile_s, "graphs_from": loaded.graphs_from, "model": loaded.model,
        "backend": inference.backend, "dtype": inference.dtype,
    }


def result_json(result: neuronfx.GenerateResult, num_prompts: int, streamed: bool) -> dict:
    """The JSON-able fields of a GenerateResult: one value per field for one prompt, a list per
    field for several."""
    one = (lambda xs: xs[0]) if num_prompts == 1 else list
    logprobs = [None if lps is None else [attrs.asdict(lp) for lp in lps] for lps in result.logprobs]
    speculation = None if result.speculation is None else one([
        None if st is None else
        {"acceptance_rate": st.acceptance_rate, "mean_accepted_length": st.mean_accepted_length, **attrs.asdict(st)}
        for st in result.speculation
    ])
    return {
        "text": one(list(result.texts)), "token_ids": one([list(t) for t in result.token_ids]),
        "finish_reason": one(list(result.finish_reasons)), "stop_reason": one(list(result.stop_reasons)),
        "logprobs": one(logprobs), "streamed": streamed, "speculation": speculation,
        "num_generated": result.num_generated, "prefill_s": result.prefill_s, "decode_s": result.decode_s,
        "decode_tok_s": (result.num_generated - num_prompts) / result.decode_s if result.decode_s > 0 else None,
    }


def run(args: argparse.Namespace) -> int:
    """``neuronfx generate``: print the text (unless streamed) and a timing line, or one JSON object."""
    out = run_generate(args)
    if args.json:
        print(json.dumps(out))
        return 0
    if not out["streamed"]:
        for text in out["text"] if isinstance(out["text"], list) else [out["text"]]:
            print(text)
    print(f"[{out['num_generated']} tokens; prefill {out['prefill_s']:.3f} s, decode {out['decode_s']:.3f} s; "
          f"load {out['load_s']:.1f} s, {graphs_time(out)}]", file=sys.stderr)
    return 0


COMMAND = Subcommand(name="generate", help="generate text for a prompt (greedy by default)", add_arguments=add_arguments,
                     run=run, tp_degree=tp_degree)
