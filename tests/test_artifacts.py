"""Saved runtimes: round trips give identical tokens and logits; damaged or foreign artifacts
give ArtifactError/ConfigError before anything runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import attrs
import pytest
import torch
from helpers import hf_greedy, random_prompt, run_steps, tiny_hf_model, tiny_runtime

import neuronfx
from neuronfx.errors import ArtifactError, ConfigError
from neuronfx.graphs.backends.inductor_dir import INDUCTOR_DIR
from neuronfx.io.artifacts import GENERATION_CONFIG, MANIFEST, PLAN, WEIGHTS, sha256

PROMPTS = [random_prompt(9, seed=1), random_prompt(4, seed=2)]


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("qwen2", seed=4)


def outputs(rt):
    tokens, logits, _, _ = run_steps(rt, neuronfx.init_state(rt), [0, 1], PROMPTS, 6)
    return tokens, logits


@pytest.mark.parametrize("backend", ["eager", "export", "inductor"])
def test_round_trip_identical_tokens_and_logits(hf, backend, request, tmp_path):
    if backend == "inductor":  # the session's shared runtime: 6 graphs, already compiled
        rt = request.getfixturevalue("inductor_qwen2")[1]
    else:
        rt = tiny_runtime(hf, backend, prefill_buckets=(32,), decode_buckets=(64,))  # 2 graphs
    want_tokens, want_logits = outputs(rt)
    neuronfx.save(rt, tmp_path / "rt")
    if backend == "inductor":  # the compiled kernels ship: loading compiles no C++
        assert any(p.suffix == ".so" for p in (tmp_path / "rt" / INDUCTOR_DIR).rglob("*"))
    if backend == "export":  # a .pt2 is its program; the weights are in weights.safetensors only (they were in each)
        weight_bytes = (tmp_path / "rt" / WEIGHTS).stat().st_size
        for graph in (tmp_path / "rt" / "graphs").glob("*.pt2"):
            data = sum(m.file_size for m in zipfile.ZipFile(graph).infolist() if m.filename.split("/", 1)[1].startswith("data/"))
            assert data < 16 * 1024 < weight_bytes / 10
    loaded = neuronfx.load(tmp_path / "rt")
    assert loaded.plan == rt.plan
    tokens, logits = outputs(loaded)
    assert tokens == want_tokens
    for a, b in zip(logits, want_logits):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert json.loads((tmp_path / "rt" / GENERATION_CONFIG).read_text())["eos_token_id"] == list(rt.plan.model.eos_token_ids)
    if backend == "inductor":  # and in a fresh process (custom ops registered, kernels found)
        assert _tokens_in_fresh_process(tmp_path / "rt") == want_tokens
        # a process without the kernel library: a named ArtifactError, not the loader's ImportError
        without = subprocess.run([sys.executable, "-c", FRESH, str(tmp_path / "rt"), str(Path(__file__).parent)],
                                 capture_output=True, text=True, timeout=600, env=os.environ | {"NEURONFX_KERNELS": "0"})
        assert without.returncode != 0 and "neuronfx.errors.ArtifactError" in without.stderr, without.stderr[-3000:]
        assert "undefined symbol: aoti_torch_cpu_" in without.stderr and "NEURONFX_KERNELS=0 turns the kernel library off" in without.stderr


FRESH = """
import sys, json
sys.path.insert(0, sys.argv[2])
import neuronfx
from helpers import run_steps, random_prompt
rt = neuronfx.load(sys.argv[1])
tokens, _, _, _ = run_steps(rt, neuronfx.init_state(rt), [0, 1], [random_prompt(9, seed=1), random_prompt(4, seed=2)], 6)
print(json.dumps(tokens))
"""


def test_speculative_inductor_round_trip(inductor_speculative, tmp_path):
    """Speculate and draft graphs save and load too; greedy self-speculation at k = 4 on inductor
    gives transformers' greedy tokens, and the loaded runtime the same ones."""
    hf, rt = inductor_speculative
    prompts = [random_prompt(9, seed=1), random_prompt(4, seed=2)]
    want, _ = neuronfx.generate(rt, neuronfx.init_state(rt), prompts, max_new_tokens=10, eos_token_ids=[])
    assert [list(t) for t in want.token_ids] == [hf_greedy(hf, p, 10) for p in prompts]
    assert all(s.drafted == 3 * s.target_passes > 0 for s in want.speculation)
    loaded = neuronfx.load(neuronfx.save(rt, tmp_path / "rt"))
    assert loaded.can_speculate and loaded.plan == rt.plan
    got, _ = neuronfx.generate(loaded, neuronfx.init_state(loaded), prompts, max_new_tokens=10, eos_token_ids=[])
    assert got.token_ids == want.token_ids and got.speculation == want.speculation


def _tokens_in_fresh_process(directory: Path) -> list[list[int]]:
    done = subprocess.run([sys.executable, "-c", FRESH, str(directory), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_tied_weights_stored_once(tmp_path):
    hf = tiny_hf_model("llama", seed=0)
    hf.config.tie_word_embeddings = True
    hf.tie_weights()
    rt = tiny_runtime(hf, "eager")
    assert rt.weights["lm_head"] is rt.weights["embed"]
    neuronfx.save(rt, tmp_path / "rt")
    manifest = json.loads((tmp_path / "rt" / MANIFEST).read_text())
    assert manifest["aliases"] == {"lm_head": "embed"}
    loaded = neuronfx.load(tmp_path / "rt")
    assert loaded.weights["lm_head"].data_ptr() == loaded.weights["embed"].data_ptr()


@pytest.fixture(scope="module")
def exported(hf):
    return tiny_runtime(hf, "export", prefill_buckets=(32,), decode_buckets=(64,))


@pytest.fixture()
def saved(exported, tmp_path):
    return neuronfx.save(exported, tmp_path / "rt")


def test_truncated_graph_file(saved):
    graph = next((saved / "graphs").iterdir())
    graph.write_bytes(graph.read_bytes()[:100])
    with pytest.raises(ArtifactError, match=f"{graph.name} is corrupt"):
        neuronfx.load(saved)


def test_flipped_byte_in_weights(saved):
    data = bytearray((saved / WEIGHTS).read_bytes())
    data[-5] ^= 0xFF
    (saved / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="weights.safetensors is corrupt"):
        neuronfx.load(saved)


def test_missing_file(saved):
    (saved / WEIGHTS).unlink()
    with pytest.raises(ArtifactError, match="weights.safetensors is missing"):
        neuronfx.load(saved)


def test_manifest_from_another_torch_version(saved):
    manifest = json.loads((saved / MANIFEST).read_text())
    manifest["environment"]["torch"] = "1.0.0"
    (saved / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=re.escape(f"torch '1.0.0', this process has '{torch.__version__}'") + ".*rebuild"):
        neuronfx.load(saved)


def test_plan_with_unknown_key(saved):
    plan = json.loads((saved / PLAN).read_text())
    plan["inference"]["bogus"] = 1
    (saved / PLAN).write_text(json.dumps(plan))
    manifest = json.loads((saved / MANIFEST).read_text())
    manifest["files"][PLAN] = sha256(saved / PLAN)  # a consistent but invalid artifact
    (saved / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="bogus"):
        neuronfx.load(saved)


def test_manifest_from_another_machine_or_python(saved):
    manifest = json.loads((saved / MANIFEST).read_text())
    manifest["environment"]["python"] = "2.7.18"
    (saved / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="python '2.7.18'.*rebuild it here"):
        neuronfx.load(saved)


def test_inductor_runtime_without_its_compiled_files(hf, tmp_path):
    rt = tiny_runtime(hf, "eager")
    rt = attrs.evolve(rt, plan=attrs.evolve(rt.plan, inference=attrs.evolve(rt.plan.inference, backend="inductor")))
    with pytest.raises(ArtifactError, match="compiled files .* are gone"):
        neuronfx.save(rt, tmp_path / "rt")
    assert not (tmp_path / "rt" / WEIGHTS).exists()  # refused before writing


def test_not_an_artifact(tmp_path):
    with pytest.raises(ArtifactError, match="no manifest.json"):
        neuronfx.load(tmp_path)


def test_failed_save_leaves_the_saved_runtime_as_it_was(exported, saved):
    want = outputs(neuronfx.load(saved))
    with pytest.raises(ArtifactError, match="tokenizer=.*could not be saved"):
        neuronfx.save(exported, saved, tokenizer=object())
    assert outputs(neuronfx.load(saved))[0] == want[0]
    assert not [p for p in saved.parent.iterdir() if "-saving-" in p.name]  # no temporary directory left


def test_save_into_a_file_or_not_a_runtime(exported, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ArtifactError, match="is a file"):
        neuronfx.save(exported, tmp_path / "file")
    checkpoint = tmp_path / "checkpoint"  # a model directory: saving into it would overwrite its generation_config.json
    checkpoint.mkdir()
    (checkpoint / GENERATION_CONFIG).write_text('{"eos_token_id": 7}')
    with pytest.raises(ArtifactError, match="holds files but no saved runtime .no manifest.json.; saving would overwrite them"):
        neuronfx.save(exported, checkpoint)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "file"]  # nothing written, no temp dir left
    assert [p.name for p in checkpoint.iterdir()] == [GENERATION_CONFIG]
    assert (checkpoint / GENERATION_CONFIG).read_text() == '{"eos_token_id": 7}'
    (tmp_path / "empty").mkdir()
    assert (neuronfx.save(exported, tmp_path / "empty") / MANIFEST).is_file()  # an empty directory is fine
    with pytest.raises(ArtifactError, match="cannot write in '/proc' .*save to a directory you can write"):
        neuronfx.save(exported, "/proc/neuronfx-never-written")
    with pytest.raises(neuronfx.errors.InputError, match="runtime is a State"):
        neuronfx.save(neuronfx.init_state(exported), tmp_path / "rt")
    with pytest.raises(neuronfx.errors.InputError, match="directory path or a hub repo id"):
        neuronfx.load(None)


@pytest.mark.parametrize("edit, reason", [
    (lambda m: m.update(environment=None), "'environment' is None"),
    (lambda m: m.update(files=[]), "'files' is \\[\\]"),
    (lambda m: m.pop("aliases"), "'aliases' is None"),
    (lambda m: m["files"].pop(WEIGHTS), "no sha256 for weights.safetensors"),
])
def test_malformed_manifest(saved, edit, reason):
    manifest = json.loads((saved / MANIFEST).read_text())
    edit(manifest)
    (saved / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=reason):
        neuronfx.load(saved)
