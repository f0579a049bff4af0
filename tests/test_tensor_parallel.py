"""Tensor parallel over real ranks (gloo processes started by neuronfx.launch): tiny random
models give the logits (within 1e-5, fp32) and greedy tokens of tp=1 at tp 2, 3 and 4, with and
without sequence-parallel prefill, on eager, export and inductor; ranks that disagree are
refused. The SmolLM2 CLI runs (tp 2 and 3, two torchrun "nodes", a killed rank) are in
test_e2e_smollm2.py.

Each launch runs every case of one tp degree in one set of ranks (starting ranks costs seconds).
"""

from __future__ import annotations

import pytest
import torch
from helpers import random_prompt, run_steps, tiny_hf_model, tiny_plan

import neuronfx
from neuronfx.errors import ConfigError, TensorParallelError

# Vocabulary 257 divides by none of 2, 3, 4: padded ids exist on the last rank.
MODELS = {
    "llama-kv1": ("llama", dict(num_key_value_heads=1, vocab_size=257)),  # fewer KV heads than ranks: replicated
    "qwen2-bias": ("qwen2", dict(vocab_size=257)),  # q/k/v biases; 2 KV heads: padded at tp=3
    "qwen3-qknorm": ("qwen3", dict(vocab_size=257)),  # q/k norm, head_dim != hidden / heads
    # gemma3: sliding + global layers, q/k norms (zero padded heads at tp=3), post-block norms,
    # soft-capped logits gathered over the vocabulary (helpers.GEMMA3: vocab 257)
    "gemma3": ("gemma3_text", {}),
    # 11 layers: inductor runs them as 11 calls of one compiled 1-layer group
    "llama-deep": ("llama", dict(num_key_value_heads=1, vocab_size=257, num_hidden_layers=11)),
    # Other families, at tp=2 only (each adds seconds to a launch)
    "granite": ("granite", dict(vocab_size=257, attention_bias=True)),  # its four scalars; q/k/v and o_proj biases
    "smollm3-window": ("smollm3", dict(vocab_size=257, use_sliding_window=True, sliding_window=6)),  # NoPE + sliding layer
    # fused qkv/gate_up split at load, partial rotary, longrope refilled at 20 tokens (tp=2 only)
    "phi3-longrope": ("phi3", dict(vocab_size=257)),
    # mixture of experts (4 experts, top-2): every expert's 128 rows split, router replicated (tp 2 only: each case costs;
    # padded expert rows are the dense MLP's padding, tested on the others, and test_moe.py reads them at tp 3)
    "mixtral-moe": ("mixtral", dict(vocab_size=257)),
}
TP2_ONLY = {"granite", "smollm3-window", "phi3-longrope", "mixtral-moe", "gemma3"}
PLAIN_PREFILL = {"llama-kv1", "qwen2-bias", "qwen3-qknorm"}  # also without sequence parallelism (tp=2)
# Self-speculation (speculate and draft graphs; generate speculates by default when it can).
SPECULATIVE = dict(speculation_length=3, draft_layers=1)
PROMPTS = [random_prompt(n, seed) for seed, n in enumerate((5, 17, 9, 3, 12, 7))]  # ragged, 6 prompts > 4 slots
STEPS = 6  # decode steps with logits compared
GEN = 16  # greedy tokens through the scheduler (continuous batching)
ATOL = 1e-5


def run_case(name: str, backend: str, tp: int, sequence_parallel: bool, batch_size: int = 4, speculative: bool = False,
             blocks: bool = False) -> dict:
    """Logits of a ragged prefill and decode steps (3 rows, or 1 at batch_size 1), and GEN greedy
    tokens for PROMPTS through the scheduler (6 prompts over ``batch_size`` slots), for one model
    at one tp degree (runs on every rank); ``blocks``: the blocks KV layout (each rank holds its
    heads' blocks, one table for all)."""
    model_type, overrides = MODELS[name]
    hf = tiny_hf_model(model_type, **overrides)
    extra = dict(prefill_buckets=(32,), decode_buckets=(64,)) if backend != "eager" else {}
    extra |= SPECULATIVE if speculative else {}
    extra |= dict(kv_layout="blocks", kv_block_size=4) if blocks else {}
    plan = tiny_plan(hf, backend, tp_degree=tp, sequence_parallel=sequence_parallel, batch_size=batch_size, **extra)
    runtime = neuronfx.compile(plan, hf.state_dict(), progress=False, cache=False)
    state = neuronfx.init_state(runtime)
    rows = min(3, batch_size)
    tokens, logits, _, state = run_steps(runtime, state, list(range(rows)), PROMPTS[:rows], STEPS)
    result, _ = neuronfx.generate(runtime, neuronfx.init_state(runtime), PROMPTS, max_new_tokens=GEN)
    return {"tokens": tokens, "logits": [torch.stack(row) for row in logits], "generated": result.token_ids,
            "rank": runtime.plan.rank, "kv_heads": runtime.plan.kv.num_kv_heads, "ring": runtime.plan.kv.ring_blocks,
            "speculated": any(st is not None and st.drafted > 0 for st in (result.speculation or ()))}


def run_cases(cases: list[tuple[str, str, int, bool]]) -> list[dict]:
    return [run_case(*case) for case in cases]


@pytest.fixture(scope="module")
def references() -> dict:
    """tp=1 results in this process, per (model, backend)."""
    return {}


def reference(references: dict, name: str, backend: str, batch_size: int = 4) -> dict:
    if (name, backend, batch_size) not in references:
        references[(name, backend, batch_size)] = run_case(name, backend, 1, False, batch_size)
    return references[(name, backend, batch_size)]


def check_against_tp1(got: dict, want: dict, label: str) -> None:
    assert got["tokens"] == want["tokens"], label
    assert got["generated"] == want["generated"], label
    for row_got, row_want in zip(got["logits"], want["logits"]):
        assert row_got.shape == row_want.shape == (STEPS, 257)
        torch.testing.assert_close(row_got, row_want, atol=ATOL, rtol=0, msg=label)


@pytest.mark.parametrize("tp", [2, 3])
def test_tiny_models_match_tp1_eager(tp: int, references: dict) -> None:
    # Sequence-parallel prefill for every model (it covers the vocabulary-parallel embedding,
    # reduce-scatter and gathers; decode is the same in both modes); plain prefill at tp=2 for
    # the three base models, whose layers every family builds on (the test-time budget)
    cases = [(name, "eager", tp, sp) for name in MODELS if name != "llama-deep" and (tp == 2 or name not in TP2_ONLY)
             for sp in ((False, True) if tp == 2 and name in PLAIN_PREFILL else (True,))]
    if tp == 2:  # self-speculation: its tokens are the greedy tokens of tp=1; the blocks KV layout (gemma3: with its
        # sliding layer's window ring, which its prompts and outputs outgrow)
        cases += [("qwen2-bias", "eager", tp, False, 4, True), ("gemma3", "eager", tp, True, 4, False, True)]
    results = neuronfx.launch(run_cases, cases, tp_degree=tp, threads=1)
    for case, got in zip(cases, results):
        assert got["rank"] == 0
        assert got["speculated"] == (len(case) > 5 and case[5])
        assert bool(got["ring"]) == (len(case) > 6 and case[6])  # gemma3's blocks: a ring of 2 blocks of 4
        check_against_tp1(got, reference(references, case[0], "eager"), str(case))


def test_compiled_backends_match_tp1(references: dict) -> None:
    """Export and inductor graphs with the collectives traced in (sequence-parallel prefill: the
    reduce-scatter and all-gathers too), at tp 2, against eager at tp 1 (the compiled backends
    at tp 1 match eager: test_models.py, test_kernels.py); inductor at batch 1 with several
    calls of its compiled layer group (every call's input must have the strides the first was
    compiled for)."""
    cases = [("qwen2-bias", "export", 2, True, 4), ("llama-deep", "inductor", 2, True, 1)]
    results = neuronfx.launch(run_cases, cases, tp_degree=2, threads=1)
    for case, got in zip(cases, results):
        check_against_tp1(got, reference(references, case[0], "eager", case[4]), str(case))


def compile_with_rank_seed(kind: str) -> str:
    """Compile a tiny model whose weights (or plan) differ on rank 1; returns the error text."""
    import torch.distributed as dist

    rank = dist.get_rank()
    hf = tiny_hf_model("llama", seed=rank if kind == "weights" else 0)
    plan = tiny_plan(hf, tp_degree=2, batch_size=4 if kind == "weights" or rank == 0 else 2)
    try:
        neuronfx.compile(plan, hf.state_dict(), progress=False)
    except TensorParallelError as exc:
        return str(exc)
    return "no error"


def compile_both(kinds: list[str]) -> list[str]:
    return [compile_with_rank_seed(kind) for kind in kinds]


def test_ranks_with_different_inputs_are_refused() -> None:
    """Each rank hashes its plan and its checkpoint (names, shapes, first and last rows) and the
    ranks compare before anything runs."""
    kinds = ["weights", "plans"]
    for kind, message in zip(kinds, neuronfx.launch(compile_both, kinds, tp_degree=2, threads=1)):
        assert f"rank(s) [1] were given other {kind} than rank 0" in message


def test_tp_without_ranks_is_a_config_error() -> None:
    hf = tiny_hf_model("llama")
    with pytest.raises(ConfigError, match="tp_degree=2 needs 2 processes"):
        neuronfx.compile(tiny_plan(hf, tp_degree=2), hf.state_dict(), progress=False)


def fail_on_rank_1() -> None:
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise SystemExit(3)
    time.sleep(120)  # rank 0 would run on: the launcher must stop it


def test_failed_rank_stops_the_launch() -> None:
    import time

    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 exited with code 3") as info:
        neuronfx.launch(fail_on_rank_1, tp_degree=2, threads=1)
    assert info.value.exit_codes == {1: 3}
    assert time.monotonic() - start < 60


def rank_context() -> tuple:
    import os

    return os.environ.get("NEURONFX_TEST_PROBE"), os.environ["RANK"], os.environ["WORLD_SIZE"], os.getcwd()


def test_ranks_see_the_callers_environment_and_directory(monkeypatch, tmp_path) -> None:
    """Ranks are forked from a fork server started by the first launch of the process: each launch's
    environment and working directory are still the ones its ranks see (as spawned ranks did),
    with the launcher's per-rank variables over them."""
    neuronfx.launch(rank_context, tp_degree=2, threads=1)  # the server runs from here on (if not already)
    monkeypatch.setenv("NEURONFX_TEST_PROBE", "set after the first launch")
    monkeypatch.setenv("RANK", "7")  # the launcher's per-rank variables win over the caller's
    monkeypatch.setenv("WORLD_SIZE", "9")
    monkeypatch.chdir(tmp_path)
    got = neuronfx.launch(rank_context, tp_degree=2, threads=1)
    assert got == ("set after the first launch", "0", "2", str(tmp_path))
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("NEURONFX_TEST_PROBE")
    assert neuronfx.launch(rank_context, tp_degree=2, threads=1)[0] is None


def test_fork_server_skips_a_module_that_fails_to_import(tmp_path) -> None:
    """The fork server's preload (runtime/fork_preload.py) takes the caller's import path and
    imports what it can: a module that raises is left to the ranks (which report it), not fatal."""
    import json
    import sys

    from neuronfx.runtime import fork_preload

    (tmp_path / "nfx_preload_ok.py").write_text("VALUE = 1\n")
    (tmp_path / "nfx_preload_bad.py").write_text("raise RuntimeError('boom')\n")
    before = list(sys.path)
    try:
        failed = fork_preload.preload(json.dumps({"sys_path": [str(tmp_path), *before], "modules": ["nfx_preload_bad", "nfx_preload_ok"]}))
        assert failed == ["nfx_preload_bad"] and sys.modules["nfx_preload_ok"].VALUE == 1 and sys.path[0] == str(tmp_path)
    finally:
        sys.path[:] = before
        sys.modules.pop("nfx_preload_ok", None)


def save_and_reload(directory: str) -> tuple:
    """Compile at tp=2 and save (every rank its part), load back on the same ranks: the tokens
    before and after, and what this rank saved."""
    import os

    hf = tiny_hf_model("qwen2", vocab_size=257)
    runtime = neuronfx.compile(tiny_plan(hf, tp_degree=2), hf.state_dict(), progress=False)
    before, _ = neuronfx.generate(runtime, neuronfx.init_state(runtime), PROMPTS, max_new_tokens=8)
    neuronfx.save(runtime, directory)
    loaded = neuronfx.load(directory)
    after, _ = neuronfx.generate(loaded, neuronfx.init_state(loaded), PROMPTS, max_new_tokens=8)
    return before.token_ids, after.token_ids, loaded.plan.rank, sorted(os.listdir(directory))


def test_saved_tp_runtime_loads_on_its_ranks_only(tmp_path):
    before, after, rank, listing = neuronfx.launch(save_and_reload, str(tmp_path / "tp2"), tp_degree=2, threads=1)
    assert before == after and rank == 0
    assert listing == ["rank-0", "rank-1"]
    with pytest.raises(ConfigError, match="tp_degree=2 needs 2 processes"):
        neuronfx.load(tmp_path / "tp2")
