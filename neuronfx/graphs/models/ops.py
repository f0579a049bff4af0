"""The ops bundle's type: the kernels a graph's math calls, chosen when the graph is built.

Model math (``models/layers.py``, the family files, ``phases/``) never asks whether it is being
compiled or on which CPU it runs: it calls ``ops.linear``, ``ops.attention`` and so on, and the
backend hands it a bundle (the bundles themselves live in ``graphs/kernels/bundles.py``; the
collectives of tensor parallelism are set by ``phases.collectives.tensor_parallel_ops``). This
module holds only the type, so that model files never import a kernel loader.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from neuronfx.graphs.models.kv_rows import store_rows
from neuronfx.graphs.models.quant import QuantizedWeight

TopK = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
"""``topk(x (B, V), k) -> (values (B, k) sorted descending, indices (B, k) int64)`` over the last
dim: :func:`torch_topk`, or a kernel with the same values (``Ops.topk``)."""


def torch_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=-1)`` as a (values, indices) pair."""
    values, indices = torch.topk(x, k, dim=-1)
    return values, indices


def torch_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., V) float -> (``x.argmax(-1)`` as int32, ``torch.isfinite(x).all(-1)``), both (...)."""
    return x.argmax(-1).to(torch.int32), torch.isfinite(x).all(-1)

Tensor = torch.Tensor
Weight = Tensor | QuantizedWeight
"""A linear weight: a float (out, in) tensor or a quantized record (``models/quant.py``)."""


def identity(x: Tensor) -> Tensor:
    """x unchanged: the collectives of a single process."""
    return x


def write_kv(k_cache: Tensor, v_cache: Tensor, blocks: Tensor, offsets: Tensor, k: Tensor, v: Tensor) -> None:
    """``k_cache[blocks, :, offsets] = store_rows(k, k_cache)``, the same for v, in place
    (``kv_rows.store_rows``: a cache's stored form of the rows): caches (num_blocks, H_kv,
    block_size, W), blocks and offsets (B, T) int64 (``kv_rows.block_writes``), k and v (B, T,
    H_kv, D) float. Raises IndexError for a block or offset outside the caches."""
    k_cache[blocks, :, offsets] = store_rows(k, k_cache)
    v_cache[blocks, :, offsets] = store_rows(v, v_cache)


@attrs.frozen(kw_only=True)
class Ops:
    """The kernels of one graph. Shapes: x (..., in), weights (out, in) as in HF checkpoints.

    - ``linear(x, w, b)``: x @ w.T (+ b) -> (..., out) in x's dtype.
    - ``head_linear(x, w, b)``: the LM head's product: ``linear``, except that a row-major int8
      head keeps float x under int8 activations (per-token rounding of the final hidden state
      lands on every logit); a packed one (``kernels.activation_choice.pack_weights``)
      always takes int8 x.
    - ``projections(x, ws, bs)``: ``[linear(x, w, b) ...]`` for weights sharing x (Q/K/V).
    - ``glu(x, gate, up)``: ``silu(x @ gate.T) * (x @ up.T)`` -> (..., intermediate).
    - ``attention(q, k, v, mask)``: q (B, H, Tq, D), k/v (B, H_kv, Tk, D), mask (B, 1, Tq, Tk)
      bool (True = attend) -> (B, H, Tq, D); grouped-query, scale 1/sqrt(D).
    - ``causal_attention(q, k, v, lengths)``: ``attention`` with the causal mask of Tq = Tk new
      tokens starting at position 0 (a fresh prompt): kernels that skip the masked half may
      serve it. lengths (B,) int: row b's real tokens; the outputs of its later (pad) tokens
      are unspecified (nothing reads them), so a kernel may skip them.
    - ``cached_attention(q, k_cache, v_cache, block_table, bucket, mask)``: T new tokens over
      their first ``bucket`` cache positions; k/v_cache (num_blocks, H_kv, block_size, W),
      block_table (B, N) int32 (row b's position j in block ``block_table[b, j // block_size]``
      at offset ``j % block_size``; the slots layout is ``seq_ids[:, None]``), mask (B, 1, T,
      bucket) -> (B, H, T, D). Masked positions may hold anything, NaN included.
    - ``parallel_in(x)``: x (B, T, hidden) into a column-parallel product: identity, or in
      sequence-parallel prefill the all-gather of the ranks' sequence shards (B, T / tp ->
      T, hidden).
    - ``parallel_out(x)``: the partial sums of a row-parallel product (or of a vocabulary-
      parallel embedding) out of the tensor-parallel region: identity at tp 1, all-reduce, or
      in sequence-parallel prefill reduce-scatter along T.
    - ``gather_vocab(x)``: vocabulary-parallel logits (..., V / tp) -> (..., padded V).
    - ``store_kv(k_cache, v_cache, blocks, offsets, k, v)``: write K and V rows (B, T, H_kv, D)
      into the KV caches in place, row (b, t, h) at ``cache[blocks[b, t], h, offsets[b, t]]``
      (blocks and offsets (B, T) int64) in the cache's stored form (``kv_rows.store_rows``;
      default :func:`write_kv`).
    - ``topk(x, k)``: the sampler's top-k, x (B, V) float32 -> (values (B, k) sorted
      descending, indices (B, k) int64) (``phases/sampling.py``'s ``TopK``; default ``torch.topk``).
    - ``argmax(x)``: logits (..., V) float32 -> (the first index of each row's largest value,
      NaN above every number, as ``torch.argmax``: (...) int32; whether the row is all finite:
      (...) bool) (default :func:`torch_argmax`).
    Defaults are the identities of one process.
    """

    name: str
    linear: Callable[[Tensor, Weight, Tensor | None], Tensor]
    head_linear: Callable[[Tensor, Weight, Tensor | None], Tensor]
    projections: Callable[[Tensor, Sequence[Weight], Sequence[Tensor | None]], list[Tensor]]
    glu: Callable[[Tensor, Weight, Weight], Tensor]
    attention: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
    causal_attention: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
    cached_attention: Callable[[Tensor, Tensor, Tensor, Tensor, int, Tensor], Tensor]
    parallel_in: Callable[[Tensor], Tensor] = attrs.field(default=identity)
    parallel_out: Callable[[Tensor], Tensor] = attrs.field(default=identity)
    gather_vocab: Callable[[Tensor], Tensor] = attrs.field(default=identity)
    topk: TopK = attrs.field(default=torch_topk)
    argmax: Callable[[Tensor], tuple[Tensor, Tensor]] = attrs.field(default=torch_argmax)
    store_kv: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], None] = attrs.field(default=write_kv)
