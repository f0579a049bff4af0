"""``neuronfx bench serving``: load OpenAI-compatible servers (``neuronfx serve``, llama.cpp's,
vLLM's) over HTTP with the official openai client. The same streamed /v1/completions workload
goes to each server in turn (real-text prompts, greedy, full lengths: max_tokens = min_tokens
and ignore_eos) with --concurrency requests in flight; one row per server: output tok/s, TTFT
and inter-token latency p50/p90/p99, mean TPOT (vLLM's benchmark_serving definitions).
``--launch neuronfx`` / ``--launch llama.cpp`` start those servers on the same model for the
run. Needs the openai package (pip install 'neuronfx[bench]')."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

import attrs

from neuronfx.bench.options import check_at_least
from neuronfx.bench.serving_client import ServingRequest, format_table, import_openai, parse_server, run_benchmark, text_workload
from neuronfx.bench.spawn import LAUNCHABLE, free_port, launched, server_command
from neuronfx.bench.types import Benchmark
from neuronfx.bench.workload import check_range, default_text
from neuronfx.errors import InputError
from neuronfx.io import checkpoints


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The servers, the workload, the client's options and the --launch options."""
    p.add_argument("--server", action="append", default=[], metavar="[LABEL=]URL",
                   help="server base URL, e.g. http://127.0.0.1:8000 (or LABEL=URL for the row's name); repeat for one row each")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at a time (default 8)")
    p.add_argument("--prompt-lens", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"),
                   help="prompt tokens, drawn uniformly (default 32 512)")
    p.add_argument("--gen-lens", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"),
                   help="generated tokens per request, drawn uniformly (default 16 256)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's draws (same seed, same requests)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="HF directory or .gguf whose tokenizer sizes the prompts (default: --model)")
    p.add_argument("--text-file", default=None, metavar="FILE",
                   help="UTF-8 text the prompts are cut from (default: public-domain passages shipped with neuronfx)")
    p.add_argument("--model-name", default=None, help="the requests' model field (default: the server's first /v1/models id)")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="send only max_tokens (no min_tokens / ignore_eos): requests may stop at eos")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default 600)")
    add_launch_arguments(p)


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    """--launch, and the model, threads, options and start-up time of launched servers."""
    p.add_argument("--launch", action="append", default=[], choices=LAUNCHABLE,
                   help="start this server of --model for the run (a row each, in this order, before the --server rows): "
                        "neuronfx serve with --concurrency slots holding the longest prompt and generation, or "
                        "llama-cpp-python's server (the [bench] extra; one request at a time); repeatable")
    p.add_argument("--model", default=None, help="the model launched servers serve (default: the SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--threads", type=int, default=2, help="threads of each launched server (OMP_NUM_THREADS; default 2)")
    p.add_argument("--serve-args", default="", help="more options for a launched neuronfx serve, e.g. \"--weight-format gguf\"")
    p.add_argument("--ready-timeout", type=float, default=1200.0, help="seconds a launched server may take to start (default 1200)")


def check_options(args: argparse.Namespace) -> tuple[tuple[int, int], tuple[int, int], str]:
    """(prompt range, generation range, prompt text), checked before the tokenizer is read.
    Raises BackendUnavailableError without openai, InputError for a bad value or no server."""
    import_openai()
    prompt_range, gen_range = check_range("prompt-lens", args.prompt_lens, 1), check_range("gen-lens", args.gen_lens, 1)
    check_at_least("num_requests", args.num_requests, 1)
    check_at_least("concurrency", args.concurrency, 1)
    check_at_least("threads", args.threads, 1)
    if not args.server and not args.launch:
        raise InputError("no server to load: give --server URL (repeatable) or --launch neuronfx / --launch llama.cpp.")
    for spec in args.server:
        parse_server(spec)
    try:
        text = Path(args.text_file).read_text(encoding="utf-8") if args.text_file else default_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--text-file {args.text_file!r} cannot be read as UTF-8 text: {exc}.") from exc
    return prompt_range, gen_range, text


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the workload (checked first), start the --launch servers, run the workload against
    each server in turn; returns the JSON-able rows and workload summary."""
    prompt_range, gen_range, text = check_options(args)
    model = args.model or checkpoints.default_model_path()
    workload = text_workload(checkpoints.load_tokenizer(args.tokenizer or model), text, args.num_requests, prompt_range, gen_range,
                             args.seed)
    log = (lambda line: None) if args.json else (lambda line: print(line, file=sys.stderr))
    with contextlib.ExitStack() as stack:
        servers = [f"{s.label}={s.url}" for s in launch_servers(args, str(model), prompt_range, gen_range, stack, log)]
        results = run_benchmark(servers + args.server, workload, args.concurrency, model=args.model_name,
                                ignore_eos=not args.no_ignore_eos, timeout_s=args.timeout, log=log)
    if not args.json:
        print("\n".join(format_table(results)))
    return summary(args, prompt_range, gen_range, workload) | {"results": [attrs.asdict(r) for r in results]}


def launch_servers(args: argparse.Namespace, model: str, prompt_range: tuple[int, int], gen_range: tuple[int, int],
                   stack: contextlib.ExitStack, log: Any) -> list:
    """Start every --launch server (each stopped when ``stack`` closes); their ServerCommands."""
    out = []
    for kind in args.launch:
        command = server_command(kind, model, free_port(), args.threads, args.concurrency, prompt_range[1],
                                 prompt_range[1] + gen_range[1], args.serve_args)
        out.append(stack.enter_context(launched(command, args.threads, args.ready_timeout, log)))
    return out


def summary(args: argparse.Namespace, prompt_range: tuple[int, int], gen_range: tuple[int, int],
            workload: list[ServingRequest]) -> dict[str, Any]:
    """The workload's figures in the JSON output (tokens, ranges, seed, launched servers)."""
    return {"num_requests": args.num_requests, "concurrency": args.concurrency, "prompt_lens": list(prompt_range),
            "gen_lens": list(gen_range), "seed": args.seed, "prompt_tokens": sum(r.prompt_len for r in workload),
            "requested_output_tokens": sum(r.max_tokens for r in workload), "launched": list(args.launch)}


BENCHMARK = Benchmark(name="serving", help="load OpenAI-compatible servers over HTTP (neuronfx serve, llama.cpp's, vLLM's): "
                      "output tok/s, TTFT and ITL percentiles", description=__doc__, add_arguments=add_arguments, run=run)
