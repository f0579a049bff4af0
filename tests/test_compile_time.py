"""What cuts the inductor backend's cold compile (graphs/inductor.py, graphs/compile_workers.py):
the buckets of a (phase, batch) share one compiled layer group and epilogue, units go to worker
processes, whose weights are rebuilt from a description; a failed worker costs only time.

Sharing is checked on the session's tiny qwen2 runtime (its decode bucket 64 is the whole cache:
a dim the trace must not specialise). One more runtime (tiny llama, batch 1, prefill buckets 8
and 16, decode bucket 16) is compiled with a worker: prefill here, decode in the worker. Prefill
at 8 rows runs ``small_gemm`` and at 16 rows ``F.linear``, so its layer group is the
guard-split case (two versions)."""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import random_prompt, run_steps, tiny_hf_model, tiny_plan

import neuronfx
from neuronfx.graphs.backends import compile_workers
from neuronfx.graphs.kernels.library import small_gemm_available
from neuronfx.graphs.models.quant import Int8Weight

LADDERS = dict(batch_size=1, max_context_length=16, sequence_length=16, prefill_buckets=(8, 16), decode_buckets=(16,))


@pytest.fixture(scope="module")
def runtimes():
    """(eager runtime, inductor runtime compiled with one worker, its thread count) of one tiny
    llama, built with another thread count than the environment's (compiled code guards on it:
    the worker must compile with the caller's), which holds only while it compiles and runs
    (other tests of the session compile with the environment's: the kernel store is keyed by it)."""
    hf = tiny_hf_model("llama", seed=21)
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp, torch_threads(threads + 1):
        mp.setenv(compile_workers.ENV_VAR, "1")
        compiled = neuronfx.compile(tiny_plan(hf, "inductor", **LADDERS), hf.state_dict(), progress=False, cache=False)
    return neuronfx.compile(tiny_plan(hf, "eager", **LADDERS), hf.state_dict(), progress=False), compiled, threads + 1


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("length", [5, 12])  # prefill buckets 8 and 16
def test_worker_and_guard_split_graphs_match_eager(runtimes, length):
    eager, compiled, threads = runtimes
    prompt = random_prompt(length, seed=length)
    want, want_logits, want_buckets, _ = run_steps(eager, neuronfx.init_state(eager), [0], [prompt], 16 - length)
    with torch_threads(threads):
        got, logits, buckets, _ = run_steps(compiled, neuronfx.init_state(compiled), [0], [prompt], 16 - length)
    assert got == want and buckets == want_buckets == [8 if length <= 8 else 16] + [16] * (15 - length)
    for a, b in zip(logits[0], want_logits[0]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    parts = compiled.graphs
    p8, p16 = parts[("prefill", 1, 8)].parts, parts[("prefill", 1, 16)].parts
    assert p8.epilogue.compiled is p16.epilogue.compiled and p8.prologue.compiled is not p16.prologue.compiled
    assert (p8.layers.compiled is p16.layers.compiled) != small_gemm_available()
    assert parts[("decode", 1, 16)].parts.layers.fn is None  # loaded from the worker's files, not traced here


def test_buckets_share_compiled_parts(inductor_qwen2):
    """Every bucket of a phase runs the same compiled layer group and epilogue, its own prologue."""
    graphs = inductor_qwen2[1].graphs
    for phase, buckets in (("prefill", (8, 16, 32)), ("decode", (16, 32, 64))):
        parts = [graphs[(phase, 4, b)].parts for b in buckets]
        assert len({id(p.layers.compiled) for p in parts}) == len({id(p.epilogue.compiled) for p in parts}) == 1
        assert len({id(p.prologue.compiled) for p in parts}) == 3


def test_units_and_split():
    hf = tiny_hf_model("llama", seed=21)
    plan = tiny_plan(hf, "inductor", batch_size=2, batch_buckets=(1, 2), prefill_buckets=(8, 16, 32), decode_buckets=(64,))
    units = compile_workers.units(plan)
    assert [[s.key for s in u] for u in units] == [
        [("prefill", 1, 8), ("prefill", 1, 16), ("prefill", 1, 32)], [("prefill", 2, 8), ("prefill", 2, 16), ("prefill", 2, 32)],
        [("decode", 1, 64), ("greedy", 1, 64)], [("decode", 2, 64), ("greedy", 2, 64)]]  # greedy: decode's prologue and layers
    assert [compile_workers.unit_cost(u) for u in units] == [5, 5, 4, 4]  # buckets + layer group + epilogues
    shares = compile_workers.split(units, 1)
    assert sorted(s.key for share in shares for s in share) == sorted(s.key for s in plan.graphs)
    assert [len(share) for share in shares] == [5, 5]  # costs 5 + 4 vs 5 + 4
    assert [s.key for s in compile_workers.split(units, 0)[0]] == [  # a greedy graph right after its decode graph
        ("prefill", 1, 8), ("prefill", 1, 16), ("prefill", 1, 32), ("prefill", 2, 8), ("prefill", 2, 16), ("prefill", 2, 32),
        ("decode", 1, 64), ("greedy", 1, 64), ("decode", 2, 64), ("greedy", 2, 64)]


def test_num_workers(monkeypatch):
    hf = tiny_hf_model("llama", seed=21)
    plan = tiny_plan(hf, "inductor")
    monkeypatch.setenv(compile_workers.ENV_VAR, "3")
    assert compile_workers.num_workers(plan, 2) == 1 and compile_workers.num_workers(plan, 9) == 3
    monkeypatch.setenv(compile_workers.ENV_VAR, "0")
    assert compile_workers.num_workers(plan, 9) == 0
    monkeypatch.delenv(compile_workers.ENV_VAR)
    cores = len(compile_workers.os.sched_getaffinity(0))
    monkeypatch.setattr(compile_workers.os, "getloadavg", lambda: (0.4, 0.0, 0.0))  # idle: all but this process's core
    assert compile_workers.idle_cores() == cores - 1 and compile_workers.num_workers(plan, 9) == min(cores - 1, 8)
    monkeypatch.setattr(compile_workers.os, "getloadavg", lambda: (cores + 2.5, 0.0, 0.0))  # busy: none
    assert compile_workers.idle_cores() == 0 and compile_workers.num_workers(plan, 9) == 0


def test_described_weights_rebuild_views_and_small_values():
    embed = torch.randn(300, 16)
    fused = torch.randn(12, 16)
    weights = {"embed": embed, "lm_head": embed, "norm": torch.ones(16), "layers": [
        {"wq": fused[:8], "wk": fused[8:], "rope_index": torch.tensor(1), "wo": Int8Weight(torch.ones(4, 4, dtype=torch.int8), torch.ones(4))}]}
    rebuilt = compile_workers.rebuild(*compile_workers.describe(weights))
    assert rebuilt["lm_head"] is not embed and rebuilt["lm_head"].untyped_storage().data_ptr() == rebuilt["embed"].untyped_storage().data_ptr()
    layer = rebuilt["layers"][0]
    assert layer["wk"].storage_offset() == 128 and layer["wk"].untyped_storage().data_ptr() == layer["wq"].untyped_storage().data_ptr()
    assert isinstance(layer["wo"], Int8Weight) and layer["wo"].data.dtype == torch.int8
    assert layer["rope_index"].item() == 1 and torch.equal(rebuilt["norm"], torch.ones(16))  # small: copied
    flat_in, flat_out = torch.utils._pytree.tree_leaves(weights), torch.utils._pytree.tree_leaves(rebuilt)
    assert [(t.shape, t.stride(), t.dtype) for t in flat_in] == [(t.shape, t.stride(), t.dtype) for t in flat_out]


def test_failed_worker_is_reported_and_its_graphs_built_here(monkeypatch, tmp_path):
    hf = tiny_hf_model("llama", seed=21)
    plan = tiny_plan(hf, "inductor", **LADDERS)
    monkeypatch.setenv(compile_workers.ENV_VAR, "1")
    monkeypatch.setattr(compile_workers, "WORKER_MAIN", "import sys; print('no compiler here', file=sys.stderr); sys.exit(3)")
    built = []

    class Bar:
        def update(self, n): pass
        def set_postfix_str(self, s): pass
        def close(self): pass

    def builder(plan, spec, weights, kv):
        built.append(spec.key)
        return spec.key

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphs, _ = compile_workers.build(plan, {"embed": torch.zeros(4)}, Path(tmp_path), builder, lambda total: Bar())
    assert sorted(built) == sorted(s.key for s in plan.graphs) and graphs == {s.key: s.key for s in plan.graphs}
    [warning] = [w for w in caught if w.category is compile_workers.CompileWorkerWarning]
    assert "exit status 3" in str(warning.message) and "no compiler here" in str(warning.message)


def test_waiting_for_a_worker_says_for_what(monkeypatch, tmp_path):
    """While the caller waits for a worker, the bar's status names the worker, its graphs, what
    it is waiting for (graphs still compiling, or the worker saving them and exiting) and the
    seconds so far, refreshed each second (a bar once sat at 5/5 for 43 s saying only "waiting
    for compile worker"). The fake worker reports its graph done, then takes 2.5 s to exit."""
    hf = tiny_hf_model("llama", seed=21)
    plan = tiny_plan(hf, "inductor", **LADDERS)
    monkeypatch.setenv(compile_workers.ENV_VAR, "1")
    monkeypatch.setattr(compile_workers, "WORKER_MAIN", (
        "import pickle, sys, time; job = pickle.load(open(sys.argv[1], 'rb')); "
        "[print('done', *key, 0.1, flush=True) for key in job['keys']]; time.sleep(2.5); sys.exit(3)"))
    shown = []

    class Bar:
        def update(self, n): pass
        def set_postfix_str(self, s): shown.append(s)
        def close(self): pass

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", compile_workers.CompileWorkerWarning)  # it exits 3: its graph is built here
        compile_workers.build(plan, {"embed": torch.zeros(4)}, Path(tmp_path), lambda p, spec, w, kv: spec.key, lambda total: Bar())
    waiting = [s for s in shown if s.startswith("waiting for compile worker 1 (decode 1x16; greedy 1x16)")]
    exiting = [int(s.rsplit(", ", 1)[1][:-2]) for s in waiting if "to save its graphs and exit, " in s]
    assert len(exiting) >= 2 and exiting == sorted(exiting) and exiting[-1] >= 2, shown  # counting while it waits
    assert all(re.search(r", \d+ s$", s) for s in waiting) and any(s.startswith("loading the 2 graphs of compile worker 1") for s in shown)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread nice values are Linux's")
def test_kernel_warm_up_runs_at_lower_priority_in_its_own_thread():
    """The kernel library's warm-up raises the nice value of its own thread only (Linux nice is
    per thread, and the compiler processes it starts inherit it): the checkpoint load in the
    calling thread keeps its priority."""
    import os
    import threading

    from neuronfx.graphs.backends import warm_up

    seen = {}

    def run():
        before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        warm_up.kernels_at_low_priority()
        seen["thread"] = (before, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    before, after = seen["thread"]
    assert after == min(before + 10, 19)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main
    assert small_gemm_available()


def test_cpu_plans_on_one_rank_compile_with_the_cpp_wrapper():
    """inductor's C++ wrapper for CPU plans on one rank; the Python wrapper for CUDA plans (their
    CUDA-graph capture) and tensor-parallel ones (the C++ wrapper cannot call the functional
    collectives); the assert-free options everywhere; the C++ wrapper's decode ops through
    their C shims; CPU plans' small kernels on the calling thread (``cpp.min_chunk_size``)."""
    from neuronfx.graphs.backends.inductor_parts import INDUCTOR_OPTIONS, cpu_min_chunk, inductor_options
    from neuronfx.graphs.kernels.c_shims import c_shims

    hf = tiny_hf_model("llama")
    cases = {(): True, (("tp_degree", 2),): False, (("device", "cuda"),): False}
    for overrides, cpp in cases.items():
        plan = tiny_plan(hf, "inductor", **dict(overrides))
        options = inductor_options(plan)
        assert options["cpp_wrapper"] is cpp, overrides
        assert INDUCTOR_OPTIONS.items() <= options.items()
        # the C++ wrapper calls the decode ops through their C shims (test_kernels checks them)
        assert options.get("aot_inductor.custom_ops_to_c_shims", {}) == (c_shims() if cpp else {}) and c_shims()
        assert options.get("cpp.min_chunk_size") == (None if overrides == (("device", "cuda"),) else cpu_min_chunk(torch.get_num_threads()))
    # the bound is in total elements: 32,768 whatever the thread count, never under inductor's 512 a thread
    assert [cpu_min_chunk(n) for n in (1, 2, 8, 64, 128)] == [32768, 16384, 4096, 512, 512]
