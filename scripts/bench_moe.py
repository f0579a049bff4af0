"""Mixture-of-experts decode: tok/s of the two expert strategies, and weight bytes read per token.

Usage: .venv/bin/python scripts/bench_moe.py [--backends eager inductor] [--steps 30]
Model: a random tiny Mixtral (hidden 256, 8 heads / 2 KV heads, 4 layers, 8 experts of width
512, top-2, vocabulary 1000), fp32. Plan: prefill bucket 16, decode bucket 64, batch buckets 1
and 8. For each backend it runs the strategy neuronfx picks from static shapes ("auto": batch 1
gathers its experts, batch 8 runs all experts densely) and the opposite one ("swapped"), and
prints decode tok/s (median step) at batch 1 and 8, then the weight bytes a decode step reads per
token under each strategy (computed from the shapes) against the model's active parameters.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import MixtralConfig, MixtralForCausalLM

import neuronfx
from neuronfx.graphs import moe
from neuronfx.runtime.steps import DecodeBatch, PrefillBatch, decode_step, prefill_step

ARCH = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256)


def decode_tok_s(runtime: neuronfx.Runtime, batch: int, steps: int) -> float:
    greedy = [neuronfx.SamplingParams()] * batch
    slots = list(range(batch))
    state = neuronfx.init_state(runtime)
    out, state = prefill_step(runtime, state, PrefillBatch(seq_ids=slots, prompts=[[7 + r] * 12 for r in slots], sampling=greedy))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out, state = decode_step(runtime, state, DecodeBatch(seq_ids=slots, input_ids=list(out.tokens), sampling=greedy))
        times.append(time.perf_counter() - t0)
    return batch / sorted(times)[len(times) // 2]


def bytes_per_token(cfg: neuronfx.ModelConfig, batch: int, gather: bool) -> int:
    """fp32 weight bytes one decode step reads, divided by its ``batch`` tokens: attention, norms,
    router, LM head and the embedding rows once per step; experts: k per row gathered (a row's
    picks may repeat another row's, each is read), or all E once densely."""
    h, i, e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = 2 * h + (q + 2 * kv) * h + q * h + e * h
    experts = (batch * k if gather else e) * 3 * i * h
    total = cfg.num_hidden_layers * (per_layer + experts) + cfg.vocab_size * h + batch * h + h
    return 4 * total // batch


def active_parameters(cfg: neuronfx.ModelConfig) -> tuple[int, int]:
    """(parameters a token uses: attention, router, k experts per layer, its embedding row, LM head;
    all parameters)."""
    h, i, e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = 2 * h + (q + 2 * kv) * h + q * h + e * h
    active = cfg.num_hidden_layers * (per_layer + k * 3 * i * h) + cfg.vocab_size * h + 2 * h
    whole = cfg.num_hidden_layers * (per_layer + e * 3 * i * h) + 2 * cfg.vocab_size * h + h
    return active, whole


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", nargs="+", default=["eager", "inductor"])
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.manual_seed(0)
    hf = MixtralForCausalLM(MixtralConfig(**ARCH)).eval()
    cfg = neuronfx.ModelConfig.from_hf(hf.config)
    auto = moe.use_gather
    for backend in args.backends:
        for mode in ("auto", "swapped"):
            moe.use_gather = auto if mode == "auto" else (lambda rows, c: not auto(rows, c))
            inference = neuronfx.InferenceConfig(batch_size=8, batch_buckets=(1, 8), max_context_length=16, sequence_length=64,
                                                 prefill_buckets=(16,), decode_buckets=(64,), backend=backend)
            t0 = time.perf_counter()
            rt = neuronfx.compile(neuronfx.make_plan(cfg, inference), hf.state_dict(), progress=False, cache=False)
            built = time.perf_counter() - t0
            rates = {b: decode_tok_s(rt, b, args.steps) for b in (1, 8)}
            strategy = {b: "gather" if moe.use_gather(b, cfg) else "dense" for b in (1, 8)}
            print(f"{backend:9s} {mode:8s} batch 1 ({strategy[1]}): {rates[1]:7.1f} tok/s   "
                  f"batch 8 ({strategy[8]}): {rates[8]:7.1f} tok/s   (built in {built:.0f} s)", flush=True)
    moe.use_gather = auto
    active, whole = active_parameters(cfg)
    print(f"parameters: {whole:,} in all, {active:,} active per token ({4 * active:,} fp32 bytes)")
    for b in (1, 8):
        for gather in (True, False):
            print(f"batch {b} {'gather' if gather else 'dense ':6s}: {bytes_per_token(cfg, b, gather):>10,} weight bytes read per token")


if __name__ == "__main__":
    main()
