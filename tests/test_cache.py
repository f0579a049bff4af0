"""Compile cache: a cached plan loads instead of compiling and runs on the caller's weights;
concurrent compiles leave one good entry; damaged entries are reported and rebuilt while good
ones are untouched; CLI (cache list/inspect/clear, compile --out, generate --model DIR); hub
push and offline hub load. Export backend with one prefill and one decode bucket (cheap)."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
import zipfile
from pathlib import Path

import attrs
import pytest
import torch
from helpers import random_prompt, run_steps, tiny_hf_model, tiny_plan

import neuronfx
from neuronfx.cli import main
from neuronfx.errors import ArtifactError, ConfigError
from neuronfx.io import cache
from neuronfx.io.artifacts import MANIFEST, PLAN, read_manifest, sha256

SMALL = dict(prefill_buckets=(32,), decode_buckets=(64,))
PROMPTS = [random_prompt(9, seed=1), random_prompt(4, seed=2)]


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=3)


def outputs(rt):
    tokens, logits, _, _ = run_steps(rt, neuronfx.init_state(rt), [0, 1], PROMPTS, 4)
    return tokens, logits


def same(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for ra, rb in zip(a[1], b[1]) for x, y in zip(ra, rb))


def snapshot(entry: Path) -> dict[str, tuple[int, str]]:
    """(mtime_ns, sha256) of every file of an entry: a good entry must not change."""
    return {str(p.relative_to(entry)): (p.stat().st_mtime_ns, sha256(p)) for p in entry.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def filled(hf, tmp_path_factory):
    """A cache with one export entry for the SMALL plan, and that compile's outputs."""
    root = tmp_path_factory.mktemp("cache")
    rt = neuronfx.compile(tiny_plan(hf, "export", **SMALL), hf.state_dict(), progress=False, cache=root)
    return root, rt.cache_key, outputs(rt)


def test_hit_loads_graphs_and_runs_on_the_callers_weights(hf, filled):
    root, key, want = filled
    before = snapshot(root / key)
    rt = neuronfx.compile(tiny_plan(hf, "export", **SMALL), hf.state_dict(), progress=False, cache=root)
    assert rt.cache_key == key and rt.from_cache and same(outputs(rt), want)
    other = tiny_hf_model("llama", seed=11)  # same config, other weights: same entry, its own outputs
    rt2 = neuronfx.compile(tiny_plan(other, "export", **SMALL), other.state_dict(), progress=False, cache=root)
    eager = neuronfx.compile(tiny_plan(other, "eager", **SMALL), other.state_dict(), progress=False)
    (tokens, logits), (eager_tokens, eager_logits) = outputs(rt2), outputs(eager)
    assert rt2.cache_key == key and tokens == eager_tokens and tokens != want[0]
    assert all(torch.allclose(x, y, atol=1e-5) for a, b in zip(logits, eager_logits) for x, y in zip(a, b))
    assert snapshot(root / key) == before
    assert [e["key"] for e in cache.list_entries(root)] == [key]


def data_bytes(pt2: Path) -> int:
    """Bytes of a .pt2 archive's tensor data (``data/``: sample inputs, weights, constants)."""
    return sum(m.file_size for m in zipfile.ZipFile(pt2).infolist() if m.filename.split("/", 1)[1].startswith("data/"))


def test_export_entry_holds_programs_not_weights(hf, filled):
    """torch.export.save writes a program's example inputs into its .pt2, and the weights and
    the KV cache were graph inputs: every graph file held a copy of the weights (SmolLM2 batch 2:
    609 MB of 612 MB). Now an entry's example inputs are meta tensors (structure only), and the
    whole entry is about its programs' JSON; a hit still gives the compile's tokens (above)."""
    root, key, _ = filled
    weight_bytes = sum(t.numel() * t.element_size() for t in hf.state_dict().values())
    graphs = sorted((root / key / "graphs").glob("*.pt2"))
    assert len(graphs) == 3  # prefill, decode and greedy
    for graph in graphs:
        assert data_bytes(graph) < 16 * 1024 < weight_bytes / 10
        program = zipfile.ZipFile(graph).getinfo(f"{graph.stem}/models/model.json").file_size
        assert graph.stat().st_size < program + 64 * 1024  # the program, little else
    for ep in (neuronfx.compile(tiny_plan(hf, "export", **SMALL), hf.state_dict(), progress=False, cache=root).graphs.values()):
        assert all(t.device.type == "meta" for t in torch.utils._pytree.tree_leaves(ep.program.example_inputs)
                   if isinstance(t, torch.Tensor))  # loaded: no copy of the weights kept per graph either


def test_key_covers_plan_and_versions_not_checkpoint(hf, monkeypatch):
    plan = tiny_plan(hf, "export", **SMALL)
    assert cache.cache_key(plan) == cache.cache_key(attrs.evolve(plan, checkpoint="/elsewhere"))
    assert cache.cache_key(plan) != cache.cache_key(tiny_plan(hf, "export", prefill_buckets=(32,), decode_buckets=(32, 64)))
    before = cache.cache_key(plan)
    monkeypatch.setattr(torch, "__version__", "1.0.0")
    assert cache.cache_key(plan) != before


def test_thread_count_keys_inductor_entries_only(hf):
    """Inductor's generated C++ is compiled for torch's thread count (its compiled functions
    refuse to run under another): part of an inductor key. An exported program runs ATen ops
    whatever the thread count: running with OMP_NUM_THREADS=1 must not miss an export entry."""
    export, inductor = tiny_plan(hf, "export", **SMALL), tiny_plan(hf, "inductor", **SMALL)
    threads = torch.get_num_threads()
    keys = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            keys[n] = (cache.cache_key(export), cache.cache_key(inductor))
    finally:
        torch.set_num_threads(threads)
    assert keys[1][0] == keys[2][0] and keys[1][1] != keys[2][1]


def test_cache_argument(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path / "env"))
    assert cache.resolve_cache(None, "eager") is None
    assert cache.resolve_cache(None, "export") == tmp_path / "env"
    assert cache.resolve_cache(False, "inductor") is None
    assert cache.resolve_cache(tmp_path / "x", "eager") == tmp_path / "x"
    with pytest.raises(ConfigError, match="cache=3"):
        cache.resolve_cache(3, "export")


CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    import neuronfx
    from helpers import tiny_hf_model, tiny_plan
    hf = tiny_hf_model("llama", seed=3)
    rt = neuronfx.compile(tiny_plan(hf, "export", prefill_buckets=(32,), decode_buckets=(64,)), hf.state_dict(),
                          progress=False, cache=sys.argv[1])
    print("KEY", rt.cache_key)
""")


def test_two_processes_compile_the_same_plan(tmp_path):
    root = tmp_path / "cache"
    tests_dir = str(Path(__file__).parent)
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(root), tests_dir], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    keys = {out.split("KEY ")[1].strip() for out, _ in results}
    assert len(keys) == 1
    assert [p.name for p in root.iterdir() if p.is_dir()] == list(keys)  # one entry, no temp directory left
    read_manifest(root / keys.pop())  # and it verifies


def _flip_byte_in_graph(entry: Path) -> None:
    graph = next((entry / "graphs").iterdir())
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))


def _other_torch(entry: Path) -> None:
    manifest = json.loads((entry / MANIFEST).read_text())
    manifest["environment"]["torch"] = "1.0.0"
    (entry / MANIFEST).write_text(json.dumps(manifest))


def _unknown_plan_key(entry: Path) -> None:
    plan = json.loads((entry / PLAN).read_text())
    plan["inference"]["bogus"] = 1
    (entry / PLAN).write_text(json.dumps(plan))
    manifest = json.loads((entry / MANIFEST).read_text())
    manifest["files"][PLAN] = sha256(entry / PLAN)  # consistent hashes, invalid plan
    (entry / MANIFEST).write_text(json.dumps(manifest))


def _half_written(entry: Path) -> None:
    (entry / MANIFEST).unlink()


@pytest.mark.parametrize("damage, reason", [
    (_flip_byte_in_graph, "is corrupt"), (_other_torch, "torch '1.0.0'"),  # a truncated graph: the same hash check
    (_unknown_plan_key, "bogus"), (_half_written, "no manifest.json"),
])
def test_damaged_entry_is_reported_and_rebuilt(hf, filled, tmp_path, damage, reason, caplog):
    root0, key, want = filled
    root = tmp_path / "cache"
    shutil.copytree(root0, root)
    good = tiny_plan(hf, "eager", **SMALL)  # a second, good entry that must stay untouched
    neuronfx.compile(good, hf.state_dict(), progress=False, cache=root)
    good_key = cache.cache_key(good)
    before = snapshot(root / good_key)
    damage(root / key)
    with caplog.at_level(logging.INFO, logger="neuronfx.cache"):
        rt = neuronfx.compile(tiny_plan(hf, "export", **SMALL), hf.state_dict(), progress=False, cache=root)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and re.search(f"{key}.*{reason}.*moved it aside, compiling the plan again", warned[0]), warned
    assert same(outputs(rt), want) and not rt.from_cache
    read_manifest(root / key)  # rebuilt and good
    assert snapshot(root / good_key) == before
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == sorted([key, good_key])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        neuronfx.compile(tiny_plan(hf, "export", **SMALL), hf.state_dict(), progress=False, cache=root)  # a clean hit


def test_cli_cache_list_inspect_clear(hf, filled, tmp_path, capsys):
    root = tmp_path / "cache"
    shutil.copytree(filled[0], root)
    key = filled[1]
    assert main(["cache", "list", "--dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert key[:16] in out and "llama export float32" in out
    assert main(["cache", "inspect", key[:10], "--dir", str(root)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["ok"] and info["key"] == key and info["plan"]["inference"]["backend"] == "export"
    assert main(["cache", "inspect", "zz", "--dir", str(root)]) == 2
    assert "matches no entry" in capsys.readouterr().err
    assert main(["cache", "clear", key[:8], "--dir", str(root)]) == 0
    assert not (root / key).exists()
    assert cache.list_entries(root) == []


# --- saved runtimes through the CLI and the hub -------------------------------------------------

def _tiny_model_dir(hf, path: Path) -> Path:
    """A tiny HF directory with a word-level tokenizer (ids < 256), all offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(256)} | {"<unk>": 255}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)
    return path


PLAN_ARGS = ["--backend", "export", "--batch-size", "1", "--max-context-length", "32", "--sequence-length", "64"]


def test_cli_compile_then_generate_from_dir_and_hub(hf, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path / "cache"))
    model = _tiny_model_dir(hf, tmp_path / "model")
    out = tmp_path / "saved"
    gen = ["--prompt", "w1 w2 w3 w4", "--max-new-tokens", "5", "--ignore-eos", "--json"]
    assert main(["generate", "--model", str(model), *PLAN_ARGS, *gen]) == 0
    want = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(["compile", str(model), "--out", str(out), *PLAN_ARGS, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["graphs"] == 3 and summary["from_cache"] and (out / "tokenizer" / "tokenizer.json").is_file()
    assert all(data_bytes(f) < 16 * 1024 for f in (out / "graphs").iterdir())  # the weights once, in weights.safetensors
    assert main(["generate", "--model", str(out), *gen]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
    assert main(["generate", "--model", str(model), *PLAN_ARGS, *gen[:-1]]) == 0  # not --json: progress and timing lines
    err = capsys.readouterr().err
    assert f"neuronfx: loaded 3 graphs from the compile cache (entry {tmp_path / 'cache' / summary['cache_key']}) in" in err
    assert re.search(r"; load \d+\.\d s, graphs from the compile cache \d+\.\d s\]", err), err
    assert main(["generate", "--model", str(out), "--batch-size", "2", *gen]) == 2
    assert "compiled with 1" in capsys.readouterr().err

    # hub: a snapshot laid out in an HF cache, read offline through the repo id
    hub = tmp_path / "hub"
    snap = hub / "models--someone--tiny-neuronfx" / "snapshots" / "0123abcd"
    shutil.copytree(out, snap)
    (hub / "models--someone--tiny-neuronfx" / "refs").mkdir()
    (hub / "models--someone--tiny-neuronfx" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub))
    assert main(["generate", "--model", "someone/tiny-neuronfx", *gen]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
    with pytest.raises(ArtifactError, match="nobody/missing"):
        neuronfx.load("nobody/missing")


def test_serve_log_says_where_the_graphs_came_from(hf, filled, caplog):
    """`neuronfx serve` builds without progress bars: the cache's lines go to the
    "neuronfx.cache" logger (the server's log), and the CLI's summary line says compiled or
    loaded from the compile cache."""
    from neuronfx.cli.loading import LoadedRuntime

    root, key, _ = filled
    with caplog.at_level(logging.INFO, logger="neuronfx.cache"):
        hit = neuronfx.compile(tiny_plan(hf, "export", **SMALL), hf.state_dict(), progress=False, cache=root)
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == [f"loaded 3 graphs from the compile cache (entry {root / key})"]
    built = neuronfx.compile(tiny_plan(hf, "export", **SMALL), hf.state_dict(), progress=False, cache=False)
    summary = {rt.from_cache: LoadedRuntime(runtime=rt, tokenizer=None, model="m", load_s=2.0, compile_s=1.5).summary()
               for rt in (hit, built)}
    assert summary[True] == f"checkpoint loaded in 2.0 s; 3 graphs loaded from the compile cache (entry {key[:16]}) in 1.5 s"
    assert summary[False] == "checkpoint loaded in 2.0 s; 3 graphs compiled in 1.5 s"


def test_compile_without_progress_logs_each_graph(hf, tmp_path, caplog):
    """Without progress bars (serve), a compile says what it does in the log: the miss, one line
    per graph, the compile's time."""
    plan = tiny_plan(hf, "eager", batch_size=1, **SMALL)
    with caplog.at_level(logging.INFO, logger="neuronfx"):
        neuronfx.compile(plan, hf.state_dict(), progress=False, cache=tmp_path)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == f"compile cache: no entry for this plan in {tmp_path}; compiling 3 eager graphs"
    assert re.fullmatch(r"compile \(eager\): 1 of 3 graphs done after \d+\.\d s; prefill 1x32", lines[1]), lines
    assert re.fullmatch(r"compile \(eager\): 2 of 3 graphs done after \d+\.\d s; decode 1x64", lines[2]), lines
    assert re.fullmatch(r"compile \(eager\): 3 of 3 graphs done after \d+\.\d s; greedy 1x64", lines[3]), lines
    assert lines[4].startswith("compiled 3 graphs in ") and len(lines) == 5


def test_push_to_hub_uploads_the_verified_folder(hf, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("huggingface_hub.HfApi.create_repo", lambda self, **kw: calls.append(("create_repo", kw)))
    monkeypatch.setattr("huggingface_hub.HfApi.upload_folder", lambda self, **kw: calls.append(("upload_folder", kw)) or "url")
    saved = neuronfx.save(neuronfx.compile(tiny_plan(hf, "eager", **SMALL), hf.state_dict(), progress=False), tmp_path / "rt")
    assert neuronfx.push_to_hub(saved, "me/tiny", token="t") == "url"
    assert calls == [("create_repo", {"repo_id": "me/tiny", "private": False, "exist_ok": True}),
                     ("upload_folder", {"folder_path": str(saved), "repo_id": "me/tiny", "commit_message": "neuronfx saved runtime"})]
    (saved / "weights.safetensors").write_bytes(b"x")
    with pytest.raises(ArtifactError, match="corrupt"):
        neuronfx.push_to_hub(saved, "me/tiny")
    assert len(calls) == 2  # nothing uploaded


def test_clear_touches_only_cache_entries(filled, tmp_path):
    """`cache clear` without a key removes entries and the cache's own leftovers, nothing else:
    a cache root set to a directory that holds other things must not lose them."""
    root = tmp_path / "cache"
    shutil.copytree(filled[0], root)
    key = filled[1]
    leftover = root / f".tmp-{key}-abc123"
    for other in ("myproject", ".git", ".venv-x", "0123"):
        (root / other).mkdir()
        (root / other / "keep.txt").write_text("mine")
    leftover.mkdir()
    removed = cache.clear(None, root)
    assert sorted(removed) == sorted([key, leftover.name])
    assert not (root / key).exists() and not leftover.exists()
    for other in ("myproject", ".git", ".venv-x", "0123"):
        assert (root / other / "keep.txt").read_text() == "mine"
    assert cache.list_entries(root) == []


def test_progress_says_compiled_then_loaded(hf, tmp_path, capsys):
    """With progress on, a miss says it compiled and that the next run loads in seconds; the
    next compile of the plan says it loaded from the cache (and prints no compile bar). Eager
    graphs (nothing to compile) through a cache directory keep it quick."""
    plan = tiny_plan(hf, "eager", batch_size=1, **SMALL)
    neuronfx.compile(plan, hf.state_dict(), progress=True, cache=tmp_path)
    err = capsys.readouterr().err
    assert "compile (eager)" in err  # the per-graph progress bar
    assert f"compiled {len(plan.graphs)} graphs in" in err and "the next run of this plan loads them in seconds" in err
    neuronfx.compile(plan, hf.state_dict(), progress=True, cache=tmp_path)
    err = capsys.readouterr().err
    assert f"loaded {len(plan.graphs)} graphs from the compile cache (entry {tmp_path / cache.cache_key(plan)}) in" in err
    assert "compile (eager)" not in err
    neuronfx.compile(plan, hf.state_dict(), progress=False, cache=tmp_path)
    assert capsys.readouterr().err == ""


def test_damaged_entry_is_one_line_on_stderr(hf, tmp_path, capsys):
    """With progress (the CLI), a corrupt entry is one line on stderr: no Python source line
    under it, as warnings.warn printed."""
    plan = tiny_plan(hf, "eager", batch_size=1, **SMALL)
    neuronfx.compile(plan, hf.state_dict(), progress=False, cache=tmp_path)
    (tmp_path / cache.cache_key(plan) / PLAN).write_text("{}")
    capsys.readouterr()
    neuronfx.compile(plan, hf.state_dict(), progress=True, cache=tmp_path)
    lines = capsys.readouterr().err.splitlines()
    warned = [i for i, line in enumerate(lines) if "unusable" in line]
    assert len(warned) == 1 and lines[warned[0]].startswith("neuronfx: warning: compile cache entry "), lines
    assert "is corrupt" in lines[warned[0]] and lines[warned[0]].endswith("moved it aside, compiling the plan again")
    assert lines[warned[0] + 1].startswith("neuronfx: compile cache: no entry for this plan"), lines  # no source line between


def test_miss_names_the_entry_of_the_plan_built_otherwise(hf, tmp_path, capsys, monkeypatch):
    """A miss on a plan that has an entry compiled under other key components says which ones,
    before compiling: another torch here; another thread count for an inductor entry (its
    key.json written as a 2-thread process would), with the OMP_NUM_THREADS that uses it."""
    plan = tiny_plan(hf, "eager", batch_size=1, **SMALL)
    neuronfx.compile(plan, hf.state_dict(), progress=False, cache=tmp_path)
    assert cache.explain_miss(tmp_path, plan) is None  # the same components: nothing to explain
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    neuronfx.compile(plan, hf.state_dict(), progress=True, cache=tmp_path)
    err = capsys.readouterr().err
    assert re.search(r"neuronfx: compile cache: no entry for this plan with torch 9\.9\.9; an entry exists for torch "
                     r"\S+ \(entry [0-9a-f]{16}, compiled in \d+ s\); compiling 3 eager graphs", err), err
    monkeypatch.undo()

    inductor = tiny_plan(hf, "inductor", **SMALL)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        components = cache.key_components(inductor)
    finally:
        torch.set_num_threads(threads)
    entry = tmp_path / ("ab" * 32)
    entry.mkdir()
    (entry / cache.KEY_FILE).write_text(json.dumps({"components": components, "compile_s": 186.4}))
    torch.set_num_threads(1)
    try:
        why = cache.explain_miss(tmp_path, inductor)
    finally:
        torch.set_num_threads(threads)
    assert why == ("no entry for this plan with 1 thread; an entry exists for 2 threads (run with OMP_NUM_THREADS=2 to use "
                   f"it; entry {'ab' * 8}, compiled in 186 s)")


def test_slow_cache_steps_say_what_they_do(hf, tmp_path, capsys, monkeypatch):
    """A write or load of an entry that takes longer than ANNOUNCE_AFTER_S says so while it
    runs (a 5.8 GB write once sat silent for 110 s after the bar)."""
    plan = tiny_plan(hf, "eager", batch_size=1, **SMALL)
    monkeypatch.setattr(cache, "ANNOUNCE_AFTER_S", 0.05)
    for name in ("_write_entry", "_load_entry"):
        slow = getattr(cache, name)
        monkeypatch.setattr(cache, name, lambda *a, _f=slow: time.sleep(0.5) or _f(*a))
    entry = tmp_path / cache.cache_key(plan)
    neuronfx.compile(plan, hf.state_dict(), progress=True, cache=tmp_path)
    assert f"neuronfx: writing the compile cache entry {entry} ...\n" in capsys.readouterr().err
    neuronfx.compile(plan, hf.state_dict(), progress=True, cache=tmp_path)
    assert f"neuronfx: loading 3 graphs from the compile cache (entry {entry}) ...\n" in capsys.readouterr().err


def test_kernel_store_is_keyed_by_model_shape(hf):
    """Plans of one model shape share a kernel store whatever their buckets, batch or family;
    another hidden size gets another."""
    root = Path("/nowhere")
    base = cache.kernel_store(root, tiny_plan(hf, "inductor", **SMALL))
    assert base.parent == root / cache.KERNELS
    assert cache.kernel_store(root, tiny_plan(hf, "inductor", batch_size=1, prefill_buckets=(16, 32), decode_buckets=(64,))) == base
    assert cache.kernel_store(root, tiny_plan(tiny_hf_model("qwen2"), "inductor", **SMALL)) == base
    assert cache.kernel_store(root, tiny_plan(tiny_hf_model("llama", hidden_size=32), "inductor", **SMALL)) != base


def test_inductor_build_starts_from_the_kernel_store_and_adds_to_it(hf, tmp_path, monkeypatch):
    """A build's private directory starts as a copy of the store (lock, bytecode and half-written
    files left out); what the build compiled is added to the store, files already there are left
    as they are. The compiler is replaced by a fake that writes one new kernel file."""
    from neuronfx.graphs.backends import compile_workers, inductor

    store = tmp_path / "store"
    (store / "ab").mkdir(parents=True)
    (store / "ab" / "old.so").write_bytes(b"old kernel")
    (store / "ab" / "old.so.lock").write_bytes(b"")
    (store / "ab" / ".tmp-9-1-half.so").write_bytes(b"half")
    seen = {}

    def fake_build(plan, weights, directory, builder, bar):
        seen["files"] = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
        (directory / "ab").mkdir(exist_ok=True)
        (directory / "ab" / "old.so").write_bytes(b"rewritten")  # the store's copy must not change
        (directory / "cd").mkdir()
        (directory / "cd" / "new.so").write_bytes(b"new kernel")
        return {}, {}

    monkeypatch.setattr(compile_workers, "build", fake_build)
    built = inductor.build(tiny_plan(hf, "inductor", **SMALL), {}, False, kernels=store)
    assert seen["files"] == ["ab/old.so"]
    assert (store / "ab" / "old.so").read_bytes() == b"old kernel"
    assert (store / "cd" / "new.so").read_bytes() == b"new kernel"
    assert not list(store.rglob(".tmp-*new*"))
    shutil.rmtree(built.compiled_dir)
    inductor.build(tiny_plan(hf, "inductor", **SMALL), {}, False, kernels=tmp_path / "absent")
    assert (tmp_path / "absent" / "cd" / "new.so").read_bytes() == b"new kernel"  # a first build creates the store


def test_clear_all_removes_the_kernel_store(tmp_path):
    (tmp_path / cache.KERNELS / "x").mkdir(parents=True)
    (tmp_path / cache.KERNELS / "x" / "k.so").write_bytes(b"k")
    assert cache.clear(None, tmp_path) == [cache.KERNELS]
    assert not (tmp_path / cache.KERNELS).exists()


def test_source_fingerprint_covers_the_graph_and_config_sources(hf, tmp_path, monkeypatch):
    """The key's source fingerprint reads neuronfx/graphs and neuronfx/config (after artifacts.py
    moved into io/ it read nothing, and an entry compiled before a new graph input was loaded
    after it): editing one of those files changes every key."""
    from neuronfx import version

    names = {p.relative_to(version.PACKAGE_ROOT).as_posix() for p in version.fingerprint_sources()}
    assert {"graphs/phases/sampling.py", "config/inputs.py", "graphs/kernels/csrc/small_gemm.cpp"} <= names
    assert not any(n.startswith(("runtime/", "server/", "io/")) for n in names)
    plan = tiny_plan(hf, "export", **SMALL)
    before = cache.cache_key(plan)
    copy = tmp_path / "neuronfx"
    for p in version.fingerprint_sources():
        (copy / p.relative_to(version.PACKAGE_ROOT)).parent.mkdir(parents=True, exist_ok=True)
        (copy / p.relative_to(version.PACKAGE_ROOT)).write_bytes(p.read_bytes())
    monkeypatch.setattr(version, "PACKAGE_ROOT", copy)
    try:
        version.source_fingerprint.cache_clear()  # computed once per process
        assert cache.cache_key(plan) == before
        (copy / "config" / "inputs.py").write_text((copy / "config" / "inputs.py").read_text() + "\n# edited\n")
        version.source_fingerprint.cache_clear()
        assert cache.cache_key(plan) != before
    finally:
        monkeypatch.undo()
        version.source_fingerprint.cache_clear()
