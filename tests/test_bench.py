"""``neuronfx bench latency`` and what the benchmarks share: metric formulas on exact inputs, a
tiny end-to-end run against transformers, llama.cpp's code paths on a stand-in library, the
alternating rounds and their report, the older ``neuronfx bench`` spelling; and the in-process
throughput, speculative and tensor-parallel benchmarks on tiny models."""

from __future__ import annotations

import json
import sys

import pytest
from fake_llama_cpp import FakeLlamaCpp
from helpers import smollm2_vocab_model, tiny_hf_model, write_tiny_gguf

from neuronfx.bench.bandwidth import bandwidth_rows, decode_weight_bytes
from neuronfx.bench.latency_run import LatencySpec, quant_path, run_bench
from neuronfx.bench.llama_cpp import gguf_decode_bytes, gguf_weight_type
from neuronfx.bench.plot import plot
from neuronfx.bench.rounds import alternate, comparison_table, format_ab, median_round, round_ratios
from neuronfx.bench.timing import percentile, summarize, transformers_engine
from neuronfx.cli import main
from neuronfx.cli.bench import legacy_argv
from neuronfx.io.checkpoints import load_checkpoint


@pytest.fixture(autouse=True)
def small_read_probe(monkeypatch):
    """Every latency run measures the read bandwidth; 4 MiB instead of 128 keeps these tests fast."""
    monkeypatch.setattr("neuronfx.bench.bandwidth.READ_PROBE_BYTES", 4 * 2**20)


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


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    return write_tiny_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"), tiny_hf_model("llama", seed=5))


def test_run_bench_compares_engines_in_one_run(tiny_checkpoint, tmp_path):
    spec = LatencySpec(backend="eager", dtype="float32", batch_sizes=(1, 2), prompt_lens=(8,), gen_lens=(4,))
    data = run_bench(tiny_checkpoint, spec, lambda: transformers_engine(tiny_checkpoint, "float32"), log=lambda s: None)
    engines = sorted((r["engine"], r["batch_size"]) for r in data["results"])
    assert engines == [("neuronfx", 1), ("neuronfx", 2), ("transformers", 1), ("transformers", 2)]
    assert all(r["gen_len"] == 4 and r["prompt_len"] == 8 for r in data["results"])
    assert len(data["ratios"]) == 2 and all(r["decode_tok_s_ratio"] > 0 and r["reference"] == "transformers" for r in data["ratios"])
    assert [m["batch_size"] for m in data["memory"]] == [1, 2]
    assert data["memory"][1]["kv_bytes"] > data["memory"][0]["kv_bytes"]
    # eager fp32 weights, tied head: every tensor once, plus 1 or 2 embedding rows
    rows = {r["batch_size"]: r for r in data["bandwidth"]}
    assert sorted(rows) == [1, 2] and all(r["engine"] == "neuronfx" for r in data["bandwidth"])
    assert rows[2]["weight_bytes_per_step"] - rows[1]["weight_bytes_per_step"] in (0, 4 * tiny_checkpoint.config.hidden_size)
    assert data["read_bandwidth"]["bytes_per_s"] > 0 and data["prefill_16bit"] is None and data["rounds"] == []  # eager: reference ops
    json.dumps(data)
    plot(data, str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("command", [["bench", "latency"], ["bench"]], ids=["latency", "older-spelling"])
def test_bench_cli_json(tiny_checkpoint, capsys, command):
    assert main([*command, "--model", tiny_checkpoint.source, "--backend", "eager", "--batch-sizes", "1", "--prompt-lens", "8",
                 "--gen-lens", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["engine"] for r in data["results"]] == ["neuronfx"] and data["results"][0]["gen_len"] == 3


def test_older_bench_flags_pick_their_benchmark():
    assert legacy_argv([]) == ["latency"]
    assert legacy_argv(["--batch-sizes", "1"]) == ["latency", "--batch-sizes", "1"]
    assert legacy_argv(["--serving", "--slots", "4"]) == ["throughput", "--slots", "4"]
    assert legacy_argv(["--speculate", "--draft-layers", "2"]) == ["speculative", "--draft-layers", "2"]
    assert legacy_argv(["--tp-degree", "1", "2", "--speculate"]) == ["tensor-parallel", "--tp-degree", "1", "2", "--speculate"]
    assert legacy_argv(["latency", "--serving"]) == ["latency", "--serving"]  # a name given: as it is
    assert legacy_argv(["-h"]) == ["-h"]


def test_bench_rejects_bad_sizes(capsys):
    assert main(["bench", "--gen-lens", "1", "--model", "/nonexistent"]) == 2
    assert "InputError: --gen-lens has [1]; each value must be >= 2." in capsys.readouterr().err


@pytest.mark.parametrize("args, error, names", [
    (["--device", "cuda:99"], "ConfigError", "device='cuda:99'"),  # no such GPU, here or on a lent one
    (["--device", "cuda", "--weight-format", "int8"], "ConfigError", "weight_format='int8'"),
    (["--device", "cuda", "--compare", "llama.cpp"], "InputError", "llama.cpp runs on the CPU"),
    (["--weight-format", "gguf", "--compare", "transformers"], "InputError", "transformers cannot run the kept blocks"),
    (["--rounds", "3"], "InputError", "--rounds=3"),
    (["--rounds", "0", "--compare", "transformers"], "InputError", "--rounds=0"),
    (["--plot", "/nonexistent/dir/x.png"], "InputError", "the directory '/nonexistent/dir' does not exist or cannot be written"),
    (["--plot", "/"], "InputError", "--plot '/' is a directory"),
])
def test_bench_checks_options_before_loading(args, error, names, capsys):
    assert main(["bench", "latency", "--model", "/nonexistent.gguf", *args]) == 2  # the checkpoint would be a CheckpointError
    err = capsys.readouterr().err
    assert f"error: {error}:" in err and names in err


def test_benchmark_options_are_their_own(capsys):
    """--device belongs to latency: the throughput benchmark refuses it as argparse does."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--serving", "--device", "cuda"])
    assert exc.value.code == 2 and "unrecognized arguments: --device cuda" in capsys.readouterr().err


def test_throughput_tiny(tiny_checkpoint, capsys):
    """The older `bench --serving` spelling: the scheduler against transformers' static batches."""
    assert main(["bench", "--serving", "--model", tiny_checkpoint.source, "--backend", "eager", "--num-requests", "10", "--slots",
                 "4", "--prompt-lens", "4", "40", "--gen-lens", "2", "12", "--compare", "transformers", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_requests"] == 10 and data["slots"] == 4 and 20 <= data["generated_tokens"] <= 120
    assert data["neuronfx_tok_s"] > 0 and data["transformers_tok_s"] > 0
    assert data["ratio"] == pytest.approx(data["neuronfx_tok_s"] / data["transformers_tok_s"])


def test_speculative_tiny(tmp_path, capsys):
    """Self-speculation with the first layer of two and the model as its own draft, each also
    fused: every row decodes; the draft model's acceptance is 1 (it is the target) and emits k
    tokens per pass; fused rows accept as their unfused ones."""
    smollm2_vocab_model(tmp_path)
    assert main(["bench", "speculative", "--model", str(tmp_path), "--backend", "eager", "--speculation-length", "3",
                 "--draft-layers", "1", "--draft-model", str(tmp_path), "--gen-lens", "9", "--fused", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in data["rows"]]
    assert names == ["plain decode", "self-speculation N=1 k=3", "self-speculation N=1 k=3 fused", "draft model k=3",
                     "draft model k=3 fused"] and data["rows"][0]["speedup"] == 1.0
    draft = data["rows"][3]
    assert draft["acceptance_rate"] == 1.0 and draft["mean_accepted_length"] > 2.5
    assert 0 <= data["rows"][1]["acceptance_rate"] <= 1
    for unfused, fused in (data["rows"][1:3], data["rows"][3:5]):  # fused: the same tokens, so the same acceptance
        assert fused["acceptance_rate"] == unfused["acceptance_rate"]


def test_tp_bench_cli_json(tiny_checkpoint, capsys):
    """``bench tensor-parallel --tp-degree 2``: one launch of two ranks, every figure in one JSON
    object; against the tp=1 configuration (run here in this process: a launch costs about 10 s
    of the suite) each rank of the tiny model holds about half the weights (4 heads, 2 KV heads
    and vocabulary 256 split evenly: only the norms are replicated)."""
    from neuronfx.bench.tensor_parallel import format_tp_ratio, tp_bench_rank, tp_ratio

    assert main(["bench", "tensor-parallel", "--model", tiny_checkpoint.source, "--backend", "eager", "--tp-degree", "2",
                 "--batch-sizes", "1", "--prompt-lens", "8", "--gen-lens", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (two,) = data["runs"]
    assert data["ratios"] == [] and two["tp_degree"] == 2 and [m["rank"] for m in two["ranks"]] == [0, 1]
    assert set(two["decode"]) == {"1"} and two["ttft_sp_s"] > 0 and "sp_error" not in two
    assert 0 < two["profile"]["collective_share"] < 1 and two["profile"]["steps"] == 10 - 1 - 2  # the slot's room after warm-up
    one = tp_bench_rank(tiny_checkpoint.config, tiny_checkpoint.source, 1, "eager", "float32", (1,), 2, 8)
    assert one["profile"]["collective_share"] == 0 and [m["rank"] for m in one["ranks"]] == [0] and "ttft_sp_s" not in one
    ratio = tp_ratio(two, one)
    assert 0.5 < ratio["weights_bytes_ratio"] < 0.52
    assert ratio["decode_tok_s_ratio"]["1"] == two["decode"]["1"]["decode_tok_s"] / one["decode"]["1"]["decode_tok_s"]
    assert format_tp_ratio(ratio, two).startswith(f"tp=2 / tp=1: decode tok/s B=1 x{ratio['decode_tok_s_ratio']['1']:.2f}")


def test_collective_figures_on_exact_events():
    """Collective time: the self time of collective events on the thread that ran the marked
    steps, per step and as a share of the steps' wall time; other threads are left out."""
    from types import SimpleNamespace as Event

    from neuronfx.bench.tensor_parallel import collective_figures

    events = [Event(name="step", thread=1, cpu_time_total=1000, self_cpu_time_total=0)] * 2 + [
        Event(name="_c10d_functional::all_gather_into_tensor", thread=1, cpu_time_total=0, self_cpu_time_total=150),
        Event(name="_c10d_functional::wait_tensor", thread=1, cpu_time_total=0, self_cpu_time_total=250),
        Event(name="_c10d_functional::wait_tensor", thread=2, cpu_time_total=0, self_cpu_time_total=9999),  # gloo's thread
        Event(name="aten::mm", thread=1, cpu_time_total=0, self_cpu_time_total=500),
    ]
    f = collective_figures(events, "step")
    assert f["step_wall_s"] == 1000e-6 and f["collective_s_per_step"] == 200e-6 and f["collective_share"] == 0.2
    assert f["collective_calls_per_step"] == {"_c10d_functional::all_gather_into_tensor": 0.5, "_c10d_functional::wait_tensor": 0.5}


# --- llama.cpp on a stand-in library, bandwidth, the comparison report ----------------------------


def test_llama_cpp_rows_and_rounds(tiny_gguf, capsys, monkeypatch):
    """``--compare llama.cpp`` through llama-cpp-python's calls on a stand-in: each case's prompts
    go in one batch (row b as sequence b, logits of each last token only), then one token per row
    per step at the next position, the argmax of the previous step; --rounds alternates the
    engines case by case and reports one ratio per round."""
    fake = FakeLlamaCpp(vocab=256)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    assert main(["bench", "latency", "--model", tiny_gguf, "--weight-format", "gguf", "--backend", "eager", "--compare", "llama.cpp",
                 "--batch-sizes", "2", "--prompt-lens", "5", "--gen-lens", "4", "--rounds", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(r["engine"], r["dtype"]) for r in data["results"]] == [("neuronfx", "float32/gguf"), ("llama.cpp", gguf_weight_type(tiny_gguf))]
    (row,) = data["rounds"]
    assert row["reference"] == "llama.cpp" and len(row["decode_tok_s_ratios"]) == 3 and data["ratios"][0]["reference"] == "llama.cpp"
    assert {r["engine"]: r["weight_bytes_per_step"] for r in data["bandwidth"]}["llama.cpp"] == gguf_decode_bytes(tiny_gguf, 2)
    prefill, *steps = fake.decodes[-4:]  # the last round: a prefill and 3 decode steps
    assert [(pos, seq, wanted) for _, pos, seq, wanted in prefill] == [(p, b, p == 4) for b in range(2) for p in range(5)]
    last = [prefill[4][0], prefill[9][0]]
    for i, step in enumerate(steps):
        assert step == [((t + 1) % 256, 5 + i, b, True) for b, t in enumerate(last)]
        last = [tok for tok, *_ in step]
    assert fake.contexts[-1].n_seq_max == 2 and fake.contexts[-1].kv_unified is False and fake.freed[-1] == "model"


def test_llama_cpp_after_neuronfx_without_rounds(tiny_gguf, monkeypatch):
    """Without --rounds llama.cpp runs every case after neuronfx's, on the same prompts."""
    fake = FakeLlamaCpp(vocab=256)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    assert main(["bench", "--model", tiny_gguf, "--weight-format", "gguf", "--backend", "eager", "--compare", "llama.cpp",
                 "--batch-sizes", "1", "2", "--prompt-lens", "6", "--gen-lens", "3"]) == 0
    prefills = [d for d in fake.decodes if len(d) > 2]
    assert [len(d) for d in prefills] == [8, 6, 16, 12]  # per batch size: the 8-token warm-up, then the case
    assert fake.loaded == [tiny_gguf.encode()]


def test_compare_llama_cpp_without_the_package(monkeypatch, capsys, tmp_path):
    """Missing llama-cpp-python: a named error with the extra to install, before any checkpoint is read."""
    from neuronfx.bench.llama_cpp import import_llama_cpp
    from neuronfx.errors import BackendUnavailableError

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    with pytest.raises(BackendUnavailableError, match=r"neuronfx\[bench\]"):
        import_llama_cpp()
    assert main(["bench", "--compare", "llama.cpp", "--model", str(tmp_path / "absent.gguf")]) == 2
    assert "pip install 'neuronfx[bench]'" in capsys.readouterr().err


def test_compare_llama_cpp_needs_a_gguf(tiny_checkpoint, capsys):
    assert main(["bench", "--compare", "llama.cpp", "--model", tiny_checkpoint.source]) == 2
    assert "--model must be a .gguf file" in capsys.readouterr().err


def _result(engine: str, batch: int, ttft: float, itl: list[float]):
    return summarize(engine, "x", "bfloat16" if engine == "neuronfx" else "Q4_1", batch, 128, ttft, itl)


def test_comparison_table_side_by_side():
    """neuronfx at 50 tok/s and TTFT 100 ms against 25 tok/s and 200 ms: x2.00 and x0.50."""
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

    from neuronfx.graphs.models.quant import Int8Weight, pack_int8

    embed = torch.zeros(100, 8)  # 3200 bytes, 32 per row
    layer = {"q": Int8Weight(torch.zeros(8, 8, dtype=torch.int8), torch.zeros(8)), "norm": torch.zeros(8, dtype=torch.bfloat16)}
    untied = {"embed": embed, "norm": torch.zeros(8), "lm_head": torch.zeros(100, 8, dtype=torch.bfloat16), "layers": [layer, layer]}
    assert decode_weight_bytes(untied, 3) == (64 + 32 + 16) + 32 + 1600 + 3 * 32  # the shared layer once
    tied = untied | {"lm_head": embed}
    assert decode_weight_bytes(tied, 3) == (64 + 32 + 16) + 32 + 3200
    # a packed int8 weight: its packed data and scales, not the row-major copy prefill reads
    q16 = Int8Weight(torch.zeros(16, 8, dtype=torch.int8), torch.zeros(16))  # 128 + 64 bytes, packed or not
    packed = untied | {"layers": [layer | {"q": pack_int8(q16)}]}
    assert decode_weight_bytes(packed, 3) == (128 + 64 + 16) + 32 + 1600 + 3 * 32


def test_bandwidth_rows():
    rows = bandwidth_rows([_result("neuronfx", 1, 0.1, [0.02, 0.02]), _result("llama.cpp", 1, 0.1, [0.01])],
                          {("neuronfx", 1): 10**8}, read_bytes_s=10**10)
    assert len(rows) == 1 and rows[0]["bytes_per_s"] == pytest.approx(5e9) and rows[0]["share_of_read_bandwidth"] == pytest.approx(0.5)


def test_rounds_alternate_the_engines_and_report_the_median_round():
    """Round i runs the runners in turn, the first one alternating; each engine's reported
    result is its median round by decode tok/s, and the ratios pair rounds."""
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


def test_format_ab_reports_medians_and_same_round_ratios():
    lines = format_ab("batch 1", {"new": [0.010, 0.020, 0.012], "old": [0.011, 0.030, 0.012]}, "old", "new")
    assert lines[0].endswith("10.00 20.00 12.00; median 12.00") and lines[0].startswith("batch 1 new")
    assert lines[1].endswith("11.00 30.00 12.00; median 12.00")
    assert lines[2] == "batch 1 old / new per round: 1.100 1.500 1.000; median 1.100x"


def test_quant_path_line_names_the_kernels_path_of_quantized_inductor_plans_only():
    from neuronfx.graphs.kernels import library as kernels

    def spec(backend, device, weights, activations):
        return LatencySpec(backend=backend, dtype="float32", batch_sizes=(1,), device=device, weight_format=weights,
                           activation_format=activations)

    assert quant_path(spec("eager", "cpu", "gguf", "float")) is None
    assert quant_path(spec("inductor", "cpu", "float", "float")) is None
    assert quant_path(spec("inductor", "cuda", "int8", "float")) is None
    if not kernels.small_gemm_available():
        assert "fallback" in quant_path(spec("inductor", "cpu", "gguf", "float"))
        return
    assert quant_path(spec("inductor", "cpu", "gguf", "float")) == f"quantized decode products: {kernels.quant_isa()} path"
    assert quant_path(spec("inductor", "cpu", "int4", "int8")) == (
        f"quantized decode products: {kernels.quant_int8_x_isa()} (int8 activations) path")


def test_speculative_bench_needs_a_chat_template():
    """A tokenizer with no chat template: an InputError naming the fix, not transformers' traceback."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from neuronfx.bench.speculative import chat_prompts
    from neuronfx.errors import InputError

    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"w0": 0}, unk_token="w0")))
    with pytest.raises(InputError, match="cannot render chat prompts .* an instruct model"):
        chat_prompts(plain)


def test_kv_blocks_bench_tiny(tiny_checkpoint, capsys):
    """`bench kv-blocks` on a tiny model: the blocks layout with its own batch buckets and a bf16
    KV cache serves more requests at once than 2 slots, every output equal across the layouts and
    to the lone runs."""
    assert main(["bench", "kv-blocks", "--model", tiny_checkpoint.source, "--backend", "eager", "--slots", "8",
                 "--sequence-length", "64", "--block-size", "8", "--max-num-seqs", "12", "--batch-buckets", "1", "8", "12",
                 "--kv-cache-dtype", "bf16", "--chunk", "16", "--requests", "24", "--prompt-lens", "4", "24", "--output-lens",
                 "16", "36", "--solo", "2", "--prompt-tokens", "8", "--gen-tokens", "3", "--rounds", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["capacity"]
    assert data["same_outputs"] and data["solo_equal"] and data["blocks_batch_buckets"] == [1, 8, 12]
    assert data["kv_dtypes"] == {"slots": "bfloat16", "blocks": "bfloat16"}
    assert data["slots"]["peak_running"] == 8 < data["blocks"]["peak_running"] <= 12
    assert data["slots"]["generated"] == data["blocks"]["generated"] > 0


@pytest.mark.parametrize("args, message", [
    (["--max-num-seqs", "16", "--batch-buckets", "1", "8"], "--batch-buckets ends at 8; the blocks layout's largest batch bucket"),
    (["--max-num-seqs", "16", "--batch-buckets", "8", "4", "16"], "batch_buckets=(8, 4, 16) must be strictly increasing"),
    (["--slots", "4"], "--slots=4 is below 8: figure 2 decodes batch 8 on both layouts"),
])
def test_kv_blocks_bench_rejects_bad_sizes(tiny_checkpoint, capsys, args, message):
    """Bad sizes are named before anything compiles (the buckets' order: by the plan, before either layout compiles)."""
    assert main(["bench", "kv-blocks", "--model", tiny_checkpoint.source, "--backend", "eager", *args]) == 2
    assert message in capsys.readouterr().err
