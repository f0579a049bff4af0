"""``neuronfx bench latency --against``: this tree against another checkout in one run, each
side a worker process of its own checkout, rounds alternating. Here the other checkout is a
copy of this tree (a git ref is exported the same way: tested without running it)."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import tiny_hf_model

from neuronfx.bench.checkout_ab import Worker, checkout, receive
from neuronfx.bench.rounds import paired_ratio
from neuronfx.cli import main
from neuronfx.errors import InputError, NeuronfxError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    tiny_hf_model("llama", seed=2).save_pretrained(path)
    return path


def test_against_a_copy_of_this_tree(tiny_dir, tmp_path, capsys):
    """Both workers import their own checkout; every case has one figure per round on each
    side, each round from a fresh pair of processes, the per-round ratios are this / other of
    the same round, and the greedy tokens agree."""
    other = tmp_path / "other"
    shutil.copytree(ROOT / "neuronfx", other / "neuronfx", ignore=shutil.ignore_patterns("__pycache__"))
    args = ["bench", "latency", "--model", str(tiny_dir), "--backend", "eager", "--batch-sizes", "1", "2", "--prompt-lens", "8",
            "--gen-lens", "4", "--against", str(other), "--rounds", "3", "--against-option", "max_context_length=64"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["this"]["neuronfx"] == str(ROOT / "neuronfx" / "__init__.py")
    assert data["other"]["neuronfx"] == str(other.resolve() / "neuronfx" / "__init__.py")
    assert data["overrides"] == {"max_context_length": 64} and data["rounds"] == 3
    assert [(c["batch_size"], c["prompt_len"], c["gen_len"]) for c in data["cases"]] == [(1, 8, 4), (2, 8, 4)]
    for case in data["cases"]:
        assert len(case["this_tok_s"]) == len(case["other_tok_s"]) == 3 and all(v > 0 for v in case["this_tok_s"])
        assert len(set(case["this_pids"] + case["other_pids"])) == 6  # a fresh process per side and round
        assert case["ratios"] == [a / b for a, b in zip(case["this_tok_s"], case["other_tok_s"])]
        r = case["ratios"]  # rounds 0 and 1 are a pair (opposite orders); round 2 is left out of the summary
        assert case["median_ratio"] == pytest.approx((r[0] * r[1]) ** 0.5, rel=1e-12)
        assert case["this_median"] == statistics.median(case["this_tok_s"])
        assert case["same_tokens"] and len(case["first_tokens"]) == 4  # gen_len tokens of the first row
        assert case["within_tolerance"] == (abs(case["median_ratio"] - 1) <= 0.03)


def test_a_git_ref_is_exported_for_the_run():
    """--against HEAD: the commit's neuronfx package in a temporary directory, removed after."""
    with checkout("HEAD") as (root, label):
        assert (root / "neuronfx" / "__init__.py").is_file() and label.startswith("HEAD (")
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
        assert label == f"HEAD ({head[:10]})"
    assert not root.exists()


@pytest.mark.parametrize("against, extra, message", [
    ("no-such-ref-or-dir", [], "--against 'no-such-ref-or-dir' names no directory and no commit"),
    ("TMP", [], "is a directory without neuronfx/__init__.py"),
    (".", ["--compare", "transformers"], "it takes no --compare and no --plot"),
    (".", ["--against-option", "dtype"], "--against-option 'dtype' must be KEY=VALUE"),
])
def test_against_errors_before_any_worker(against, extra, message, capsys):
    with tempfile.TemporaryDirectory() as tmp:
        assert main(["bench", "latency", "--against", tmp if against == "TMP" else against, *extra]) == 2
    err = capsys.readouterr().err
    assert "neuronfx: error: InputError: " in err and message in err


def test_a_worker_that_dies_is_an_error_with_its_log(tmp_path):
    """A worker that exits before its protocol line: NeuronfxError naming it, with its log's tail."""
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen([sys.executable, "-c", "import sys; print('noise'); sys.exit('no neuronfx here')"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        worker = Worker(label="other", root=tmp_path, process=process, stderr=log, ready={})
        with pytest.raises(NeuronfxError, match=rf"(?s)the other worker \(neuronfx at {tmp_path}\) exited with 1.*no neuronfx here"):
            receive(worker)


def test_the_checkout_must_hold_neuronfx(tmp_path):
    with pytest.raises(InputError, match="without neuronfx/__init__.py"), checkout(str(tmp_path)):
        pass


def test_paired_ratio_cancels_a_penalty_for_going_first():
    """Rounds alternate which side goes first; a side that loses a constant factor f whenever it
    goes first still reads its true ratio r, whatever the number of rounds."""
    r, f = 0.97, 0.93
    rounds = [r * f if i % 2 == 0 else r / f for i in range(8)]
    assert paired_ratio(rounds) == pytest.approx(r, rel=1e-12)
    assert paired_ratio([*rounds[:6], 5.0]) == pytest.approx(r, rel=1e-12)  # an odd last round is left out
    assert paired_ratio([1.04]) == 1.04
    assert paired_ratio([0.9, 1.0, 1.1, 1.2]) == pytest.approx(statistics.median([0.9 ** 0.5, (1.1 * 1.2) ** 0.5]), rel=1e-12)
    with pytest.raises(ValueError, match="no rounds"):
        paired_ratio([])
