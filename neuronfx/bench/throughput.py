"""``neuronfx bench throughput``: serving throughput in one process, output tok/s (requested
generated tokens / wall seconds) of neuronfx's continuous-batching scheduler over --slots KV
slots, against transformers in static batches of --slots requests in arrival order (``--compare
transformers``), the same workload (random token ids; prompt and generation lengths drawn from
one seed) in the same run. Greedy, every request generating exactly its length (eos ignored)."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import neuronfx
from neuronfx.bench.options import Log, add_engine, add_model, check_at_least, logger
from neuronfx.bench.timing import transformers_model
from neuronfx.bench.types import Benchmark
from neuronfx.bench.workload import WorkloadRequest, check_range, make_workload, random_ids
from neuronfx.config.dtypes import torch_dtype
from neuronfx.config.inference import InferenceConfig
from neuronfx.config.plan import make_plan
from neuronfx.config.sampling import SamplingParams
from neuronfx.io import checkpoints
from neuronfx.runtime.runtime import Runtime

Workload = tuple[WorkloadRequest, ...]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --backend, --dtype, the workload, --slots and --compare."""
    add_model(p)
    add_engine(p)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--slots", type=int, default=8, help="KV-cache slots of neuronfx, batch size of transformers (default 8)")
    p.add_argument("--prompt-lens", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"), help="(default 32 512)")
    p.add_argument("--gen-lens", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"), help="(default 16 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", choices=["transformers"], default=None, help="also run transformers in static batches")


def serve_neuronfx(runtime: Runtime, work: Workload) -> float:
    """Seconds to run every request through ``neuronfx.generate`` (the reference continuous-
    batching scheduler), greedy, each request generating exactly its length (eos ignored)."""
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in work]
    t0 = time.perf_counter()
    result, _ = neuronfx.generate(runtime, neuronfx.init_state(runtime), [list(r.prompt_ids) for r in work], sampling=params)
    elapsed = time.perf_counter() - t0
    if [len(t) for t in result.token_ids] != [r.max_tokens for r in work]:
        raise RuntimeError("a request generated a different number of tokens than asked")  # would bias tok/s
    return elapsed


def serve_transformers(model: Any, work: Workload, batch_size: int) -> float:
    """Seconds for transformers ``generate`` over static batches of ``batch_size`` requests in
    arrival order: prompts left-padded, each batch runs until its longest generation is done."""
    t0 = time.perf_counter()
    for i in range(0, len(work), batch_size):
        batch = work[i:i + batch_size]
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[0] * (width - len(r.prompt_ids)) + list(r.prompt_ids) for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
        longest = max(r.max_tokens for r in batch)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def run_throughput(checkpoint: Any, backend: str, dtype: str, num_requests: int = 64, slots: int = 8,
                   prompt_range: tuple[int, int] = (32, 512), gen_range: tuple[int, int] = (16, 256), seed: int = 0,
                   compare_transformers: bool = True, log: Log = print) -> dict[str, Any]:
    """Serving throughput of ``checkpoint`` (see the module docstring); returns JSON-able
    figures (seconds, tok/s). Raises ConfigError for a plan that cannot hold the ranges."""
    vocab = checkpoint.config.vocab_size
    work = make_workload(random_ids(vocab, 4096, seed), num_requests, prompt_range, gen_range, seed)
    tokens = sum(r.max_tokens for r in work)
    inference = InferenceConfig(batch_size=slots, max_context_length=prompt_range[1], sequence_length=prompt_range[1] + gen_range[1],
                                dtype=dtype, backend=backend)
    plan = make_plan(checkpoint.config, inference)
    t0 = time.perf_counter()
    runtime = neuronfx.compile(plan, checkpoint.state_dict, progress=log is print)
    out: dict[str, Any] = {"num_requests": num_requests, "slots": slots, "generated_tokens": tokens, "graphs": len(plan.graphs),
                           "prompt_tokens": sum(len(r.prompt_ids) for r in work), "compile_s": time.perf_counter() - t0,
                           "dtype": dtype, "backend": backend}
    serve_neuronfx(runtime, make_workload(random_ids(vocab, 64, seed + 1), slots, (8, 8), (4, 4), seed + 1))  # warm-up
    out["neuronfx_s"] = serve_neuronfx(runtime, work)
    out["neuronfx_tok_s"] = tokens / out["neuronfx_s"]
    log(f"neuronfx     scheduler, {slots} slots: {tokens} tokens in {out['neuronfx_s']:.1f} s = {out['neuronfx_tok_s']:.1f} tok/s")
    del runtime
    if compare_transformers:
        out["transformers_s"] = serve_transformers(transformers_model(checkpoint, dtype), work, slots)
        out["transformers_tok_s"] = tokens / out["transformers_s"]
        out["ratio"] = out["neuronfx_tok_s"] / out["transformers_tok_s"]
        log(f"transformers static batches of {slots}: {tokens} tokens in {out['transformers_s']:.1f} s = "
            f"{out['transformers_tok_s']:.1f} tok/s")
        log(f"ratio neuronfx / transformers: x{out['ratio']:.2f}")
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Check the options, read the checkpoint, measure."""
    check_at_least("num_requests", args.num_requests, 1)
    check_at_least("slots", args.slots, 1)
    prompt_range, gen_range = check_range("prompt-lens", args.prompt_lens, 1), check_range("gen-lens", args.gen_lens, 1)
    ckpt = checkpoints.load_checkpoint(args.model or checkpoints.default_model_path(), dtype=torch_dtype(args.dtype))
    return run_throughput(ckpt, args.backend, args.dtype, args.num_requests, args.slots, prompt_range, gen_range, args.seed,
                          compare_transformers=args.compare == "transformers", log=logger(args))


BENCHMARK = Benchmark(name="throughput", help="serving throughput in one process: the continuous-batching scheduler against "
                      "transformers' static batches", description=__doc__, add_arguments=add_arguments, run=run)
