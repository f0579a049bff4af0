"""Every benchmark of ``neuronfx bench`` not covered in test_bench.py, test_bench_ab.py and
test_bench_serving.py, each once on a tiny model (eager), with figures checked where they are
exact (iterations, byte counts, token agreement) and the rest checked to be measured."""

from __future__ import annotations

import json
import sys

import pytest
from fake_llama_cpp import FakeLlamaCpp
from helpers import smollm2_vocab_model, tiny_hf_model, write_tiny_gguf

from neuronfx.cli import main


@pytest.fixture(autouse=True)
def small_read_probe(monkeypatch):
    monkeypatch.setattr("neuronfx.bench.bandwidth.READ_PROBE_BYTES", 4 * 2**20)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_hf_model("llama", seed=4, max_position_embeddings=1024).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A tiny random llama with SmolLM2's tokenizer and chat template."""
    path = tmp_path_factory.mktemp("chat")
    smollm2_vocab_model(path)
    return path


def run_json(capsys, *args: str) -> dict:
    assert main(["bench", *args, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_weight_formats(tmp_path, capsys, monkeypatch):
    """Every format of a tiny GGUF and llama.cpp (a stand-in) beside the kept blocks; the table
    compares each format with fp32 and the kept blocks with llama.cpp."""
    from neuronfx.bench.weight_formats import table

    gguf = write_tiny_gguf(str(tmp_path / "tiny.gguf"), tiny_hf_model("llama", seed=5))
    monkeypatch.setitem(sys.modules, "llama_cpp", FakeLlamaCpp(vocab=256))
    runs = run_json(capsys, "weight-formats", "--model", gguf, "--backend", "eager", "--batch-sizes", "1", "--prompt-len", "6",
                    "--gen-len", "3")
    assert list(runs) == ["float", "int8", "int4", "gguf"]
    assert [r["engine"] for r in runs["gguf"]["results"]] == ["neuronfx", "llama.cpp"]
    weights = {fmt: data["memory"][0]["weights_bytes"] for fmt, data in runs.items()}
    assert weights["int8"] < weights["float"] and weights["int4"] < weights["int8"]
    rows = [line.split(" | ") for line in table(runs)[2:]]
    assert [r[0].lstrip("| ") for r in rows] == ["fp32", "int8", "int4", "GGUF blocks", f"llama.cpp {runs['gguf']['results'][1]['dtype']}"]
    assert rows[0][3] == "1.00x" and rows[3][4].endswith("x") and rows[4][4] == ""


def test_prefix_caching(tiny_dir, capsys):
    data = run_json(capsys, "prefix-caching", "--model", str(tiny_dir), "--backend", "eager", "--system-tokens", "32",
                    "--question-tokens", "8", "--requests", "2", "--chunk", "16", "--block", "8", "--batch-size", "2",
                    "--throughput-requests", "2", "--prompt-tokens", "16", "--gen-tokens", "3", "--repeat", "2", "--control")
    t, tp = data["ttft"], data["throughput"]
    assert t["same_tokens"] and t["hit_rate"] > 0.5 and min(t["cold_s"], t["warm_s"], t["off_s"]) > 0
    assert {name: len(v) for name, v in tp["tok_s"].items()} == {"off": 2, "control": 2, "on": 2}
    assert tp["on_off_ratios"] == [a / b for a, b in zip(tp["tok_s"]["on"], tp["tok_s"]["off"])] and tp["control_off_median"] > 0


def test_prefix_caching_layouts(tiny_dir, capsys):
    """--layouts: warm hits on the slots layout (copied) against the blocks layout (shared)."""
    data = run_json(capsys, "prefix-caching", "--model", str(tiny_dir), "--backend", "eager", "--system-tokens", "32",
                    "--question-tokens", "8", "--requests", "3", "--chunk", "16", "--block", "8", "--batch-size", "2", "--layouts")
    t = data["layouts"]
    assert t["same_tokens"] and min(t["hit_rate"].values()) > 0.5 and t["ratio"] == t["warm_s"]["blocks"] / t["warm_s"]["slots"]
    assert main(["bench", "prefix-caching", "--model", str(tiny_dir), "--layouts", "--control"]) != 0
    assert "InputError: --layouts compiles one runtime per KV layout and no control" in capsys.readouterr().err


def test_chunked_prefill(chat_dir, capsys):
    """A 40-token prompt in chunks of 16 is admitted over 3 scheduler iterations, whole over 1."""
    data = run_json(capsys, "chunked-prefill", "--model", str(chat_dir), "--backend", "eager", "--long-prompt", "40",
                    "--max-context-length", "64", "--chunk-size", "16", "--short-tokens", "24", "--rounds", "1")
    assert (data["chunked"]["iterations"], data["unchunked"]["iterations"]) == (3, 1)
    assert data["chunked"]["itl_samples"] >= 2 * 4 and data["unchunked"]["ttft_long_s"] > 0


def test_async_decode(chat_dir, capsys):
    """Both modes produce the same tokens; 8 requests x 3 gaps per round are timed in each."""
    data = run_json(capsys, "async", "--model", str(chat_dir), "--backend", "eager", "--gen-len", "4", "--rounds", "1")
    assert data["same_tokens"] and data["sync"]["intervals"] == data["async"]["intervals"] == 8 * 3
    assert data["ratio_itl_p50"] == data["async"]["itl_p50_ms"] / data["sync"]["itl_p50_ms"]
    assert data["sync"]["graph_p50_ms"] > 0 and data["sync"]["host_gap_p50_ms"] > 0


def test_structured(chat_dir, capsys):
    """Both modes are timed; the constrained request's text is JSON (a prefix of it when the
    token budget ran out first) and the matcher's host time is measured."""
    data = run_json(capsys, "structured", "--model", str(chat_dir), "--backend", "eager", "--gen-len", "6", "--rounds", "1")
    assert 2 <= data["unconstrained"]["tokens"] == max(2, data["json_schema"]["tokens"]) <= 6  # the same lengths
    assert data["json_schema"]["decode_tok_s"] > 0 and data["unconstrained"]["decode_tok_s"] > 0
    assert data["ratio"] == data["json_schema"]["decode_tok_s"] / data["unconstrained"]["decode_tok_s"]
    assert data["json_text"].startswith('{"') and data["host_ms_per_constrained_token"] > 0


def test_choices(chat_dir, capsys):
    """Both modes are timed and give the same tokens (choice c of the fork is the request with
    seed + c), which differ between choices."""
    data = run_json(capsys, "choices", "--model", str(chat_dir), "--backend", "eager", "-n", "3", "--prompt-len", "20",
                    "--gen-len", "4", "--rounds", "1")
    assert data["same_tokens"] and data["fork"]["first_token_ms"] > 0 and data["prefill"]["decode_tok_s"] > 0
    assert data["first_token_ratio"] == data["fork"]["first_token_ms"] / data["prefill"]["first_token_ms"]


def test_moe(capsys):
    """Batch 1 gathers its 2 experts, batch 8 runs all 8; the bytes per token follow from the shapes
    (fp32; per layer 166,400 attention, norm and router weights and 3 x 512 x 256 per expert)."""
    data = run_json(capsys, "moe", "--backends", "eager", "--steps", "2")
    (row,) = data["backends"]
    assert row["strategy"] == {"1": "gather", "8": "dense"} and all(v > 0 for v in row["decode_tok_s"].values())
    assert set(row["experts_ms"]) == {"gather", "dense"}
    assert data["bytes_per_token"]["1 gather"] == 4 * (4 * (166_400 + 2 * 393_216) + 256_000 + 256 + 256)
    assert data["bytes_per_token"]["8 dense"] == 4 * (4 * (166_400 + 8 * 393_216) + 256_000 + 8 * 256 + 256) // 8


def test_kernels(capsys):
    """One layer and the LM head: fp32 weights are 4 bytes each, Q4_1 20 bytes per 32."""
    from neuronfx.graphs.kernels import library as kernels

    args = ["kernels", "--formats", "fp32", "q4_1", "q4_1+q8_0-int8x", "--layers", "1", "--reps", "1"]
    if not kernels.small_gemm_available():  # no C++ toolchain: a named error instead of figures
        assert main(["bench", *args]) == 2
        assert "BackendUnavailableError: the neuronfx kernel library did not build" in capsys.readouterr().err
        return
    data = run_json(capsys, *args)
    weights = 3_538_944 + 49152 * 576
    assert data["formats"]["fp32"]["bytes"] == 4 * weights and data["formats"]["q4_1"]["bytes"] == weights // 32 * 20
    assert data["formats"]["q4_1+q8_0-int8x"]["bytes"] == 3_538_944 // 32 * 20 + 49152 * 576 // 32 * 34
    assert all(cell["ms"] > 0 for f in data["formats"].values() for cell in f["rows"].values())


def test_artifacts(tiny_dir, capsys):
    """Compile, cached compile and load, each in a fresh process: the same tokens and logprobs."""
    data = run_json(capsys, "artifacts", "--model", str(tiny_dir), "--backend", "eager", "--repeat", "1")
    assert data["identical"] and len(data["tokens"]) == 16
    assert min(data["compile_s"], data["cached_compile_s"], data["load_s"]) > 0


def test_prompt_lookup(tmp_path, capsys, monkeypatch):
    """neuronfx with and without prompt lookup, and llama.cpp (a stand-in) with and without its
    own, on 2 grounded tasks of a tiny GGUF: each speculating engine's tokens equal its plain
    run's, every round is timed, the lookup drafted; the plain runs' ratio to neuronfx is exact."""
    from fake_llama_cpp import install_high_level

    gguf = write_tiny_gguf(str(tmp_path / "tiny.gguf"), tiny_hf_model("llama", seed=5))
    fake = FakeLlamaCpp(vocab=256)
    install_high_level(monkeypatch, fake)
    data = run_json(capsys, "prompt-lookup", "--model", gguf, "--backend", "eager", "--tasks", "2", "--gen-len", "10",
                    "--rounds", "2", "--num-speculative-tokens", "3", "--prompt-lookup-min", "1", "--prompt-lookup-max", "2",
                    "--compare", "llama.cpp")
    rows = {r["engine"]: r for r in data["rows"]}
    assert data["weight_format"] == "float" and data["activation_format"] == "float"
    assert list(rows) == ["neuronfx", "neuronfx prompt lookup", "llama.cpp", "llama.cpp prompt lookup"]
    assert rows["neuronfx prompt lookup"]["tokens_equal_plain"] and rows["llama.cpp prompt lookup"]["tokens_equal_plain"]
    assert all(len(r["rounds_tok_s"]) == 2 and r["decode_tok_s"] > 0 for r in rows.values())
    assert rows["neuronfx"]["vs_neuronfx"] == 1.0
    assert rows["llama.cpp"]["vs_neuronfx"] == rows["llama.cpp"]["decode_tok_s"] / rows["neuronfx"]["decode_tok_s"]
    plain, looked = fake.llamas
    assert plain.draft_model is None and looked.draft_model.num_pred_tokens == 3 and looked.draft_model.max_ngram_size == 2
    assert looked.drafts and plain.params["n_threads"] == looked.params["n_threads"] >= 1


def test_prompt_lookup_options_are_checked_before_loading(capsys):
    assert main(["bench", "prompt-lookup", "--tasks", "0"]) == 2
    assert "--tasks=0 must be in [1, 24]" in capsys.readouterr().err
    assert main(["bench", "prompt-lookup", "--prompt-lookup-min", "3", "--prompt-lookup-max", "2"]) == 2
    assert "--prompt-lookup-max=2 must be >= --prompt-lookup-min=3" in capsys.readouterr().err
