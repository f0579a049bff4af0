"""The GPU check of issue 19, one run: correctness on CUDA, then SmolLM2-135M decode speed and TTFT
of neuronfx (bf16, inductor with CUDA graphs) against transformers ``generate`` with a static cache
(with which generate() compiles its decode forward: fullgraph, mode="reduce-overhead"),
on the same GPU, printed as one table.

The model has SmolLM2-135M's shapes (config below, as neuronfx reads it from the shipped GGUF:
30 layers, hidden 576, 9 query / 3 KV heads, vocabulary 49152, tied embeddings) with random
weights (seed 0): the real weights (a 94 MiB GGUF) do not fit in what travels to the GPU
machine (64 MiB), and speed depends on the shapes only. Stages:

1. ``greedy``: fp32, 2 prompts (40 and 17 tokens), 32 greedy tokens each, neuronfx inductor +
   CUDA graphs and neuronfx eager, both against transformers on CUDA (fp32, TF32 off): tokens
   identical, and the first token's logits within 1e-3.
2. ``bench``: bf16, prompts of 128 random tokens, 128 generated (127 decode steps), batch 1 and 8:
   TTFT (prefill to the first token on the host) and decode tok/s (rows x 127 / decode seconds),
   the median of 3 timed runs after warm-up; neuronfx inductor (CUDA graphs), neuronfx eager,
   transformers static cache + torch.compile, transformers eager (dynamic cache).

``--dry-run`` runs the same driver on the CPU with a tiny model (2 layers, hidden 64), the eager
backend and no torch.compile, in a few seconds: everything but CUDA is exercised here.

Usage: ``bash tests/device/run_on_gpu.sh`` on the lent GPU (see that file); ``PYTHONPATH=.
python tests/device/gpu_check.py --dry-run`` anywhere.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

import neuronfx
from neuronfx import DecodeBatch, InferenceConfig, ModelConfig, PrefillBatch, SamplingParams, make_plan

SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)
GREEDY = SamplingParams()


def log(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_model(shape: dict, seed: int = 0) -> LlamaForCausalLM:
    """A random fp32 Llama of ``shape`` on the CPU, eval; eos disabled (fixed-length runs)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def prompts_of(vocab: int, rows: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (rows, length), generator=g).tolist()


def compile_neuronfx(hf: LlamaForCausalLM, state_dict: dict, device: str, backend: str, dtype: str, rows: int,
                     prompt_bucket: int, kv_len: int, logits: bool) -> neuronfx.Runtime:
    """A runtime of one batch size ``rows``, one prefill bucket and one decode bucket."""
    inference = InferenceConfig(
        batch_size=rows, batch_buckets=(rows,), max_context_length=prompt_bucket, sequence_length=kv_len,
        prefill_buckets=(prompt_bucket,), decode_buckets=(kv_len,), dtype=dtype, backend=backend, device=device,
        output_logits=logits,
    )
    plan = make_plan(ModelConfig.from_hf(hf.config, hf.generation_config), inference)
    return neuronfx.compile(plan, state_dict, progress=True, cache=False)


def neuronfx_run(runtime: neuronfx.Runtime, state: neuronfx.State, prompts: Sequence[Sequence[int]], n: int,
                 device: str) -> tuple[list[list[int]], list[float], neuronfx.State, list]:
    """Prefill ``prompts`` into slots 0.., then n - 1 decode steps; returns (tokens per row,
    [TTFT s, decode s], state with the slots released, first step's logits per row or [])."""
    slots = list(range(len(prompts)))
    sync(device)
    t0 = time.perf_counter()
    out, state = neuronfx.prefill_step(runtime, state, PrefillBatch(seq_ids=slots, prompts=prompts, sampling=[GREEDY] * len(slots)))
    t1 = time.perf_counter()  # the tokens are on the host: the step waited for the device
    first = [] if out.logits is None else [out.logits[r].clone() for r in slots]
    tokens = [[t] for t in out.tokens]
    for _ in range(n - 1):
        batch = DecodeBatch(seq_ids=slots, input_ids=[row[-1] for row in tokens], sampling=[GREEDY] * len(slots))
        out, state = neuronfx.decode_step(runtime, state, batch)
        for row, t in zip(tokens, out.tokens):
            row.append(t)
    t2 = time.perf_counter()
    return tokens, [t1 - t0, t2 - t1], neuronfx.release(runtime, state, slots), first


class StepClock(StoppingCriteria):
    """Records the host time after each generated token (after a device sync), never stops."""

    def __init__(self, device: str):
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        sync(self.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def hf_run(model: LlamaForCausalLM, prompts: Sequence[Sequence[int]], n: int, device: str,
           static: bool) -> tuple[list[list[int]], list[float]]:
    """transformers ``generate`` (greedy, exactly n tokens); returns (tokens per row,
    [TTFT s, decode s]) from per-token host times."""
    ids = torch.tensor([list(p) for p in prompts], device=device)
    clock = StepClock(device)
    kwargs = {"cache_implementation": "static"} if static else {}
    sync(device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                         eos_token_id=None, pad_token_id=0, stopping_criteria=StoppingCriteriaList([clock]), **kwargs)
    tokens = out[:, ids.shape[1]:].tolist()
    return tokens, [clock.times[0] - t0, clock.times[-1] - clock.times[0]]


def median_timing(runs: Sequence[Sequence[float]]) -> tuple[float, float]:
    """(median TTFT s, median decode s) of timed runs ([TTFT s, decode s] each)."""
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def time_neuronfx(runtime: neuronfx.Runtime, prompts: Sequence[Sequence[int]], gen: int, device: str,
                  repeats: int) -> tuple[float, float]:
    """One warm-up run, then ``repeats`` timed runs on the same state (its slots released after
    each: the KV cache stays the one the CUDA graphs were captured for)."""
    state = neuronfx.init_state(runtime)
    _, _, state, _ = neuronfx_run(runtime, state, prompts, gen, device)  # warm-up, and the capture for this state's KV
    runs = []
    for _ in range(repeats):
        _, timing, state, _ = neuronfx_run(runtime, state, prompts, gen, device)
        runs.append(timing)
    return median_timing(runs)


# --- stages -----------------------------------------------------------------------------------------


def greedy_stage(shape: dict, device: str, backends: Sequence[str], gen: int, report: dict) -> None:
    """Greedy tokens and first logits of neuronfx (each backend) vs transformers, fp32."""
    hf = hf_model(shape)
    state_dict = {k: v.clone() for k, v in hf.state_dict().items()}
    reference = copy.deepcopy(hf).to(device)
    prompts = [prompts_of(shape["vocab_size"], 1, 40, seed=1)[0], prompts_of(shape["vocab_size"], 1, 17, seed=2)[0]]
    want, want_first = [], []
    for p in prompts:
        tokens, _ = hf_run(reference, [p], gen, device, static=False)
        want.append(tokens[0])
        with torch.no_grad():
            want_first.append(reference(torch.tensor([p], device=device)).logits[0, -1].float().cpu())
    for backend in backends:
        try:
            greedy_backend(hf, state_dict, device, backend, prompts, want, want_first, gen, report)
        except Exception:  # the other backends still run
            report["errors"].append(f"greedy {backend}: {traceback.format_exc()}")
            log(f"greedy {backend} FAILED:\n{traceback.format_exc()}")


def greedy_backend(hf: LlamaForCausalLM, state_dict: dict, device: str, backend: str, prompts: list[list[int]],
                   want: list[list[int]], want_first: list[torch.Tensor], gen: int, report: dict) -> None:
    """One backend's greedy tokens and first logits against transformers' (``want``, ``want_first``)."""
    t0 = time.perf_counter()
    runtime = compile_neuronfx(hf, state_dict, device, backend, "float32", 2, 64, 128, logits=True)
    compile_s = time.perf_counter() - t0
    tokens, _, _, first = neuronfx_run(runtime, neuronfx.init_state(runtime), prompts, gen, device)
    same = [sum(a == b for a, b in zip(t, w)) for t, w in zip(tokens, want)]
    err = max(float((f - w).abs().max()) for f, w in zip(first, want_first))
    ok = tokens == want and err < 1e-3
    report["greedy"].append({"backend": backend, "identical": tokens == want, "matching_tokens": same, "of": gen,
                             "max_first_logit_error": err, "compile_s": compile_s, "ok": ok})
    log(f"greedy {backend}: tokens identical={tokens == want} ({same} of {gen}), first-logit max error {err:.2e}, "
        f"compile {compile_s:.1f} s -> {'OK' if ok else 'FAIL'}")
    del runtime


def compiled_reference(model: LlamaForCausalLM) -> Callable[[], None]:
    """transformers' own compiled generation on ``model``: a static cache, with which generate()
    compiles the decode forward (fullgraph, reduce-overhead: CUDA graphs); returns the function
    that undoes it."""
    model.generation_config.cache_implementation = "static"
    # generate() compiles the decode forward by itself once it sees a static cache on CUDA
    # (``_valid_auto_compile_criteria``, CompileConfig: fullgraph, reduce-overhead). Compiling
    # model.forward by hand as well failed on the first GPU run (transformers 5.17, torch 2.11):
    # "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run".

    def undo() -> None:
        model.generation_config.cache_implementation = None
        torch._dynamo.reset()

    return undo


def bench_tasks(backends: Sequence[str], batches: Sequence[int], compile_reference: bool) -> list[tuple[str, str, int]]:
    """(engine, variant, batch) in the order they run, the comparison the issue asks for first
    (neuronfx compiled vs transformers compiled, batch 1 then the others), eager rows last: a
    run cut short by the time budget still has the headline figures."""
    reference = "static+compile" if compile_reference else "static"
    head = [task for b in batches for task in (("neuronfx", backends[0], b), ("transformers", reference, b))]
    tail = [task for b in batches for task in [("neuronfx", k, b) for k in backends[1:]] + [("transformers", "eager", b)]]
    return head + tail


TRANSFORMERS_VARIANTS = {  # variant -> (row name, static cache, torch.compile)
    "static+compile": ("transformers static cache + torch.compile", True, True),
    "static": ("transformers static cache", True, False),  # the dry run: the same path without compiling
    "eager": ("transformers eager (dynamic cache)", False, False),
}


def bench_stage(shape: dict, device: str, backends: Sequence[str], batches: Sequence[int], prompt_len: int, gen: int,
                repeats: int, compile_reference: bool, dtype: str, deadline: float, report: dict) -> None:
    hf = hf_model(shape)
    torch_dtype = getattr(torch, dtype)
    state_dict = {k: v.to(torch_dtype) for k, v in hf.state_dict().items()}
    tasks = bench_tasks(backends, batches, compile_reference)
    while tasks:
        engine, variant, b = tasks.pop(0)
        if time.perf_counter() > deadline:
            report["skipped"].append(f"{engine} {variant} batch {b} (time budget)")
            log(f"skipped {engine} {variant} batch {b}: over the time budget")
            continue
        prompts = prompts_of(shape["vocab_size"], b, prompt_len, seed=10 + b)
        try:
            if engine == "neuronfx":
                bench_neuronfx(hf, state_dict, device, variant, dtype, b, prompts, gen, repeats, report)
            else:
                bench_transformers(hf, torch_dtype, device, variant, dtype, b, prompts, gen, repeats, report)
        except Exception:  # report and go on: the table shows what ran
            report["errors"].append(f"{engine} {variant} batch {b}: {traceback.format_exc()}")
            log(f"{engine} {variant} batch {b} FAILED:\n{traceback.format_exc()}")
            if (engine, variant) == ("neuronfx", "inductor") and device != "cpu":
                tasks.insert(0, ("neuronfx", "inductor-nographs", b))  # capture or compile? the same without CUDA graphs


def bench_neuronfx(hf: LlamaForCausalLM, state_dict: dict, device: str, backend: str, dtype: str, b: int,
                   prompts: list[list[int]], gen: int, repeats: int, report: dict) -> None:
    if backend == "inductor-nographs":  # the compiled graphs as plain calls (cuda_graphs.ENV_VAR)
        os.environ["NEURONFX_CUDA_GRAPHS"] = "0"
    try:
        t0 = time.perf_counter()
        runtime = compile_neuronfx(hf, state_dict, device, backend.removesuffix("-nographs"), dtype, b, len(prompts[0]),
                                   len(prompts[0]) + gen, logits=False)
        compile_s = time.perf_counter() - t0
    finally:
        os.environ.pop("NEURONFX_CUDA_GRAPHS", None)
    ttft, decode = time_neuronfx(runtime, prompts, gen, device, repeats)
    suffix = {"inductor": " (CUDA graphs)" if device != "cpu" else "", "inductor-nographs": " (no CUDA graphs)"}.get(backend, "")
    name = f"neuronfx {backend.removesuffix('-nographs')}{suffix}"
    add_row(report, name, dtype, b, ttft, decode, gen, compile_s)


def bench_transformers(hf: LlamaForCausalLM, torch_dtype: torch.dtype, device: str, variant: str, dtype: str, b: int,
                       prompts: list[list[int]], gen: int, repeats: int, report: dict) -> None:
    name, static, compiled = TRANSFORMERS_VARIANTS[variant]
    model = copy.deepcopy(hf).to(device=device, dtype=torch_dtype)
    undo = compiled_reference(model) if compiled else None
    try:
        t0 = time.perf_counter()
        for _ in range(2):  # warm-up: compile and capture (prefill and decode shapes)
            hf_run(model, prompts, gen, device, static=static)
        compile_s = time.perf_counter() - t0
        ttft, decode = median_timing([hf_run(model, prompts, gen, device, static=static)[1] for _ in range(repeats)])
        add_row(report, name, dtype, b, ttft, decode, gen, compile_s if compiled else None)
    finally:
        if undo is not None:
            undo()


def add_row(report: dict, engine: str, dtype: str, b: int, ttft: float, decode: float, gen: int, compile_s: float | None) -> None:
    row = {"engine": engine, "dtype": dtype, "batch": b, "ttft_ms": ttft * 1e3, "decode_tok_s": b * (gen - 1) / decode,
           "tpot_ms": decode / (gen - 1) * 1e3, "warmup_or_compile_s": compile_s}
    report["bench"].append(row)
    log(f"{engine} {dtype} batch {b}: TTFT {row['ttft_ms']:.1f} ms, decode {row['decode_tok_s']:.0f} tok/s "
        f"(TPOT {row['tpot_ms']:.2f} ms)")


def table(report: dict) -> list[str]:
    lines = [f"device: {report['device_name']} (torch {report['torch']}, transformers {report['transformers']})", "",
             "| engine | dtype | batch | TTFT ms | decode tok/s | TPOT ms | compile / warm-up s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(report["bench"], key=lambda r: (r["batch"], r["engine"])):
        c = "" if r["warmup_or_compile_s"] is None else f"{r['warmup_or_compile_s']:.0f}"
        lines.append(f"| {r['engine']} | {r['dtype']} | {r['batch']} | {r['ttft_ms']:.1f} | {r['decode_tok_s']:.0f} | "
                     f"{r['tpot_ms']:.2f} | {c} |")
    ref = {r["batch"]: r for r in report["bench"] if r["engine"].startswith("transformers static")}
    for r in report["bench"]:
        if r["engine"].startswith("neuronfx inductor") and r["batch"] in ref:
            lines.append(f"neuronfx / transformers compiled, batch {r['batch']}: decode "
                         f"{r['decode_tok_s'] / ref[r['batch']]['decode_tok_s']:.2f}x, TTFT "
                         f"{ref[r['batch']]['ttft_ms'] / r['ttft_ms']:.2f}x faster")
    for g in report["greedy"]:
        lines.append(f"greedy fp32 neuronfx {g['backend']} vs transformers: identical={g['identical']} "
                     f"({g['matching_tokens']} of {g['of']}), first-logit error {g['max_first_logit_error']:.1e}")
    lines.append(f"errors: {len(report['errors'])}; skipped (time budget): {report['skipped'] or 'none'}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, eager backend, no torch.compile: a few seconds")
    p.add_argument("--out", default=None, help="directory for gpu_check.json")
    p.add_argument("--stages", default="greedy,bench", help="comma-separated: greedy, bench")
    p.add_argument("--batches", type=int, nargs="+", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=250.0,
                   help="start no benchmark row after this many seconds (run_on_gpu.sh's timeout is 330 s)")
    args = p.parse_args(argv)
    if args.dry_run:
        device, shape, backends, gen, prompt_len, batches = "cpu", TINY, ["eager"], 8, 16, args.batches or [1, 2]
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run here, or on a GPU (tests/device/run_on_gpu.sh)", file=sys.stderr)
            return 2
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products as fp32 (the greedy stage's tolerance)
        device, shape, backends, gen, prompt_len, batches = "cuda", SMOLLM2_135M, ["inductor", "eager"], 128, 128, args.batches or [1, 8]
    import transformers

    report = {"device": device, "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
              "torch": torch.__version__, "transformers": transformers.__version__, "greedy": [], "bench": [], "errors": [], "skipped": []}
    stages = set(args.stages.split(","))
    t0 = time.perf_counter()
    if "greedy" in stages:
        try:
            greedy_stage(shape, device, backends, 32 if device == "cuda" else 8, report)
        except Exception:
            report["errors"].append(f"greedy: {traceback.format_exc()}")
            log(f"greedy FAILED:\n{traceback.format_exc()}")
    if "bench" in stages:
        bench_stage(shape, device, backends, batches, prompt_len, gen, args.repeats, compile_reference=device == "cuda",
                    dtype="bfloat16", deadline=t0 + args.budget_s, report=report)
    report["wall_s"] = time.perf_counter() - t0
    lines = table(report)
    print("\n".join(["", *lines, f"wall {report['wall_s']:.0f} s"]))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(json.dumps(report, indent=1))
    failed = report["errors"] or not all(g["ok"] for g in report["greedy"])
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
