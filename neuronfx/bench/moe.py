"""``neuronfx bench moe``: mixture-of-experts decode on a random tiny Mixtral (hidden 256, 8
heads / 2 KV heads, 4 layers, 8 experts of width 512, top-2, vocabulary 1000), fp32.

1. decode tok/s (median step) at batch 1 and 8 per backend, with the expert strategy neuronfx
   picks from static shapes (``use_gather``: batch 1 gathers its experts, batch 8 runs all
   experts densely); plan: prefill bucket 16, decode bucket 64, batch buckets 1 and 8.
2. one layer's experts alone, both strategies (``gathered_experts``, ``dense_experts``) at 1
   and 8 rows, median call (eager, or torch.compile for --backends inductor): what the choice
   is between.
3. the weight bytes a decode step reads per token under each strategy (computed from the
   shapes) against the model's active parameters."""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import neuronfx
from neuronfx.bench.options import check_at_least, logger
from neuronfx.bench.types import Benchmark
from neuronfx.config.inference import BACKENDS
from neuronfx.graphs.models import moe
from neuronfx.runtime.steps import DecodeBatch, PrefillBatch, decode_step, prefill_step

ARCH = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256)
BATCHES = (1, 8)
STRATEGIES = {"gather": moe.gathered_experts, "dense": moe.dense_experts}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--backends and --steps."""
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=["eager", "inductor"])
    p.add_argument("--steps", type=int, default=30, help="timed decode steps (and expert calls) per figure (default 30)")


def decode_tok_s(runtime: neuronfx.Runtime, batch: int, steps: int) -> float:
    """Tokens per second of the median of ``steps`` decode steps of ``batch`` rows after a prefill."""
    greedy = [neuronfx.SamplingParams()] * batch
    slots = list(range(batch))
    state = neuronfx.init_state(runtime)
    out, state = prefill_step(runtime, state, PrefillBatch(seq_ids=slots, prompts=[[7 + r] * 12 for r in slots], sampling=greedy))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out, state = decode_step(runtime, state, DecodeBatch(seq_ids=slots, input_ids=list(out.tokens), sampling=greedy))
        times.append(time.perf_counter() - t0)
    return batch / statistics.median(times)


def expert_seconds(experts: Callable[..., torch.Tensor], layer: dict[str, torch.Tensor], cfg: neuronfx.ModelConfig, rows: int,
                   steps: int) -> float:
    """Median seconds of ``experts`` over ``rows`` random rows routed by the layer's router."""
    x = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(rows))
    weights, ids = moe.route(x, layer["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    args = (x, weights, ids, layer["experts_gate"], layer["experts_up"], layer["experts_down"])
    experts(*args)  # warm-up (a compile for inductor)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        experts(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def shape_bytes(cfg: neuronfx.ModelConfig, batch: int, gather: bool) -> int:
    """fp32 weight bytes one decode step reads, divided by its ``batch`` tokens: attention, norms,
    router, LM head and the embedding rows once per step; experts: k per row gathered (a row's
    picks may repeat another row's, each is read), or all E once densely."""
    h, i, e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = 2 * h + (q + 2 * kv) * h + q * h + e * h
    experts = (batch * k if gather else e) * 3 * i * h
    return 4 * (cfg.num_hidden_layers * (per_layer + experts) + cfg.vocab_size * h + batch * h + h) // batch


def active_parameters(cfg: neuronfx.ModelConfig) -> tuple[int, int]:
    """(parameters a token uses: attention, router, k experts per layer, its embedding row, LM
    head; all parameters)."""
    h, i, e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = 2 * h + (q + 2 * kv) * h + q * h + e * h
    active = cfg.num_hidden_layers * (per_layer + k * 3 * i * h) + cfg.vocab_size * h + 2 * h
    whole = cfg.num_hidden_layers * (per_layer + e * 3 * i * h) + 2 * cfg.vocab_size * h + h
    return active, whole


def backend_row(hf: Any, cfg: neuronfx.ModelConfig, backend: str, steps: int) -> dict[str, Any]:
    """Figures 1 and 2 for one backend."""
    inference = neuronfx.InferenceConfig(batch_size=8, batch_buckets=BATCHES, max_context_length=16, sequence_length=64,
                                         prefill_buckets=(16,), decode_buckets=(64,), backend=backend)
    t0 = time.perf_counter()
    rt = neuronfx.compile(neuronfx.make_plan(cfg, inference), hf.state_dict(), progress=False, cache=False)
    row: dict[str, Any] = {"backend": backend, "compile_s": time.perf_counter() - t0}
    row["decode_tok_s"] = {b: decode_tok_s(rt, b, steps) for b in BATCHES}
    row["strategy"] = {b: "gather" if moe.use_gather(b, cfg) else "dense" for b in BATCHES}
    layer = rt.weights["layers"][0]
    wrap = functools.partial(torch.compile, fullgraph=True, dynamic=False) if backend == "inductor" else (lambda f: f)
    row["experts_ms"] = {name: {b: expert_seconds(wrap(f), layer, cfg, b, steps) * 1e3 for b in BATCHES}
                         for name, f in STRATEGIES.items()}
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the random Mixtral, measure each backend, print the figures."""
    from transformers import MixtralConfig, MixtralForCausalLM

    check_at_least("steps", args.steps, 1)
    torch.manual_seed(0)
    hf = MixtralForCausalLM(MixtralConfig(**ARCH)).eval()
    cfg = neuronfx.ModelConfig.from_hf(hf.config)
    log = logger(args)
    rows = []
    for backend in args.backends:
        rows.append(backend_row(hf, cfg, backend, args.steps))
        r = rows[-1]
        log(f"{backend:9s} decode " + "   ".join(f"batch {b} ({r['strategy'][b]}): {r['decode_tok_s'][b]:7.1f} tok/s" for b in BATCHES)
            + "   one layer's experts: " + "   ".join(f"{name} " + " / ".join(f"{v:.3f}" for v in ms.values()) + " ms at 1 / 8 rows"
                                                   for name, ms in r["experts_ms"].items()))
    active, whole = active_parameters(cfg)
    per_token = {f"{b} {name}": shape_bytes(cfg, b, name == "gather") for b in BATCHES for name in STRATEGIES}
    log(f"parameters: {whole:,} in all, {active:,} active per token ({4 * active:,} fp32 bytes)")
    for key, n in per_token.items():
        log(f"batch {key:10s}: {n:>10,} weight bytes read per token")
    return {"backends": rows, "active_parameters": active, "parameters": whole, "bytes_per_token": per_token}


BENCHMARK = Benchmark(name="moe", help="mixture-of-experts decode: tok/s, the two expert strategies, weight bytes per token",
                      description=__doc__, add_arguments=add_arguments, run=run)
