"""Shared pytest setup: Hypothesis profiles, a private compile cache, and the session fixtures
that hold what is expensive to build: the compiled tiny runtimes every compiled-backend test
shares, and the real SmolLM2 model, loaded once per session.

``HYPOTHESIS_PROFILE=ci`` (default) keeps property tests quick; ``HYPOTHESIS_PROFILE=dev`` runs
many more examples when working on a planner. The compile cache is a fresh temporary directory
per session, shared by its xdist workers (a run is always cold and never touches
``~/.cache/neuronfx``) unless ``NEURONFX_TEST_CACHE_DIR`` names one to reuse.
"""

from __future__ import annotations

import os
import tempfile
import time

# One intra-op thread per process unless the caller says otherwise: `make test` runs one xdist
# worker per core, and torch's default (a thread per core in every worker and subprocess)
# oversubscribes the cores, whose OpenMP threads then spin waiting on each other. Set before
# torch is imported, which sizes its thread pool from it; subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import attrs
import pytest
import torch
from helpers import tiny_hf_model, tiny_runtime
from hypothesis import settings

import neuronfx

settings.register_profile("ci", max_examples=50, deadline=None)
settings.register_profile("dev", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Set in the controlling process before xdist starts its workers, which inherit it: the workers
# share one cache, and its kernel store (a tiny model's second plan reuses the first one's kernels).
os.environ.setdefault("NEURONFX_TEST_CACHE_DIR", tempfile.mkdtemp(prefix="neuronfx-test-cache-"))
os.environ["NEURONFX_CACHE_DIR"] = os.environ["NEURONFX_TEST_CACHE_DIR"]
# No compile worker processes (graphs/compile_workers.py) unless a test asks: the xdist workers
# keep the cores busy already, and a compile worker's start-up would only add to the suite.
os.environ.setdefault("NEURONFX_COMPILE_WORKERS", "0")
# Inductor compiles C++ kernels in this process, not in a pool of its own subprocesses: the pool's
# workers each import torch and inductor (about 4 CPU seconds) in every process that compiles,
# and with both cores busy running tests they would add no parallelism.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# `make test` runs two pytest-xdist workers, each given whole files (its module fixtures built
# once); files sharing a session fixture go to one worker together, so the shared compiled
# runtimes and the real model are each built once. (xdist's own --dist loadgroup cannot do this
# on pytest 9: it renames node ids through an attribute pytest 9 no longer reads.)
XDIST_GROUPS = {
    "test_models.py": "shared-compiled", "test_faults.py": "shared-compiled", "test_artifacts.py": "shared-compiled",
    "test_compile_time.py": "shared-compiled", "test_overlap.py": "shared-compiled", "test_ngram.py": "shared-compiled",
    "test_checkpoints.py": "smollm2", "test_e2e_smollm2.py": "smollm2", "test_e2e_tensor_parallel.py": "smollm2",
    "test_server_smollm2.py": "smollm2", "test_prompt_logprobs.py": "smollm2",
    "test_speculate.py": "speculation", "test_fused.py": "speculation",  # one worker compiles their shared k = 5 parts once
}
UNIT_SECONDS = {
    "shared-compiled": 270, "smollm2": 250, "speculation": 115, "test_tensor_parallel.py": 90, "test_replicas.py": 90,
    "test_gemma3.py": 50, "test_int8_activations.py": 50, "test_moe.py": 45, "test_cache.py": 40, "test_phi3_rope.py": 35,
    "test_isa_pinned.py": 35, "test_lowp.py": 35, "test_server.py": 30, "test_quantized.py": 25, "test_kernels.py": 25, "test_kv_dtypes.py": 25,
    "test_bench_ab.py": 25, "test_accuracy.py": 25, "test_server_structured.py": 20, "test_bench.py": 20, "test_soak.py": 20,
    "test_bench_suite.py": 20, "test_embeddings.py": 20, "test_kv_blocks.py": 15, "test_kv_ring.py": 10,
}
"""Test seconds of the heaviest work units in a cold ``make test`` (summed setup + call +
teardown, two workers; a cold run of 2026-12-06, 04:05). Units start heaviest first (longest processing time first),
so that no long unit starts last and runs alone while the other worker idles."""


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: its file, or its XDIST_GROUPS group."""
    path = nodeid.split("::", 1)[0]
    return XDIST_GROUPS.get(os.path.basename(path), path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Heaviest work units first (UNIT_SECONDS; the rest after them in file order). A stable
    sort: each file's tests stay together and in order."""
    items.sort(key=lambda item: -UNIT_SECONDS.get(os.path.basename(work_unit(item.nodeid)), 0))


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's per-file scheduling with the files of XDIST_GROUPS sharing a work unit, handed out
    in collection order (heaviest first) instead of xdist's default, most tests first."""
    from xdist.scheduler import LoadFileScheduling

    class SharedFixtureScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return SharedFixtureScheduling(config, log)


# --- compiled tiny runtimes, built once per session ----------------------------------------------


@pytest.fixture(scope="session")
def inductor_qwen2():
    """(transformers model, inductor runtime) of a tiny qwen2 (q/k/v biases: Llama's math plus
    the bias path; layer 1 of 2 slides over 6 tokens, so the compiled layer group picks its mask
    by index) with the tiny bucket ladders (prefill 8, 16, 32; decode 16, 32, 64), batch 4,
    logits out: 9 graphs (prefill, decode and greedy)."""
    hf = tiny_hf_model("qwen2", seed=7, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    return hf, tiny_runtime(hf, "inductor")


@pytest.fixture(scope="session")
def inductor_speculative():
    """(transformers model, inductor runtime) of a tiny llama4 (a dense chunked-RoPE layer and a
    MoE NoPE layer, the 128E model's alternation: the compiled layer group picks RoPE table,
    mask, flag and MLP kind by index) with speculate graphs (k = 4) and self-draft graphs
    (1 layer), one bucket per phase (prefill 32, decode 64), batch 4: 5 graphs (with greedy). Llama's own math
    runs on inductor in the SmolLM2 tests."""
    hf = tiny_hf_model("llama4_text", seed=6, interleave_moe_layer_step=2, intermediate_size_mlp=96)
    return hf, tiny_runtime(hf, "inductor", speculation_length=4, draft_layers=1, prefill_buckets=(32,), decode_buckets=(64,))


@pytest.fixture(scope="session")
def export_llama():
    """(transformers model, export runtime) of a tiny llama, tiny ladders, batch 4, with speculate
    graphs (k = 4) and self-draft graphs (1 layer): 12 graphs."""
    hf = tiny_hf_model("llama", seed=4)
    return hf, tiny_runtime(hf, "export", speculation_length=4, draft_layers=1)


@pytest.fixture(scope="session")
def export_qwen3():
    """(transformers model, export runtime) of a tiny qwen3 (q/k norm; layer 1 of 2 slides over 6
    tokens), tiny ladders, batch 4."""
    hf = tiny_hf_model("qwen3", seed=5, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    return hf, tiny_runtime(hf, "export")


# --- the real model, loaded once ------------------------------------------------------------------


@attrs.frozen(eq=False)
class RealModel:
    """SmolLM2-135M-Instruct, read once: neuronfx's checkpoint and tokenizer (and how long they
    took), and transformers' own GGUF model and tokenizer, the golden reference (fp32, eval)."""

    checkpoint: object
    tokenizer: object
    reference: object
    reference_tokenizer: object
    load_s: float
    tokenizer_s: float


@pytest.fixture(scope="session")
def smollm2() -> RealModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from neuronfx.io.checkpoints import default_model_path, load_checkpoint, load_tokenizer

    path = default_model_path()
    start = time.perf_counter()
    ckpt = load_checkpoint(path)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    tokenizer = load_tokenizer(path)
    tokenizer_s = time.perf_counter() - start
    directory, name = os.path.split(path)
    reference = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32, local_files_only=True).eval()
    reference_tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
    return RealModel(checkpoint=ckpt, tokenizer=tokenizer, reference=reference, reference_tokenizer=reference_tokenizer,
                     load_s=load_s, tokenizer_s=tokenizer_s)


@pytest.fixture(scope="session")
def smollm2_eager(smollm2: RealModel) -> neuronfx.Runtime:
    """SmolLM2 on the eager backend (nothing to compile), batch 2, speculate graphs (k = 4) and
    self-draft graphs (first 15 layers), prompts up to 128 tokens, 256 per slot."""
    inference = neuronfx.InferenceConfig(batch_size=2, max_context_length=128, sequence_length=256, backend="eager",
                                         speculation_length=4, draft_layers=15)
    return neuronfx.compile(neuronfx.make_plan(smollm2.checkpoint.config, inference), smollm2.checkpoint.state_dict, progress=False)
