"""neuronfx serve vs llama-cpp-python's OpenAI server, same model file, same workload, one run.

Usage: .venv/bin/python scripts/bench_serving_vs_llama_cpp.py [--num-requests 64] [--concurrency 8]
       [--prompt-lens 32 512] [--gen-lens 16 256] [--threads 2] [--serve-args "..."] [--json]

Starts ``python -m neuronfx serve`` (the default SmolLM2-135M-Instruct GGUF, a plan of
``--concurrency`` slots holding the longest prompt and generation, plus ``--serve-args``) and
``python -m llama_cpp.server --model <the same GGUF> --n_threads T --interrupt_requests False``
on free loopback ports, each with ``OMP_NUM_THREADS=T``; waits until neuronfx's ``/health``
answers 200 and llama.cpp's ``/v1/models`` does (it has no /health); runs the same
``neuronfx bench-serving`` workload (seeded real-text prompts, full-length greedy generations,
streamed, ``--concurrency`` in flight) against neuronfx, then llama.cpp; prints the Markdown table;
stops both (SIGTERM, then SIGKILL after 30 s).

llama-cpp-python's server runs one request at a time (a lock around its single context): the
others wait, which shows in its TTFT. By default it also interrupts a running stream whenever
another request arrives (``interrupt_requests``), which would cut every concurrent request
short, so it is started with ``--interrupt_requests False``. It honours ``min_tokens`` (by
masking the model's eos id) and ignores ``ignore_eos``, so a request can still end early at
another end-of-generation token: the table counts those as "short". Its server needs
``pip install 'llama-cpp-python[server]'`` (in neuronfx's ``bench`` extra).

neuronfx runs the GGUF's weights dequantized to float32 by default (llama.cpp multiplies the
Q4_1 blocks); ``--serve-args "--weight-format gguf"`` keeps the blocks in neuronfx too.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import attrs

from neuronfx.bench_serving import check_range, default_text, format_table, make_workload, run_benchmark
from neuronfx.io.checkpoints import default_model_path, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, cmd: list[str], threads: int, logs: Path) -> tuple[subprocess.Popen, Path]:
    """Start a server process, its output to a log file; (process, log path)."""
    log = logs / f"{name}.log"
    print(f"starting {name}: {shlex.join(cmd)} (log {log})", file=sys.stderr)
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return proc, log


def wait_ready(name: str, proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    """Poll ``url`` until it answers 200; exit with the log's tail if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    print(f"{name} ready", file=sys.stderr)
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            what = f"exited with {proc.returncode}" if proc.poll() is not None else f"not ready after {timeout_s:.0f} s"
            raise SystemExit(f"{name} {what}; its log ends:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-lens", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    ap.add_argument("--gen-lens", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="threads of each server (OMP_NUM_THREADS, llama.cpp --n_threads)")
    ap.add_argument("--serve-args", default="", help="more options for neuronfx serve, e.g. \"--backend eager\"")
    ap.add_argument("--ready-timeout", type=float, default=1200.0, help="seconds each server may take to start (compile)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()
    prompt_range, gen_range = check_range("prompt-lens", args.prompt_lens, 1), check_range("gen-lens", args.gen_lens, 1)
    gguf = default_model_path()
    tokenizer = load_tokenizer(gguf)
    workload = make_workload(tokenizer, default_text(), args.num_requests, prompt_range, gen_range, args.seed)

    nfx_port, cpp_port = free_port(), free_port()
    plan = ["--batch-size", str(args.concurrency), "--max-context-length", str(prompt_range[1]),
            "--sequence-length", str(prompt_range[1] + gen_range[1])]
    serve = [sys.executable, "-m", "neuronfx", "serve", "--host", "127.0.0.1", "--port", str(nfx_port), *plan,
             *shlex.split(args.serve_args)]
    llama = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_threads", str(args.threads), "--host", "127.0.0.1",
             "--port", str(cpp_port), "--n_ctx", str(max(2048, prompt_range[1] + gen_range[1])), "--interrupt_requests", "False"]
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as logs:
        procs = []
        try:
            nfx, nfx_log = start("neuronfx", serve, args.threads, Path(logs))
            procs.append(nfx)
            cpp, cpp_log = start("llama.cpp", llama, args.threads, Path(logs))
            procs.append(cpp)
            wait_ready("llama.cpp", cpp, f"http://127.0.0.1:{cpp_port}/v1/models", cpp_log, args.ready_timeout)
            wait_ready("neuronfx", nfx, f"http://127.0.0.1:{nfx_port}/health", nfx_log, args.ready_timeout)
            servers = [f"neuronfx serve=http://127.0.0.1:{nfx_port}", f"llama.cpp server=http://127.0.0.1:{cpp_port}"]
            results = run_benchmark(servers, workload, args.concurrency, log=lambda line: print(line, file=sys.stderr))
        finally:
            for proc in procs:
                stop(proc)
    summary = (f"{args.num_requests} requests, {args.concurrency} concurrent, prompts {prompt_range[0]}-{prompt_range[1]} tokens "
               f"({sum(r.prompt_len for r in workload)} in all), generations {gen_range[0]}-{gen_range[1]} "
               f"({sum(r.max_tokens for r in workload)} asked), seed {args.seed}, {args.threads} threads each; "
               f"model {Path(gguf).name}; neuronfx serve {shlex.join(plan + shlex.split(args.serve_args))}")
    if args.json:
        print(json.dumps({"workload": summary, "results": [attrs.asdict(r) for r in results]}))
    else:
        print(summary)
        print("\n".join(format_table(results)))


if __name__ == "__main__":
    main()
