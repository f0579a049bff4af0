"""neuronfx bench: metric formulas on exact inputs, and a tiny end-to-end run with --compare."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_hf_model

from neuronfx.bench import percentile, plot, run_bench, summarize
from neuronfx.checkpoints import load_checkpoint
from neuronfx.cli import main


def test_summarize_follows_vllm_definitions():
    # TTFT 0.5 s, then 3 decode gaps: latency 1.1 s for 4 tokens per row, batch 2.
    r = summarize("neuronfx", "eager", "float32", 2, 16, 0.5, [0.1, 0.2, 0.3])
    assert r.gen_len == 4
    assert r.tpot_s == pytest.approx(0.2)  # (1.1 - 0.5) / (4 - 1)
    assert r.itl_p50_s == pytest.approx(0.2)
    assert r.itl_p90_s == pytest.approx(0.28)  # numpy linear: 0.2 + 0.8 * 0.1
    assert r.output_tok_s == pytest.approx(2 * 4 / 1.1)
    assert r.decode_tok_s == pytest.approx(2 * 3 / 0.6)


def test_percentile_matches_numpy_linear():
    import numpy as np
    xs = [0.3, 0.1, 0.7, 0.2, 0.9]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    tiny_hf_model("llama", seed=0).save_pretrained(directory)
    return load_checkpoint(directory)


def test_run_bench_compares_engines_in_one_run(tiny_checkpoint, tmp_path):
    data = run_bench(tiny_checkpoint, "eager", "float32", [1, 2], [8], [4], compare_transformers=True, log=lambda s: None)
    engines = sorted((r["engine"], r["batch_size"]) for r in data["results"])
    assert engines == [("neuronfx", 1), ("neuronfx", 2), ("transformers", 1), ("transformers", 2)]
    assert all(r["gen_len"] == 4 and r["prompt_len"] == 8 for r in data["results"])
    assert len(data["ratios"]) == 2 and all(r["decode_tok_s_ratio"] > 0 for r in data["ratios"])
    assert [m["batch_size"] for m in data["memory"]] == [1, 2]
    assert data["memory"][1]["kv_bytes"] > data["memory"][0]["kv_bytes"]
    json.dumps(data)
    plot(data, str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cli_json(tiny_checkpoint, capsys):
    assert main(["bench", "--model", tiny_checkpoint.source, "--backend", "eager", "--batch-sizes", "1", "--prompt-lens", "8",
                 "--gen-lens", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["engine"] for r in data["results"]] == ["neuronfx"] and data["results"][0]["gen_len"] == 3


def test_workload_is_seeded_and_in_range():
    from neuronfx.bench import make_workload

    a = make_workload(256, 20, (32, 64), (2, 9), seed=3)
    assert a == make_workload(256, 20, (32, 64), (2, 9), seed=3)
    assert a != make_workload(256, 20, (32, 64), (2, 9), seed=4)
    assert all(32 <= len(p) <= 64 for p in a.prompts) and all(2 <= g <= 9 for g in a.gen_lens)
    assert all(3 <= t < 256 for p in a.prompts for t in p)


def test_serving_bench_tiny(tiny_checkpoint):
    from neuronfx.bench import run_serving_bench

    data = run_serving_bench(tiny_checkpoint, "eager", "float32", num_requests=10, slots=4,
                             prompt_range=(4, 40), gen_range=(2, 12), log=lambda s: None)
    assert data["num_requests"] == 10 and data["slots"] == 4
    assert data["neuronfx_tok_s"] > 0 and data["transformers_tok_s"] > 0
    assert data["ratio"] == pytest.approx(data["neuronfx_tok_s"] / data["transformers_tok_s"])
    json.dumps(data)


def test_tp_bench_cli_json(tiny_checkpoint, capsys):
    """``bench --tp-degree 1 2``: one launch per degree, every figure the issue asks for in one
    JSON object; the tiny model's tp=2 ranks each hold about half the weights (4 heads, 2 KV
    heads and vocabulary 256 split evenly: only the norms are replicated)."""
    assert main(["bench", "--model", tiny_checkpoint.source, "--backend", "eager", "--tp-degree", "1", "2", "--batch-sizes", "1",
                 "2", "--prompt-lens", "8", "--gen-lens", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    runs = {r["tp_degree"]: r for r in data["runs"]}
    assert sorted(runs) == [1, 2]
    assert [m["rank"] for m in runs[2]["ranks"]] == [0, 1]
    assert set(runs[2]["decode"]) == {"1", "2"} and runs[2]["ttft_sp_s"] > 0 and "sp_error" not in runs[2]
    assert runs[1]["profile"]["collective_share"] == 0 < runs[2]["profile"]["collective_share"] < 1
    (ratio,) = data["ratios"]
    assert 0.5 < ratio["weights_bytes_ratio"] < 0.52
