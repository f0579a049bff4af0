"""neuronfx bench: metric formulas on exact inputs, and a tiny end-to-end run with --compare."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_hf_model

from neuronfx.bench import percentile, plot, run_bench, summarize
from neuronfx.cli import main
from neuronfx.io.checkpoints import load_checkpoint


@pytest.fixture(autouse=True)
def small_read_probe(monkeypatch):
    """Every run_bench measures the read bandwidth; 4 MiB instead of 128 keeps these tests fast."""
    monkeypatch.setattr("neuronfx.bench.READ_PROBE_BYTES", 4 * 2**20)


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
    # eager fp32 weights, tied head: every tensor once, plus 1 or 2 embedding rows
    rows = {r["batch_size"]: r for r in data["bandwidth"]}
    assert sorted(rows) == [1, 2] and all(r["engine"] == "neuronfx" for r in data["bandwidth"])
    assert rows[2]["weight_bytes_per_step"] - rows[1]["weight_bytes_per_step"] in (0, 4 * tiny_checkpoint.config.hidden_size)
    assert data["read_bandwidth"]["bytes_per_s"] > 0 and data["prefill_16bit"] is None  # eager: reference ops
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
                 "--prompt-lens", "8", "--gen-lens", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    runs = {r["tp_degree"]: r for r in data["runs"]}
    assert sorted(runs) == [1, 2]
    assert [m["rank"] for m in runs[2]["ranks"]] == [0, 1]
    assert set(runs[2]["decode"]) == {"1"} and runs[2]["ttft_sp_s"] > 0 and "sp_error" not in runs[2]
    assert runs[1]["profile"]["collective_share"] == 0 < runs[2]["profile"]["collective_share"] < 1
    (ratio,) = data["ratios"]
    assert 0.5 < ratio["weights_bytes_ratio"] < 0.52


# --- compare llama.cpp, bandwidth: no llama.cpp needed -------------------------------------------


def _result(engine: str, batch: int, ttft: float, itl: list[float]):
    return summarize(engine, "x", "bfloat16" if engine == "neuronfx" else "Q4_1", batch, 128, ttft, itl)


def test_comparison_table_side_by_side():
    """neuronfx at 50 tok/s and TTFT 100 ms against 25 tok/s and 200 ms: x2.00 and x0.50."""
    from neuronfx.bench import comparison_table

    results = [_result("neuronfx", 1, 0.1, [0.02] * 3), _result("llama.cpp", 1, 0.2, [0.04] * 3),
               _result("neuronfx", 8, 0.5, [0.1] * 3)]  # no llama.cpp B=8: no rows
    lines = comparison_table(results, "llama.cpp")
    assert lines[0] == "neuronfx (x, bfloat16) vs llama.cpp (x, Q4_1)"
    assert lines[1].split() == ["case", "metric", "neuronfx", "llama.cpp", "ratio"]
    rows = [line.split() for line in lines[2:]]
    assert len(rows) == 5 and all(r[:3] == ["B=1", "prompt=128", "gen=4"] for r in rows)
    assert rows[0][3:9] == ["decode", "tok/s", "50.0", "25.0", "2.00x", "(higher"]
    assert rows[1][3:9] == ["TTFT", "ms", "100.0", "200.0", "0.50x", "(lower"]
    assert rows[2][3:8] == ["TPOT", "ms", "20.0", "40.0", "0.50x"]
    assert rows[3][3:9] == ["ITL", "p50", "ms", "20.0", "40.0", "0.50x"]
    assert rows[4][3:8] == ["output", "tok/s", f"{4 / 0.16:.1f}", f"{4 / 0.32:.1f}", "2.00x"]
    assert comparison_table(results, "transformers") == []


def test_decode_weight_bytes_counts_leaves_once():
    """Layers (float and a NamedTuple of int8 data + scales), norm, LM head in full; the
    embedding B rows, or nothing more when it is the (tied) LM head."""
    import torch

    from neuronfx.bench import decode_weight_bytes
    from neuronfx.graphs.quant import Int8Weight

    embed = torch.zeros(100, 8)  # 3200 bytes, 32 per row
    layer = {"q": Int8Weight(torch.zeros(8, 8, dtype=torch.int8), torch.zeros(8)), "norm": torch.zeros(8, dtype=torch.bfloat16)}
    untied = {"embed": embed, "norm": torch.zeros(8), "lm_head": torch.zeros(100, 8, dtype=torch.bfloat16), "layers": [layer, layer]}
    assert decode_weight_bytes(untied, 3) == (64 + 32 + 16) + 32 + 1600 + 3 * 32  # the shared layer once
    tied = untied | {"lm_head": embed}
    assert decode_weight_bytes(tied, 3) == (64 + 32 + 16) + 32 + 3200


def test_bandwidth_rows():
    from neuronfx.bench import bandwidth_rows

    rows = bandwidth_rows([_result("neuronfx", 1, 0.1, [0.02, 0.02]), _result("llama.cpp", 1, 0.1, [0.01])],
                          {("neuronfx", 1): 10**8}, read_bytes_s=10**10)
    assert len(rows) == 1 and rows[0]["bytes_per_s"] == pytest.approx(5e9) and rows[0]["share_of_read_bandwidth"] == pytest.approx(0.5)


def test_compare_llama_cpp_without_the_package(monkeypatch, capsys, tmp_path):
    """Missing llama-cpp-python: a named error with the extra to install, before any checkpoint is read."""
    import sys

    from neuronfx.bench_llama_cpp import import_llama_cpp
    from neuronfx.errors import BackendUnavailableError

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    with pytest.raises(BackendUnavailableError, match=r"neuronfx\[bench\]"):
        import_llama_cpp()
    assert main(["bench", "--compare", "llama.cpp", "--model", str(tmp_path / "absent.gguf")]) == 2
    assert "pip install 'neuronfx[bench]'" in capsys.readouterr().err


def test_compare_llama_cpp_needs_a_gguf(tiny_checkpoint, capsys):
    assert main(["bench", "--compare", "llama.cpp", "--model", tiny_checkpoint.source]) == 2
    assert "--model must be a .gguf file" in capsys.readouterr().err


def test_rounds_alternate_the_engines_and_report_the_median_round():
    """--rounds: round i runs the engines in turn, the first one alternating; each engine's
    reported result is its median round by decode tok/s, and the ratios pair rounds."""
    from neuronfx.bench import alternate, median_round, round_ratios

    calls = []
    out = alternate({"a": lambda: calls.append("a") or len(calls), "b": lambda: calls.append("b") or len(calls)}, 4)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert out == {"a": [1, 4, 5, 8], "b": [2, 3, 6, 7]}
    ours = [_result("neuronfx", 1, 0.1, [step] * 3) for step in (0.02, 0.01, 0.04)]  # 50, 100, 25 tok/s
    theirs = [_result("llama.cpp", 1, 0.1, [step] * 3) for step in (0.02, 0.02, 0.02)]  # 50 tok/s each
    assert median_round(ours) is ours[0]
    row = round_ratios(ours, theirs)
    assert row["decode_tok_s_ratios"] == pytest.approx([1.0, 2.0, 0.5]) and row["median"] == pytest.approx(1.0)
    assert row["reference"] == "llama.cpp" and row["batch_size"] == 1


def test_rounds_need_llama_cpp(capsys):
    assert main(["bench", "--rounds", "3"]) == 2
    assert "--rounds=3" in capsys.readouterr().err


def test_format_ab_reports_medians_and_same_round_ratios():
    from neuronfx.bench import format_ab

    lines = format_ab("batch 1", {"new": [0.010, 0.020, 0.012], "old": [0.011, 0.030, 0.012]}, "old", "new")
    assert lines[0].endswith("10.00 20.00 12.00; median 12.00") and lines[0].startswith("batch 1 new")
    assert lines[1].endswith("11.00 30.00 12.00; median 12.00")
    assert lines[2] == "batch 1 old / new per round: 1.100 1.500 1.000; median 1.100x"


def test_quant_path_line_names_the_kernels_path_of_quantized_inductor_plans_only():
    from neuronfx.bench import _quant_path
    from neuronfx.graphs import kernels

    assert _quant_path("eager", "cpu", "gguf", "float") is None
    assert _quant_path("inductor", "cpu", "float", "float") is None
    assert _quant_path("inductor", "cuda", "int8", "float") is None
    if not kernels.small_gemm_available():
        assert "fallback" in _quant_path("inductor", "cpu", "gguf", "float")
        return
    assert _quant_path("inductor", "cpu", "gguf", "float") == f"quantized decode products: {kernels.quant_isa()} path"
    assert _quant_path("inductor", "cpu", "int4", "int8") == (
        f"quantized decode products: {kernels.quant_int8_x_isa()} (int8 activations) path")
