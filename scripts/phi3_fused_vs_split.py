"""Phi-3's fused projections: split at load (what neuronfx does: Llama's layer, q/k/v and
gate/up as separate weights through ``ops.projections`` / ``ops.glu``) vs kept fused in the
graph (one ``ops.linear`` over ``qkv_proj`` then slices, one over ``gate_up_proj`` then chunk,
as transformers' ``Phi3Attention`` / ``Phi3MLP`` do). One decode token (batch 1) through
``--layers`` layers compiled with inductor and the CPU kernel ops the inductor backend binds.

    OMP_NUM_THREADS=1 python scripts/phi3_fused_vs_split.py [--dtype bfloat16]

Prints the median step time of each variant (and the max |difference| of their outputs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from neuronfx.config.model import ModelConfig
from neuronfx.graphs import llama
from neuronfx.graphs.layers import attention_output, rms_norm, rope_tables, split_heads
from neuronfx.graphs.ops import cpu_kernel_ops, fused_cached_attention


def fused_layer(cfg, ops, lw, h, cos, sin, attend):
    """Phi-3's layer as transformers writes it: fused products, split in the graph."""
    x = rms_norm(h, lw["attn_norm"], cfg.rms_norm_eps)
    q_n, kv_n = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    qkv = ops.linear(x, lw["qkv"], None)
    q, k, v = qkv[..., :q_n], qkv[..., q_n:q_n + kv_n], qkv[..., q_n + kv_n:]
    d = cfg.head_dim
    q, k, v = split_heads(q, cfg.num_attention_heads, d), split_heads(k, cfg.num_key_value_heads, d), split_heads(v, cfg.num_key_value_heads, d)
    h = h + attention_output(ops, lw, q, k, v, cos, sin, attend)
    gate, up = ops.linear(rms_norm(h, lw["mlp_norm"], cfg.rms_norm_eps), lw["gate_up"], None).chunk(2, dim=-1)
    return h + ops.linear(F.silu(gate) * up, lw["down"], None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    # Phi-3-mini's shape scaled down: hidden 1024, 16 heads of 64 (4 KV heads), MLP 2816.
    cfg = ModelConfig(model_type="phi3", vocab_size=1000, hidden_size=1024, num_hidden_layers=args.layers,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=64, intermediate_size=2816,
                      rope_theta=10000.0, rms_norm_eps=1e-5)
    ops = cpu_kernel_ops(args.dtype)
    torch.manual_seed(0)
    shapes = llama.layer_shapes(cfg)
    split = [{k: (torch.randn(s) * 0.02).to(dtype) for k, s in shapes.items()} for _ in range(args.layers)]
    fused = [lw | {"qkv": torch.cat([lw["wq"], lw["wk"], lw["wv"]]), "gate_up": torch.cat([lw["gate"], lw["up"]])}
             for lw in split]
    cache_len, s = 255, 256
    kv = [(torch.randn(2, 4, s, 64).to(dtype), torch.randn(2, 4, s, 64).to(dtype)) for _ in range(args.layers)]
    seq_ids = torch.tensor([0], dtype=torch.int32)
    pos = torch.tensor([[cache_len]], dtype=torch.int32)
    mask = torch.arange(s)[None, None, None, :] <= cache_len  # (1, 1, 1, S)

    def step(layer, lws, h):
        cos, sin = rope_tables(cfg, pos, pos.amax(-1) + 1, h.dtype)
        for lw, (kc, vc) in zip(lws, kv):
            def attend(q, k, v, kc=kc, vc=vc):
                kc[seq_ids[:, None], :, pos.long()] = k.transpose(1, 2)
                vc[seq_ids[:, None], :, pos.long()] = v.transpose(1, 2)
                return fused_cached_attention(q, kc, vc, seq_ids, s, mask)
            h = layer(cfg, ops, lw, h, cos, sin, attend)
        return h

    h0 = torch.randn(1, 1, 1024).to(dtype)
    variants = {"split at load": (llama.decoder_layer, split), "fused in graph": (fused_layer, fused)}
    fns, outs, times = {}, {}, {name: [] for name in variants}
    for name, (layer, lws) in variants.items():
        fns[name] = torch.compile(lambda h, layer=layer, lws=lws: step(layer, lws, h), fullgraph=True, dynamic=False)
        outs[name] = fns[name](h0).float()
    for _ in range(args.iters):  # interleaved, so that load from other processes hits both alike
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn(h0)
            times[name].append(time.perf_counter() - t0)
    for name, t in times.items():
        print(f"{name:15s} {args.dtype}: median {statistics.median(t) * 1e3:.3f} ms/step, min {min(t) * 1e3:.3f} ms "
              f"({args.layers} layers, batch 1, {ops.name})")
    print(f"max |split - fused| = {(outs['split at load'] - outs['fused in graph']).abs().max().item():.2e}")

if __name__ == "__main__":
    main()
