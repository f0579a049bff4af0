"""``neuronfx bench latency --compare openvino`` on stand-ins of openvino, openvino_genai and
optimum-intel (``fake_openvino``): the CLI path with rounds, the report and the token
agreement, the export and its cache, the missing-package and bad-option errors, and the pure
pieces (weights mapping, KV cache size, token agreement) on exact values."""

from __future__ import annotations

import json
import sys
import types

import fake_openvino
import pytest
import torch
from helpers import tiny_hf_model

from neuronfx.bench.latency_run import format_agreement, token_agreement
from neuronfx.bench.openvino import PipelineSizes, kv_cache_gib, run_openvino, scheduler_config
from neuronfx.bench.openvino_export import OVWeights, import_exporter, ov_weights
from neuronfx.cli import main
from neuronfx.errors import BackendUnavailableError


@pytest.fixture(autouse=True)
def small_read_probe(monkeypatch):
    """Every latency run measures the read bandwidth; 4 MiB instead of 128 keeps these tests fast."""
    monkeypatch.setattr("neuronfx.bench.bandwidth.READ_PROBE_BYTES", 4 * 2**20)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("tiny")
    tiny_hf_model("llama", seed=0).save_pretrained(directory)
    return str(directory)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setenv("NEURONFX_CACHE_DIR", str(tmp_path / "cache"))
    return fake_openvino.install(monkeypatch)


def latency(model: str, *args: str) -> int:
    return main(["bench", "latency", "--model", model, "--backend", "eager", "--compare", "openvino", *args])


def test_compare_openvino_with_rounds_reports_both_engines_and_the_agreement(tiny_dir, fake, capsys):
    """Each case's prompts go in as one request per row (int64 ids), greedy, exactly gen_len
    tokens, one step per token; the pipeline runs on the bench's threads in its dtype; the
    rounds alternate; the fake's tokens are transformers', so they equal neuronfx's eager ones."""
    assert latency(tiny_dir, "--batch-sizes", "2", "--prompt-lens", "5", "--gen-lens", "4", "--rounds", "2") == 0
    out = capsys.readouterr().out
    assert "neuronfx (eager, float32) vs openvino (cb-cpu, f32/fp32 (kv u8))" in out
    assert "B=2 prompt=5 gen=4: decode tok/s neuronfx / openvino per round " in out
    assert "B=2 prompt=5 gen=4: openvino's greedy tokens equal neuronfx's for 8/8 tokens (up to each row's first difference), " \
           "2/2 rows identical" in out
    (pipe,) = fake.pipelines
    assert pipe.properties == {"INFERENCE_NUM_THREADS": torch.get_num_threads(), "INFERENCE_PRECISION_HINT": "f32"}
    assert pipe.device == "CPU" and pipe.scheduler_config.enable_prefix_caching is False
    # the warm-up (2 rows of 8 tokens), 2 rounds of the case, then the case once more for its tokens
    assert [len(h.ids) for h in pipe.requests] == [8, 8] + [5, 5] * 3
    assert all(len(h.generated) == h.config.max_new_tokens for h in pipe.requests)
    assert pipe.requests[2].ids == pipe.requests[-2].ids != pipe.requests[3].ids


def test_compare_openvino_json_and_export_cache(tiny_dir, fake, capsys):
    """The IR is exported once per (source, weights): a second run reads it from the cache;
    int4 exports again with int4_asym in groups of --weight-group-size, every matrix 4-bit."""
    args = ("--batch-sizes", "1", "--prompt-lens", "6", "--gen-lens", "3", "--json")
    assert latency(tiny_dir, *args) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(r["engine"], r["dtype"]) for r in data["results"]] == [("neuronfx", "float32"), ("openvino", "f32/fp32 (kv u8)")]
    (row,) = data["agreement"]
    assert (row["matching"], row["tokens"], row["identical_rows"], row["first_difference"]) == (3, 3, 1, [None])
    assert fake.exports == [{"export": True, "compile": False, "load_in_8bit": False, "quantization_config": None}]
    assert latency(tiny_dir, *args) == 0
    assert len(fake.exports) == 1 and len(fake.pipelines) == 2
    assert latency(tiny_dir, *args, "--weight-format", "int4", "--weight-group-size", "64") == 0
    assert len(fake.exports) == 2
    assert fake.exports[1]["quantization_config"].kwargs == {"bits": 4, "sym": False, "group_size": 64, "ratio": 1.0}


def test_export_log_names_the_cache(tiny_dir, fake, capsys):
    assert latency(tiny_dir, "--batch-sizes", "1", "--prompt-lens", "4", "--gen-lens", "2") == 0
    assert latency(tiny_dir, "--batch-sizes", "1", "--prompt-lens", "4", "--gen-lens", "2") == 0
    out = capsys.readouterr().out
    assert out.count("openvino: exporting") == 1 and out.count("openvino: IR (fp32) from the cache") == 1


def test_missing_packages_name_the_extra(fake, monkeypatch, capsys, tmp_path):
    """openvino-genai, optimum-intel or nncf missing: one line naming the extra, before the
    checkpoint is read (it does not exist here)."""
    absent = str(tmp_path / "absent.gguf")
    for missing, named in (("openvino_genai", "need openvino-genai"), ("optimum.intel", "need optimum-intel to export"),
                           ("nncf", "need nncf to export")):
        with monkeypatch.context() as m:
            m.setitem(sys.modules, missing, None)  # import (or find_spec) finds nothing
            assert latency(absent) == 2
        err = capsys.readouterr().err
        assert f"BackendUnavailableError: the OpenVINO engines (bench latency --compare openvino, bench engines --engines openvino-*) {named}" in err
        assert "pip install 'neuronfx[bench-openvino]'" in err and len(err.strip().splitlines()) == 1
    assert fake.exports == []


def test_exporter_that_cannot_import_names_transformers(monkeypatch):
    """optimum-intel installed but broken by the installed transformers (2.2 with 5.25)."""
    broken = fake_openvino.module("optimum.intel")
    def fail(name: str) -> None:  # what optimum-intel 2.2's lazy import raises under transformers 5.25
        raise ImportError("cannot import name 'VisionRotaryEmbedding' from 'transformers.models.qwen2_vl.modeling_qwen2_vl'")

    broken.__getattr__ = fail
    monkeypatch.setitem(sys.modules, "optimum", fake_openvino.module("optimum", __path__=[]))
    monkeypatch.setitem(sys.modules, "optimum.intel", broken)
    monkeypatch.setitem(sys.modules, "nncf", fake_openvino.module("nncf"))
    with pytest.raises(BackendUnavailableError, match=r"cannot import with transformers .*VisionRotaryEmbedding.*neuronfx\[bench-openvino\]"):
        import_exporter()


@pytest.mark.parametrize("args, names", [
    (["--device", "cuda"], "--device cuda with --compare openvino: openvino runs on the CPU here"),
    (["--compare-dtype", "bfloat16"], "--compare openvino takes no --compare-dtype"),
])
def test_bad_combinations_are_input_errors(args, names, fake, capsys):
    assert latency("/nonexistent.gguf", *args) == 2
    err = capsys.readouterr().err
    assert "error: InputError:" in err and names in err
    assert fake.exports == []


def test_run_openvino_refuses_a_split_prefill(tiny_dir, fake):
    """A scheduler that could not prefill every prompt in the first step would make TTFT the
    wrong thing: an error, not a figure."""
    genai = sys.modules["openvino_genai"]
    sizes = PipelineSizes(max_batch=2, max_prompt=6, max_tokens=9)
    sc = scheduler_config(genai, {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}, sizes)
    sc.max_num_batched_tokens = 8  # the two 6-token prompts need 12
    pipe = genai.ContinuousBatchingPipeline(tiny_dir, sc, "CPU", {})
    with pytest.raises(RuntimeError, match=r"took 4 steps for 3 tokens per row"):
        run_openvino(genai, sys.modules["openvino"], pipe, [[3] * 6, [4] * 6], 3)
    sc.max_num_batched_tokens = 12
    (ttft, itl), tokens = run_openvino(genai, sys.modules["openvino"], pipe, [[3] * 6, [4] * 6], 3)
    assert ttft > 0 and len(itl) == 2 and [len(row) for row in tokens] == [3, 3]


def test_weights_of_each_format():
    assert ov_weights("float", 32) == OVWeights(bits=None) and OVWeights(bits=None).name == "fp32"
    assert ov_weights("int8", 32).name == "int8_asym"
    assert ov_weights("int4", 128).name == "int4_asym_g128"
    assert ov_weights("gguf", 128).name == "int4_asym_g32"  # the file's 32-value blocks, whatever --weight-group-size says


def test_kv_cache_gib_counts_four_bytes_a_value():
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}  # SmolLM2-135M
    assert kv_cache_gib(config, PipelineSizes(max_batch=8, max_prompt=1024, max_tokens=1152)) == 1  # 2*30*3*64*4 B * 9216 = 0.40 GiB
    assert kv_cache_gib(config, PipelineSizes(max_batch=64, max_prompt=4096, max_tokens=4224)) == 12  # 46080 B * 270336 = 11.6 GiB
    scheduler = scheduler_config(types.SimpleNamespace(SchedulerConfig=fake_openvino.SchedulerConfig), config,
                                 PipelineSizes(max_batch=8, max_prompt=1024, max_tokens=1152))
    assert (scheduler.max_num_batched_tokens, scheduler.max_num_seqs, scheduler.cache_size) == (8192, 256, 1)


def test_token_agreement_counts_up_to_each_rows_first_difference():
    row = token_agreement("openvino", [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]], [[1, 2, 3, 4], [5, 0, 7, 8], [0, 9, 9, 9]], 16)
    assert row == {"engine": "openvino", "reference": "neuronfx", "batch_size": 3, "prompt_len": 16, "gen_len": 4,
                   "matching": 5, "tokens": 12, "identical_rows": 1, "first_difference": [None, 1, 0]}
    assert format_agreement(row) == ("B=3 prompt=16 gen=4: openvino's greedy tokens equal neuronfx's for 5/12 tokens "
                                     "(up to each row's first difference), 1/3 rows identical")
