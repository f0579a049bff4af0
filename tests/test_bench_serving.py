"""``neuronfx bench serving`` (and its older name ``bench-serving``): the statistics on exact
timestamps, the workload, option errors, an unreachable server, and the servers ``--launch``
starts (a stand-in HTTP server here). The client against a real ``neuronfx serve`` runs in
test_server.py (``test_bench_serving_client``), on that module's server."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from helpers import smollm2_vocab_model

import neuronfx
from neuronfx.bench.serving_client import (
    RequestTiming,
    base_url,
    format_table,
    inter_token_latencies,
    parse_server,
    summarize,
    text_workload,
    tpot,
    ttft,
)
from neuronfx.bench.spawn import ServerCommand, launched, server_command
from neuronfx.bench.workload import WorkloadRequest, default_text, make_workload
from neuronfx.cli import main

ROOT = Path(__file__).resolve().parents[1]


def timing(sent, chunks, done, out=None, max_tokens=None, error=None, prompt_len=10) -> RequestTiming:
    out = len(chunks) if out is None else out
    return RequestTiming(prompt_len=prompt_len, max_tokens=max_tokens or out, sent=sent, chunks=tuple(chunks), done=done,
                         output_tokens=out, usage_reported=False, error=error)


def test_ttft_itl_tpot_from_timestamps():
    t = timing(10.0, [10.5, 10.75, 11.0, 12.0], done=12.0)
    assert ttft(t) == 0.5
    assert inter_token_latencies(t) == [0.25, 0.25, 1.0]
    assert tpot(t) == 0.5  # (12.0 - 10.5) / (4 - 1)
    # a chunk of several tokens (usage says 7 tokens in 4 chunks): one gap per chunk, TPOT per token
    assert tpot(timing(10.0, [10.5, 10.75, 11.0, 12.0], done=12.0, out=7)) == 0.25
    assert tpot(timing(0.0, [1.0], done=1.0)) is None and inter_token_latencies(timing(0.0, [1.0], done=1.0)) == []


def test_summarize_exact():
    timings = [
        timing(0.0, [0.5, 0.75, 1.0, 2.0], done=2.0),  # TTFT 0.5, gaps 0.25 0.25 1.0
        timing(1.0, [2.5, 3.0], done=3.0, max_tokens=4, prompt_len=20),  # TTFT 1.5, gap 0.5; 2 of 4 tokens: short
        timing(0.0, [], done=0.25, error="APIStatusError: 503"),
        timing(0.0, [], done=0.5, error="APIStatusError: 503"),
    ]
    r = summarize("s", "http://x", "m", timings, concurrency=2, duration_s=4.0)
    assert (r.completed, r.failed, r.short, r.num_requests, r.errors) == (2, 2, 1, 4, ("APIStatusError: 503",))
    assert (r.output_tokens, r.prompt_tokens, r.output_tok_s, r.request_per_s) == (6, 30, 1.5, 0.5)
    assert (r.ttft_mean_s, r.ttft_p50_s) == (1.0, 1.0)
    assert r.ttft_p90_s == pytest.approx(1.4, abs=1e-15) and r.ttft_p99_s == pytest.approx(1.49, abs=1e-15)
    # ITL over every gap: [0.25, 0.25, 0.5, 1.0] -> p50 0.375 (between 0.25 and 0.5), p90 0.85, p99 0.985
    assert (r.itl_mean_s, r.itl_p50_s) == (0.5, 0.375)
    assert r.itl_p90_s == pytest.approx(0.85, abs=1e-15) and r.itl_p99_s == pytest.approx(0.985, abs=1e-15)
    assert r.tpot_mean_s == 0.5  # (0.5 + 0.5) / 2: (2.0 - 0.5) / 3 and (3.0 - 2.5) / 1
    assert format_table([r])[2] == "| s | 2/4 (1 short) | 6 | 4.0 | 1.5 | 1000 / 1400 / 1490 | 375 / 850 / 985 | 500 |"


def test_server_specs():
    assert parse_server("http://127.0.0.1:8000") == ("http://127.0.0.1:8000", "http://127.0.0.1:8000")
    assert parse_server("llama.cpp=http://h:1/v1") == ("llama.cpp", "http://h:1/v1")
    assert base_url("http://h:1/") == "http://h:1/v1" and base_url("http://h:1/v1") == "http://h:1/v1"
    with pytest.raises(neuronfx.errors.InputError, match="must start with http"):
        parse_server("localhost:8000")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("served")
    hf, tokenizer = smollm2_vocab_model(path)
    return path, hf, tokenizer


def test_workload_is_seeded_real_text_within_the_ranges(tiny_dir):
    tok = tiny_dir[2]
    work = text_workload(tok, default_text(), 16, (32, 512), (16, 256), seed=0)
    assert work == text_workload(tok, default_text(), 16, (32, 512), (16, 256), seed=0)
    assert work != text_workload(tok, default_text(), 16, (32, 512), (16, 256), seed=1)
    assert all(30 <= r.prompt_len <= 512 and 16 <= r.max_tokens <= 256 for r in work)
    assert max(r.prompt_len for r in work) > 300 and min(r.max_tokens for r in work) < 100  # the ranges are used
    assert all(len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_len for r in work)
    assert all(" the " in r.prompt for r in work if r.prompt_len > 100)  # English text, not random ids


@pytest.mark.parametrize("args, error", [
    (["--prompt-lens", "64", "32"], "InputError: --prompt-lens=[64, 32] must be two lengths MIN MAX"),
    (["--gen-lens", "0", "4"], "InputError: --gen-lens=[0, 4]"),
    (["--concurrency", "0"], "InputError: --concurrency has [0]; each value must be >= 1"),
    (["--text-file", "/nonexistent.txt"], "InputError: --text-file '/nonexistent.txt' cannot be read"),
])
@pytest.mark.parametrize("command", [["bench-serving"], ["bench", "serving"]])
def test_cli_rejects_bad_options(capsys, args, error, command):
    assert main([*command, "--server", "http://127.0.0.1:9", *args]) == 2
    assert f"neuronfx: error: {error}" in capsys.readouterr().err


def test_cli_needs_a_server(capsys):
    assert main(["bench", "serving"]) == 2
    assert "InputError: no server to load: give --server URL (repeatable) or --launch" in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_is_a_clear_error(tiny_dir, capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    args = ["bench-serving", "--server", url, "--tokenizer", str(tiny_dir[0]), "--num-requests", "2", "--prompt-lens", "8", "16"]
    assert main(args) == 2
    assert f"neuronfx: error: InputError: cannot reach the server at {url}" in capsys.readouterr().err


def test_workload_windows_of_the_ids():
    """One draw per request from random.Random(seed): lengths in the ranges, each prompt a
    contiguous window of the (repeated) ids."""
    ids = list(range(100, 150))
    work = make_workload(ids, 12, (4, 60), (2, 9), seed=3)
    assert work == make_workload(ids, 12, (4, 60), (2, 9), seed=3) != make_workload(ids, 12, (4, 60), (2, 9), seed=4)
    assert all(4 <= len(r.prompt_ids) <= 60 and 2 <= r.max_tokens <= 9 for r in work)
    assert all(b == 100 + (a - 100 + 1) % 50 for r in work for a, b in zip(r.prompt_ids, r.prompt_ids[1:]))
    assert make_workload([7], 2, (3, 3), (1, 1)) == (WorkloadRequest(prompt_ids=(7, 7, 7), max_tokens=1),) * 2
    with pytest.raises(neuronfx.errors.InputError, match="no tokens"):
        make_workload([], 1, (1, 2), (1, 1))
    with pytest.raises(neuronfx.errors.InputError, match=r"--gen-lens=\[3, 2\]"):
        make_workload([1], 1, (1, 2), (3, 2))


def test_launched_server_commands():
    """The command lines --launch starts: neuronfx serve with the workload's plan, llama.cpp's
    server with its thread count and a context of at least 2048."""
    nfx = server_command("neuronfx", "m.gguf", 8001, 2, 4, 512, 768, "--weight-format gguf")
    assert nfx.argv[1:] == ("-m", "neuronfx", "serve", "m.gguf", "--host", "127.0.0.1", "--port", "8001", "--batch-size", "4",
                            "--max-context-length", "512", "--sequence-length", "768", "--weight-format", "gguf")
    assert (nfx.url, nfx.ready_url) == ("http://127.0.0.1:8001", "http://127.0.0.1:8001/health")
    cpp = server_command("llama.cpp", "m.gguf", 8002, 3, 4, 512, 768)
    assert cpp.argv[1:] == ("-m", "llama_cpp.server", "--model", "m.gguf", "--n_threads", "3", "--host", "127.0.0.1", "--port",
                            "8002", "--n_ctx", "2048", "--interrupt_requests", "False")
    assert cpp.ready_url == "http://127.0.0.1:8002/v1/models"


def test_launched_server_is_ready_then_stopped(tmp_path):
    """A stand-in server (python's http.server) is waited for, then stopped when the block ends;
    one that exits at once is an error carrying its log."""
    import sys
    import urllib.request

    port = free_port()
    (tmp_path / "health").write_text("ok")
    lines = []
    server = ServerCommand(label="stand-in", argv=(sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                                                    "--directory", str(tmp_path)),
                           url=f"http://127.0.0.1:{port}", ready_url=f"http://127.0.0.1:{port}/health")
    with launched(server, 1, 60, lines.append) as ready:
        assert urllib.request.urlopen(ready.ready_url, timeout=5).read() == b"ok"
    assert lines[0].startswith("starting stand-in: ") and "http.server" in lines[0] and lines[1] == "stand-in ready"
    with pytest.raises(OSError):
        urllib.request.urlopen(ready.ready_url, timeout=5)  # stopped: nothing listens any more
    failing = ServerCommand(label="failing", argv=(sys.executable, "-c", "print('no model here'); raise SystemExit(3)"),
                            url="http://127.0.0.1:9", ready_url="http://127.0.0.1:9/health")
    with pytest.raises(neuronfx.errors.NeuronfxError, match=r"(?s)failing exited with 3; its log ends:.*no model here"), \
            launched(failing, 1, 60, lines.append):
        pass
