"""The 16-bit prefill path (graphs/gemm_choice.py): decided by measurement, kept per machine."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from neuronfx.graphs.kernels import gemm_choice


def test_decide_widens_only_when_clearly_faster():
    assert gemm_choice.decide(native_s=0.060, widened_s=0.020)  # AVX-512 without BF16: emulated bf16
    assert not gemm_choice.decide(native_s=0.010, widened_s=0.030)  # AVX512-BF16 / AMX
    assert not gemm_choice.decide(native_s=0.0105, widened_s=0.0100)  # a near tie keeps the 16-bit GEMM


@pytest.fixture
def fake_timings(monkeypatch):
    """measure() returning given times, counting its calls."""
    calls = []

    def fake(dtype, shape=gemm_choice.PROBE_SHAPE, repeats=gemm_choice.REPEATS):
        calls.append(dtype)
        return timings[dtype]

    timings = {"bfloat16": (0.06, 0.02), "float16": (0.01, 0.03)}
    monkeypatch.setattr(gemm_choice, "measure", fake)
    return calls


def test_measured_once_then_read_back(fake_timings, tmp_path):
    first = gemm_choice.prefill_choice("bfloat16", tmp_path)
    assert first.widen and first.measured and (first.native_s, first.widened_s) == (0.06, 0.02)
    assert json.loads(Path(first.path).read_text())["widen"] is True
    again = gemm_choice.prefill_choice("bfloat16", tmp_path)
    assert again == attrs.evolve(first, measured=False) and fake_timings == ["bfloat16"]
    assert "widened to fp32 GEMM" in first.describe() and "cached" in again.describe()
    half = gemm_choice.prefill_choice("float16", tmp_path)  # its own verdict
    assert not half.widen and half.path != first.path and "float16 GEMM" in half.describe()


def test_verdict_keyed_by_onednn_isa_cap(fake_timings, tmp_path, monkeypatch):
    """ONEDNN_MAX_CPU_ISA changes oneDNN's kernels: another file, measured again; a corrupt
    file is measured again too. (The uncapped side is set explicitly: the suite itself may run
    under a cap, as tests/test_isa_pinned.py runs some tests.)"""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    plain = gemm_choice.prefill_choice("bfloat16", tmp_path)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    capped = gemm_choice.prefill_choice("bfloat16", tmp_path)
    assert capped.path != plain.path and capped.measured and len(fake_timings) == 2
    Path(capped.path).write_text("{not json")
    assert gemm_choice.prefill_choice("bfloat16", tmp_path).measured and len(fake_timings) == 3


def test_measure_times_both_ways():
    native_s, widened_s = gemm_choice.measure("bfloat16", shape=(16, 64, 32), repeats=1)
    assert 0 < native_s < 1 and 0 < widened_s < 1


def test_compile_cache_key_follows_the_verdict(monkeypatch):
    """Graphs bake the verdict in: a 16-bit inductor plan's cache key changes with it; other
    plans never ask for it (no measurement)."""
    from helpers import tiny_hf_model, tiny_plan

    from neuronfx.graphs.backends import inductor
    from neuronfx.io import cache

    hf = tiny_hf_model("llama", seed=0)
    bf16 = tiny_plan(hf, "inductor", dtype="bfloat16")
    keys = set()
    for verdict in (True, False):
        monkeypatch.setattr(inductor, "widen_16bit_prefill", lambda dtype, v=verdict: v)
        keys.add(cache.cache_key(bf16))
    assert len(keys) == 2

    def no_measurement(dtype):
        raise AssertionError("asked for a verdict")

    monkeypatch.setattr(inductor, "widen_16bit_prefill", no_measurement)
    cache.cache_key(tiny_plan(hf, "inductor", dtype="float32"))
    cache.cache_key(tiny_plan(hf, "export", dtype="bfloat16"))
