"""``neuronfx bench engines``: issue 34's table in one run, on tiny models with stand-ins of
llama-cpp-python and OpenVINO: every engine times every case in alternating rounds, the token
agreement is counted against transformers, the targets are computed from the median rounds, and
bad options fail before anything loads."""

from __future__ import annotations

import json
import sys

import fake_openvino
import pytest
from fake_llama_cpp import FakeLlamaCpp
from helpers import tiny_hf_model, write_tiny_gguf

from neuronfx.bench.engines import EnginesSpec, targets
from neuronfx.cli import main


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    return write_tiny_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"), tiny_hf_model("llama", seed=5))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("tiny")
    tiny_hf_model("llama", seed=0).save_pretrained(directory)
    return str(directory)


def engines(model: str, *args: str) -> list[str]:
    return ["bench", "engines", "--model", model, "--backend", "eager", "--batch-sizes", "1", "2", "--prompt-len", "5",
            "--long-prompt-len", "12", "--gen-len", "4", "--agreement-tokens", "3", "--rounds", "2", *args]


def test_engines_table_with_llama_cpp(tiny_gguf, capsys, monkeypatch):
    """neuronfx fp32 and kept blocks, transformers and llama.cpp (a stand-in whose next token is
    the last one plus 1): one row per engine and case with both rounds, neuronfx fp32's greedy
    tokens of the three chat prompts (the tiny .gguf has a tokenizer) equal transformers' (token-exact)."""
    fake = FakeLlamaCpp(vocab=256)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    argv = engines(tiny_gguf, "--engines", "neuronfx-fp32", "neuronfx-gguf", "transformers", "llama.cpp", "--json")
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    cases = {(r["batch_size"], r["prompt_len"], r["gen_len"]) for r in data["rows"]}
    assert cases == {(1, 5, 4), (2, 5, 4), (1, 12, 2)}
    assert sorted({r["engine"] for r in data["rows"]}) == ["llama.cpp", "neuronfx-fp32", "neuronfx-gguf", "transformers"]
    assert all(len(r["decode_tok_s_rounds"]) == 2 and r["decode_tok_s"] > 0 for r in data["rows"])
    agree = {a["engine"]: a for a in data["agreement"]}
    assert agree["neuronfx-fp32"]["matching"] == agree["neuronfx-fp32"]["tokens"] == 9 and agree["neuronfx-fp32"]["reference"] == "transformers"
    assert set(agree) == {"neuronfx-fp32", "neuronfx-gguf", "llama.cpp"}
    assert {t["target"] for t in data["targets"]} == {"batch-1 decode over llama.cpp's", "TTFT at the prompt length over the best peer's",
                                                       "TTFT at the long prompt over the best peer's"}
    assert len([d for d in fake.decodes if len(d) == 12]) == 2  # the long prompt's prefill, once per round
    # the human table: one line per engine, in the order asked
    assert main(argv[:-1]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| engine | weights | decode tok/s B=1 | decode tok/s B=2 | TTFT ms B=1 | TTFT ms B=2 | TTFT ms 12 tokens")
    assert [line.split(" | ")[0][2:] for line in lines[2:]] == ["neuronfx-fp32", "neuronfx-gguf", "transformers", "llama.cpp"]
    assert lines[4].endswith("| reference |") and lines[2].endswith("| 9/9 |")


def test_engines_with_openvino(tiny_dir, capsys, monkeypatch, tmp_path):
    """OpenVINO engines run on their exports (cached under NEURONFX_CACHE_DIR); the stand-in's
    tokens are transformers', so its agreement is full (the tiny directory has no tokenizer: the random
    prompt); batch-8 targets need a batch of 8."""
    monkeypatch.setenv("NEURONFX_CACHE_DIR", str(tmp_path / "cache"))
    fake = fake_openvino.install(monkeypatch)
    assert main(engines(tiny_dir, "--engines", "neuronfx-fp32", "transformers", "openvino-fp32", "openvino-int8",
                        "--long-prompt-len", "0", "--json")) == 0
    data = json.loads(capsys.readouterr().out)
    assert {(r["engine"], r["batch_size"]) for r in data["rows"]} == {(e, b) for e in ("neuronfx-fp32", "transformers", "openvino-fp32",
                                                                                      "openvino-int8") for b in (1, 2)}
    assert {a["engine"]: a["matching"] for a in data["agreement"]} == {"neuronfx-fp32": 3, "openvino-fp32": 3, "openvino-int8": 3}
    assert len(fake.pipelines) == 2
    assert [t["batch_size"] for t in data["targets"]] == [1, 2]  # TTFT per batch size only: no llama.cpp, no batch of 8


def test_targets_pick_the_best_of_each_side():
    """Decode: the fastest neuronfx engine over llama.cpp / the fastest OpenVINO; TTFT: the
    quickest neuronfx over the quickest peer (transformers is the reference, not a peer)."""
    spec = EnginesSpec(engines=("neuronfx-fp32", "neuronfx-int8", "transformers", "llama.cpp", "openvino-int8", "openvino-int4"),
                       model="m.gguf", backend="eager", batch_sizes=(1, 8), prompt_len=128, long_prompt_len=0, gen_len=8,
                       agreement_tokens=4, rounds=1)
    figures = {("neuronfx-fp32", 1): (50, 0.2), ("neuronfx-int8", 1): (150, 0.3), ("transformers", 1): (20, 0.05),
               ("llama.cpp", 1): (100, 0.5), ("openvino-int8", 1): (60, 0.25), ("openvino-int4", 1): (70, 0.4),
               ("neuronfx-fp32", 8): (300, 1.0), ("neuronfx-int8", 8): (280, 1.5), ("transformers", 8): (70, 2.0),
               ("llama.cpp", 8): (200, 2.0), ("openvino-int8", 8): (250, 0.9), ("openvino-int4", 8): (240, 0.8)}
    rows = [{"engine": e, "batch_size": b, "prompt_len": 128, "decode_tok_s": d, "ttft_s": t} for (e, b), (d, t) in figures.items()]
    got = {(t["target"], t.get("batch_size")): (t["neuronfx"], t["peer"], round(t["ratio"], 3), t["met"]) for t in targets(rows, spec)}
    assert got == {("batch-1 decode over llama.cpp's", None): ("neuronfx-int8", "llama.cpp", 1.5, True),
                   ("batch-8 decode over the best OpenVINO's", None): ("neuronfx-fp32", "openvino-int8", 1.2, True),
                   ("TTFT at the prompt length over the best peer's", 1): ("neuronfx-fp32", "openvino-int8", 0.8, True),
                   ("TTFT at the prompt length over the best peer's", 8): ("neuronfx-fp32", "openvino-int4", 1.25, False)}


@pytest.mark.parametrize("args, message", [
    (["--engines", "neuronfx-fp32", "vllm"], "unknown: vllm"),
    (["--engines", "transformers", "transformers"], "one is repeated"),
    (["--engines", "neuronfx-gguf"], "--model must be a .gguf file"),
    (["--gen-len", "1"], "--gen-len has [1]"),
    (["--rounds", "0"], "--rounds has [0]"),
    (["--batch-sizes", "1", "2", "1"], "--batch-sizes 1 2 1 repeats a size"),
    (["--prompt-len", "16", "--long-prompt-len", "16"], "--long-prompt-len 16 must be longer than --prompt-len 16"),
    (["--engines", "neuronfx-fp32", "neuronfx-int8-auto", "--backend", "eager"],
     "--engines neuronfx-int8-auto with --backend eager: activation_format='auto' with backend='eager'"),
])
def test_engines_checks_options_before_loading(tiny_dir, args, message, capsys, monkeypatch):
    monkeypatch.setattr("neuronfx.io.checkpoints.load_checkpoint", None)  # nothing is read: the checks come first
    assert main(["bench", "engines", "--model", tiny_dir, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("engine, module, extra", [("llama.cpp", "llama_cpp", "neuronfx[bench]"),
                                                   ("openvino-int4", "openvino_genai", "neuronfx[bench-openvino]")])
def test_engines_names_the_missing_extra(tiny_gguf, capsys, monkeypatch, engine, module, extra):
    """One line naming this command's --engines (not bench latency's --compare alone) and the extra."""
    monkeypatch.setitem(sys.modules, module, None)
    assert main(["bench", "engines", "--model", tiny_gguf, "--engines", engine]) == 2
    err = capsys.readouterr().err
    assert f"pip install '{extra}'" in err and "bench engines --engines " in err and len(err.strip().splitlines()) == 1


def test_agreement_longer_than_the_decode_plans(tmp_path, capsys):
    """--agreement-tokens past the plans' default 512 positions, batch 1 not among --batch-sizes:
    the batch-1 plan is sized for the agreement (it failed after every case was timed), and
    neuronfx fp32's 520 tokens equal transformers' (the tiny directory has no tokenizer: the random prompt)."""
    tiny_hf_model("llama", seed=0, max_position_embeddings=1024).save_pretrained(tmp_path)
    argv = ["bench", "engines", "--model", str(tmp_path), "--backend", "eager", "--engines", "neuronfx-fp32", "transformers",
            "--batch-sizes", "2", "--prompt-len", "5", "--gen-len", "2", "--long-prompt-len", "0", "--agreement-tokens", "520",
            "--rounds", "1", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["agreement"] == [{"engine": "neuronfx-fp32", "reference": "transformers", "matching": 520,
                                                                  "tokens": 520, "first_difference": [None]}]


@pytest.mark.parametrize("model, args, message", [
    ("dir", ["--prompt-len", "250", "--gen-len", "10"], "--prompt-len + --gen-len = 260; the longest agreement prompt (250 tokens) "
     "+ --agreement-tokens = 274 positions: past the model's max_position_embeddings 256; lower them"),  # the random prompt
    ("dir", ["--long-prompt-len", "300"], "--long-prompt-len + its 2 new tokens = 302 positions"),
    ("gguf", ["--agreement-tokens", "250"], "the longest agreement prompt ("),
])
def test_engines_checks_positions_before_loading(tiny_dir, tiny_gguf, model, args, message, capsys, monkeypatch):
    """Rows past the model's max_position_embeddings (256 here; the chat prompts are tokenized
    first): one line before any engine opens."""
    monkeypatch.setattr("neuronfx.bench.engines.open_engines", None)
    argv = ["bench", "engines", "--model", tiny_dir if model == "dir" else tiny_gguf, "--backend", "eager",
            "--engines", "neuronfx-fp32", "transformers", "--prompt-len", "5", "--gen-len", "4", "--long-prompt-len", "0", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_agreement_counts_up_to_transformers_eos():
    """Rows are compared over transformers' tokens before its eos: an engine that takes the eos
    (or forbids it) and goes on is not counted against there; a difference before it is."""
    from neuronfx.bench.engines import agreement
    from neuronfx.bench.timing import Engine

    def engine(name: str, row: list[int]) -> Engine:
        return Engine(name=name, backend="x", dtype="x", time=lambda p, g: (0.0, []), tokens=lambda p, g: [row[:g]])

    engines = {"transformers": engine("transformers", [5, 6, 7]), "same": engine("same", [5, 6, 7, 2, 2]),
               "late": engine("late", [5, 6, 9, 2, 2]), "none": engine("none", [1, 6, 7, 9, 9])}
    got = {a["engine"]: (a["matching"], a["tokens"], a["first_difference"]) for a in agreement(engines, [[3, 4, 5]], 5)}
    assert got == {"same": (3, 3, [None]), "late": (2, 3, [2]), "none": (0, 3, [0])}


def test_greedy_transformers_ends_before_eos():
    from neuronfx.bench.timing import greedy_transformers

    model = tiny_hf_model("llama", seed=3).eval()
    prompts = [[3, 4, 5, 6]]
    free = greedy_transformers(model, prompts, 6)[0]
    assert len(free) == 6
    model.generation_config.eos_token_id = free[2]
    cut = free.index(free[2])  # the eos' first occurrence
    assert greedy_transformers(model, prompts, 6) == [free[:cut]]
