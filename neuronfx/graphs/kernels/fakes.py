"""Fake (meta) implementations of the ``neuronfx::`` kernel ops: the output shape and dtype of
each op from its arguments' shapes, what dynamo, AOTAutograd and inductor trace through
instead of running the C++ (``library.small_gemm_available`` registers them once the library
loads). A fake that disagrees with its op breaks the compiled graphs' tests; ``tests/test_w4a8.py``
compares the 4-bit ones with the ops directly."""

from __future__ import annotations

import torch


def register_fakes() -> None:
    """Register every op's fake implementation with ``torch.library.register_fake``."""
    torch.library.register_fake("neuronfx::small_gemm")(_small_gemm_fake)
    torch.library.register_fake("neuronfx::small_gemm_multi")(_small_gemm_multi_fake)
    torch.library.register_fake("neuronfx::small_glu")(_small_glu_fake)
    torch.library.register_fake("neuronfx::quant_gemm")(_quant_gemm_fake)
    torch.library.register_fake("neuronfx::quant_gemm_multi")(_quant_gemm_multi_fake)
    torch.library.register_fake("neuronfx::quant_glu")(_quant_glu_fake)
    torch.library.register_fake("neuronfx::quant_prefill")(_quant_prefill_fake)
    torch.library.register_fake("neuronfx::w8a8_gemm")(_w8a8_gemm_fake)
    torch.library.register_fake("neuronfx::w8a8_packed")(_w8a8_packed_fake)
    torch.library.register_fake("neuronfx::w8a8_packed_multi")(_w8a8_packed_multi_fake)
    torch.library.register_fake("neuronfx::w8a8_packed_glu")(_w8a8_packed_glu_fake)
    torch.library.register_fake("neuronfx::w4a8_packed")(_w4a8_packed_fake)
    torch.library.register_fake("neuronfx::w4a8_packed_multi")(_w4a8_packed_multi_fake)
    torch.library.register_fake("neuronfx::w4a8_packed_glu")(_w4a8_packed_glu_fake)
    torch.library.register_fake("neuronfx::cached_attention")(_cached_attention_fake)
    torch.library.register_fake("neuronfx::causal_attention")(_causal_attention_fake)
    torch.library.register_fake("neuronfx::topk_rows")(_topk_rows_fake)
    torch.library.register_fake("neuronfx::argmax_rows")(_argmax_rows_fake)
    torch.library.register_fake("neuronfx::store_int8_kv")(_store_int8_kv_fake)


def _store_int8_kv_fake(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                        offsets: torch.Tensor) -> None:
    return None  # writes the caches in place; returns nothing


def _small_gemm_fake(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _small_gemm_multi_fake(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor | None, w2: torch.Tensor | None,
                           b0: torch.Tensor | None, b1: torch.Tensor | None, b2: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in (w0, w1, w2) if w is not None)))


def _small_glu_fake(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], gate.shape[0]))


def _quant_gemm_fake(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor | None, offset: torch.Tensor | None, fmt: int,
                     bias: torch.Tensor | None, int8_x: bool = False) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], data.shape[0]))


def _quant_prefill_fake(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor | None, offset: torch.Tensor | None, fmt: int,
                        bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], data.shape[0]))


def _w8a8_gemm_fake(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], data.shape[0]))


def _w8a8_packed_fake(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], scale.shape[0]))


def _w8a8_packed_multi_fake(x: torch.Tensor, d0: torch.Tensor, s0: torch.Tensor, b0: object, d1: object, s1: torch.Tensor | None,
                            b1: object, d2: object, s2: torch.Tensor | None, b2: object) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(s.shape[0] for s in (s0, s1, s2) if s is not None)))


def _w8a8_packed_glu_fake(x: torch.Tensor, gate: torch.Tensor, gate_scale: torch.Tensor, up: torch.Tensor,
                          up_scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], gate_scale.shape[0]))


def _w4a8_packed_fake(x: torch.Tensor, data: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], 16 * data.shape[0]))


def _w4a8_packed_multi_fake(x: torch.Tensor, d0: torch.Tensor, b0: object, d1: torch.Tensor | None, b1: object, d2: torch.Tensor | None,
                            b2: object) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(16 * d.shape[0] for d in (d0, d1, d2) if d is not None)))


def _w4a8_packed_glu_fake(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], 16 * gate.shape[0]))


def _quant_gemm_multi_fake(x: torch.Tensor, fmt: int, int8_x: bool, d0: torch.Tensor, s0: object, o0: object, b0: object,
                           d1: torch.Tensor | None, s1: object, o1: object, b1: object, d2: torch.Tensor | None, s2: object,
                           o2: object, b2: object) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(d.shape[0] for d in (d0, d1, d2) if d is not None)))


def _quant_glu_fake(x: torch.Tensor, gate: torch.Tensor, gate_scale: torch.Tensor | None, gate_offset: torch.Tensor | None,
                    up: torch.Tensor, up_scale: torch.Tensor | None, up_offset: torch.Tensor | None, fmt: int,
                    int8_x: bool = False) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], gate.shape[0]))


def _causal_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    b, h, t, d = q.shape
    return q.new_empty((b, t, h, d)).transpose(1, 2)  # the kernel's (B, T, H, D) memory


def _cached_attention_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                           mask: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _topk_rows_fake(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty((x.shape[0], k)), x.new_empty((x.shape[0], k), dtype=torch.long)


def _argmax_rows_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty((x.shape[0],), dtype=torch.int32), x.new_empty((x.shape[0],), dtype=torch.bool)
