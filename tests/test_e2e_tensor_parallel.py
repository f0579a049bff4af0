"""Tensor parallel end to end on SmolLM2-135M-Instruct (9 query heads, 3 KV heads: padded at
tp=2, even at tp=3), through the command line as a user runs it: ``neuronfx generate
--tp-degree N`` starts its own ranks, ``torchrun`` starts two "nodes" on 127.0.0.1, and a rank
killed mid-generation ends the run with one line. The checkpoint is the session's GGUF written
once as a safetensors directory, so each rank reads only its slices."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import safetensors.torch

import neuronfx

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain in one sentence what a CPU does."]
PLAN_ARGS = ["--backend", "eager", "--batch-size", "4", "--max-context-length", "64", "--sequence-length", "128"]
GEN = 32


@pytest.fixture(scope="module")
def smollm2_dir(smollm2, tmp_path_factory) -> Path:
    """SmolLM2 as an HF safetensors directory (weights, config, tokenizer)."""
    out = tmp_path_factory.mktemp("smollm2-safetensors")
    ckpt = smollm2.checkpoint
    safetensors.torch.save_file({k: v.contiguous() for k, v in ckpt.state_dict.items()}, str(out / "model.safetensors"))
    ckpt.hf_config.save_pretrained(out)
    smollm2.tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tp1_tokens(smollm2, smollm2_eager) -> list[list[int]]:
    """Greedy tokens of the three chat prompts at tp=1, in this process (the session's eager
    runtime: test_e2e_smollm2.py checks it gives transformers' tokens for these prompts)."""
    runtime = smollm2_eager
    prompts = [list(smollm2.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                          tokenize=True, return_dict=True)["input_ids"]) for q in QUESTIONS]
    result, _ = neuronfx.generate(runtime, neuronfx.init_state(runtime), prompts, max_new_tokens=GEN, speculative=False)
    return [list(t) for t in result.token_ids]


def cli(*args: str, prefix: tuple[str, ...] = (sys.executable, "-m", "neuronfx")) -> list[str]:
    return [*prefix, "generate", *args]


def chat_args(model: Path) -> list[str]:
    return ["--model", str(model), *[a for q in QUESTIONS for a in ("--chat", q)], "--max-new-tokens", str(GEN), *PLAN_ARGS, "--json"]


@pytest.mark.parametrize("tp", [2])  # tp=3 (uneven splits) runs on tiny models: test_tensor_parallel.py
def test_cli_tp_matches_tp1(tp, smollm2_dir, tp1_tokens):
    run = subprocess.run(cli(*chat_args(smollm2_dir), "--tp-degree", str(tp)), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)  # rank 0 alone prints
    assert out["token_ids"] == tp1_tokens
    assert "Paris" in out["text"][0]


def _two_nodes(model: Path) -> tuple[list[int], list[tuple[str, str]]]:
    """Two torchrun agents of ``neuronfx generate --tp-degree 2`` on a fresh port: (return
    codes, (stdout, stderr) of each). A crashing rank prints its Python stack (faulthandler)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    nodes = [subprocess.Popen(
        [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(r), "--rdzv-backend", "c10d",
         "--rdzv-id", "neuronfx-test", "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "neuronfx", "generate",
         *chat_args(model), "--tp-degree", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | {"PYTHONFAULTHANDLER": "1"}) for r in (0, 1)]
    outs = [n.communicate(timeout=600) for n in nodes]
    return [n.returncode for n in nodes], outs


def test_torchrun_two_nodes_on_localhost(smollm2_dir, tp1_tokens):
    """Two torchrun agents, one rank each, meeting at a c10d rendezvous on 127.0.0.1: what
    several machines run (``--nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT``). A rank died
    of SIGSEGV in two whole-suite runs of 2026-12-04 (one pinned to AVX2, one cold; cause not
    found, alone it passed every time): such a run is reported as a warning, with the rank's
    stack, and run once more; a second failure fails the test."""
    codes, outs = _two_nodes(smollm2_dir)
    if codes != [0, 0] and any("SIGSEGV" in e for _, e in outs):
        warnings.warn(f"a torchrun rank died of SIGSEGV; running again. {[e[-3000:] for _, e in outs]}", stacklevel=1)
        codes, outs = _two_nodes(smollm2_dir)
    assert codes == [0, 0], [e[-2000:] for _, e in outs]
    printed = [json.loads(o) for o, _ in outs if o.strip()]
    assert len(printed) == 1  # only global rank 0 prints
    assert printed[0]["token_ids"] == tp1_tokens


def _rank_pids(root: int) -> list[int]:
    """Pids of the rank processes below ``root`` (at any depth): the children of the launcher's
    fork server, which share its command line (the server's parent is not one of them)."""
    parent, cmdline = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace")
            parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue

    def below(pid: int) -> bool:
        while pid in parent and pid > 1:
            pid = parent[pid]
            if pid == root:
                return True
        return False

    def forked(pid: int) -> bool:
        return "multiprocessing.forkserver" in cmdline.get(pid, "")

    return sorted(p for p in cmdline if forked(p) and forked(parent.get(p, 0)) and below(p))


def test_killed_rank_ends_the_run_with_one_line(smollm2_dir):
    """SIGKILL one rank mid-generation: the command exits non-zero within seconds, with one
    error line naming the rank and no traceback."""
    env = os.environ | {"NEURONFX_TP_TIMEOUT": "30"}
    proc = subprocess.Popen(
        cli("--model", str(smollm2_dir), "--prompt", "Once upon a time", "--max-new-tokens", "100", "--stream", "--ignore-eos",
            *PLAN_ARGS, "--tp-degree", "2"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    first = proc.stdout.read(1)  # blocks until rank 0 streams its first text: generation is under way
    assert first
    ranks = _rank_pids(proc.pid)
    assert len(ranks) == 2
    killed_at = time.monotonic()
    os.kill(ranks[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - killed_at
    assert proc.returncode == 1
    assert elapsed < 30, elapsed
    lines = [line for line in err.splitlines() if line.strip() and "Warning" not in line and "warn" not in line]
    assert re.fullmatch(r"neuronfx: error: TensorParallelError: tensor-parallel run failed: rank [01] killed by SIGKILL; "
                        r"the other ranks were stopped\.", lines[-1]), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
