"""Tensor-parallel sharding plan (``config/sharding.py``) and ``read_shard``: property tests over
random GQA shapes and tp degrees, plus the concrete SmolLM2-135M case."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neuronfx.config import InferenceConfig, ModelConfig, make_plan
from neuronfx.config.families import FAMILIES
from neuronfx.config.sharding import (
    REPLICATED,
    WEIGHT_RULES,
    Split,
    check_tp,
    rank_shard,
    replicated,
    split_shape,
    weight_rules,
    weight_split,
)
from neuronfx.errors import ConfigError
from neuronfx.io.weights import expected_shapes, read_shard

SETTINGS = settings(max_examples=60, deadline=None)
KV_NAMES = frozenset(n for n, (kind, _) in WEIGHT_RULES.items() if kind == "kv_heads")


def llama(*, heads: int, kv: int, head_dim: int, intermediate: int, vocab: int, hidden: int = 8,
          layers: int = 1, tied: bool = False, experts: int = 0, expert_intermediate: int = 0) -> ModelConfig:
    """A llama ModelConfig, or a qwen3_moe one with ``experts`` > 0 (top-1, experts
    ``expert_intermediate`` wide)."""
    moe = dict(model_type="qwen3_moe", num_experts=experts, num_experts_per_tok=1, moe_intermediate_size=expert_intermediate,
               qk_norm=True) if experts else dict(model_type="llama")
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                       intermediate_size=intermediate, rope_theta=10000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=tied, **moe)


@st.composite
def model_and_tp(draw) -> tuple[ModelConfig, int]:
    """(a random GQA llama or qwen3_moe ModelConfig, a tp_degree in [1, min(num_attention_heads, 8)])."""
    kv = draw(st.integers(1, 8))
    group = draw(st.integers(1, 6))
    heads = kv * group
    experts = draw(st.sampled_from([0, 0, 1, 3]))
    model = llama(heads=heads, kv=kv, head_dim=draw(st.sampled_from([2, 4, 8])),
                  intermediate=draw(st.integers(1, 40)), vocab=draw(st.integers(1, 100)),
                  hidden=draw(st.integers(1, 5)), experts=experts,
                  expert_intermediate=draw(st.integers(1, 40)) if experts else 0)
    tp = draw(st.integers(1, min(heads, 8)))
    return model, tp


def shards(model: ModelConfig, tp: int):
    return [rank_shard(model, tp, r) for r in range(tp)]


def hf_shape(model: ModelConfig, name: str) -> tuple[int, ...]:
    """HF (out, in) shape of weight ``name`` of ``model``."""
    h, d = model.hidden_size, model.head_dim
    q, kv = model.num_attention_heads * d, model.num_key_value_heads * d
    i, v = model.intermediate_size, model.vocab_size
    e, ei = model.num_experts, model.moe_intermediate_size
    return {
        "wq": (q, h), "bq": (q,), "wk": (kv, h), "bk": (kv,), "wv": (kv, h), "bv": (kv,), "wo": (h, q),
        "gate": (i, h), "up": (i, h), "down": (h, i), "embed": (v, h), "lm_head": (v, h),
        "norm": (h,), "attn_norm": (h,), "mlp_norm": (h,), "q_norm": (d,), "k_norm": (d,),
        "bgate": (i,), "bup": (i,), "bdown": (h,), "bo": (h,), "rope_index": (), "mask_index": (), "use_rope": (), "post_attn_norm": (h,), "post_mlp_norm": (h,),
        "router": (e, h), "experts_gate": (e, ei, h), "experts_up": (e, ei, h), "experts_down": (e, h, ei),
    }[name]


@given(model_and_tp())
@SETTINGS
def test_heads_partition_over_ranks(case):
    """Every query head is on exactly one rank (other slots None = padding), every KV head on
    exactly ``kv_replication`` ranks; head counts are equal on all ranks, the padded total
    (tp * num_heads) covers the model's heads, and each rank's q heads are whole KV groups."""
    model, tp = case
    ranks = shards(model, tp)
    heads, kv = model.num_attention_heads, model.num_key_value_heads
    q_seen = [h for s in ranks for h in s.q_heads if h is not None]
    assert sorted(q_seen) == list(range(heads))
    kv_seen = [h for s in ranks for h in s.kv_heads if h is not None]
    replication = ranks[0].kv_replication
    assert all(s.kv_replication == replication for s in ranks)
    assert sorted(kv_seen) == sorted(list(range(kv)) * replication)
    assert len({s.num_heads for s in ranks}) == 1
    assert len({s.num_kv_heads for s in ranks}) == 1
    total = sum(s.num_heads for s in ranks)
    assert total == tp * ranks[0].num_heads >= heads
    for s in ranks:
        assert s.num_kv_heads >= 1
        assert s.num_heads % s.num_kv_heads == 0
        assert (s.tp_degree, s.rank, s.head_dim) == (tp, ranks.index(s), model.head_dim)


@given(model_and_tp())
@SETTINGS
def test_gqa_alignment(case):
    """Each real local query head i sits under the local KV head i // (num_heads / num_kv_heads)
    whose global index is that query head's global KV group q // (H / KV)."""
    model, tp = case
    group = model.num_attention_heads // model.num_key_value_heads
    for s in shards(model, tp):
        local_group = s.num_heads // s.num_kv_heads
        for i, q in enumerate(s.q_heads):
            if q is None:
                continue
            assert s.kv_heads[i // local_group] == q // group, (s, i, q)


def _check_weight(model: ModelConfig, tp: int, name: str, source: torch.Tensor) -> None:
    ranks = shards(model, tp)
    split0 = weight_split(ranks[0], name)
    dim = split0.dim
    assert dim == weight_rules(model.model_type)[name][1]
    length = source.shape[dim]
    owners = [0] * length
    pieces: list[torch.Tensor] = []
    seen: set[int] = set()
    for s in ranks:
        split = weight_split(s, name)
        assert split.dim == dim
        out = read_shard(source, split, "float32")
        assert tuple(out.shape) == split_shape(split, tuple(source.shape))
        assert out.dtype == torch.float32
        offset = 0
        for block in split.blocks:
            # A real block is never empty; a padding block may be (see _range_blocks).
            assert block.size > 0 if block.start is not None else block.size >= 0
            part = out.narrow(dim, offset, block.size)
            offset += block.size
            if block.start is None:
                assert torch.count_nonzero(part) == 0, (name, s.rank, block)
                continue
            assert block.start >= 0 and block.start + block.size <= length, (name, s.rank, block)
            assert torch.equal(part, source.narrow(dim, block.start, block.size)), (name, s.rank, block)
            for j in range(block.size):
                index = block.start + j
                owners[index] += 1
                if index not in seen:  # replicated KV heads: keep the first occurrence
                    seen.add(index)
                    pieces.append(part.narrow(dim, j, 1))
        assert offset == out.shape[dim]
    assert torch.equal(torch.cat(pieces, dim), source), name  # rank order restores the tensor
    expected_owners = ranks[0].kv_replication if name in KV_NAMES else 1
    assert owners == [expected_owners] * length, (name, owners)


@given(model_and_tp(), st.integers(0, 2**31 - 1))
@SETTINGS
def test_read_shard_round_trip(case, seed):
    """For every split weight: each rank's read_shard has shape split_shape(...), its padding
    blocks are exactly zero, its real blocks equal the source's slices, the real blocks of all
    ranks in rank order (first copy of a replicated KV head only) concatenate to the source, and
    each source element is owned by one rank (kv_replication ranks for k/v weights)."""
    model, tp = case
    gen = torch.Generator().manual_seed(seed)
    for name in weight_rules(model.model_type):
        source = torch.randn(hf_shape(model, name), generator=gen)
        _check_weight(model, tp, name, source)


@given(model_and_tp(), st.data())
@SETTINGS
def test_replicated_weights_are_whole_copies(case, data):
    """Norm weights (and the router) are Split(None) on every rank and read_shard returns an
    equal tensor that does not share the source's storage."""
    model, tp = case
    name = data.draw(st.sampled_from(sorted(replicated(model.model_type))))
    source = torch.randn(hf_shape(model, name))
    for s in shards(model, tp):
        split = weight_split(s, name)
        assert split == Split(None)
        assert split_shape(split, tuple(source.shape)) == tuple(source.shape)
        out = read_shard(source, split, "float32")
        assert torch.equal(out, source)
        assert out.data_ptr() != source.data_ptr()


@given(model_and_tp())
@SETTINGS
def test_vocab_and_intermediate_tile(case):
    """Ranks' vocabulary ranges [vocab_start, vocab_start + vocab_size) tile [0, tp * vocab_size)
    in rank order without overlap, and the padded vocabulary is the model's rounded up to a
    multiple of tp (>= model vocab, < model vocab + tp); the same holds for the MLP rows."""
    model, tp = case
    ranks = shards(model, tp)
    position = 0
    for s in ranks:
        assert s.vocab_start == position
        assert s.vocab_size >= 1
        position += s.vocab_size
        assert s.padded_vocab_size == tp * s.vocab_size
        assert model.vocab_size <= s.padded_vocab_size < model.vocab_size + tp
    assert position == ranks[0].padded_vocab_size
    position = 0
    for s in ranks:
        assert s.intermediate_start == position
        position += s.intermediate_size
    assert model.intermediate_size <= position < model.intermediate_size + tp
    position = 0
    for s in ranks:
        assert s.expert_intermediate_start == position
        position += s.expert_intermediate_size
    assert model.moe_intermediate_size <= position < model.moe_intermediate_size + tp or position == 0 == model.moe_intermediate_size


@given(model_and_tp(), st.integers(0, 2**31 - 1))
@SETTINGS
def test_expert_weights_split_per_expert(case, seed):
    """Every expert is split alike: rank r's experts_gate / experts_up hold rows [start, start +
    size) of every expert's (I, H) matrix along dim 1 (experts_down: the same columns along dim 2),
    zeros past I; the router is whole on every rank; the local model's expert width is the
    rank's. Dense models have no expert weights (moe_intermediate_size 0 on every rank)."""
    model, tp = case
    if not model.num_experts:
        assert all(s.expert_intermediate_size == 0 for s in shards(model, tp))
        return
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(hf_shape(model, "experts_gate"), generator=gen)
    down = torch.randn(hf_shape(model, "experts_down"), generator=gen)
    i = model.moe_intermediate_size
    for s in shards(model, tp):
        assert weight_split(s, "router") == Split(None)
        g = read_shard(gate, weight_split(s, "experts_gate"), "float32")
        d = read_shard(down, weight_split(s, "experts_down"), "float32")
        start, size = s.expert_intermediate_start, s.expert_intermediate_size
        real = max(0, min(size, i - start))
        assert g.shape == (model.num_experts, size, model.hidden_size) and d.shape == (model.num_experts, model.hidden_size, size)
        for e in range(model.num_experts):
            assert torch.equal(g[e, :real], gate[e, start:start + real])
            assert torch.equal(d[e, :, :real], down[e, :, start:start + real])
        assert torch.count_nonzero(g[:, real:]) == 0 and torch.count_nonzero(d[:, :, real:]) == 0
        plan = make_plan(model, InferenceConfig(tp_degree=tp), rank=s.rank)
        assert plan.local_model.moe_intermediate_size == (size if tp > 1 else i)


@given(model_and_tp(), st.integers(1, 8))
@SETTINGS
def test_invalid_tp_or_rank_raises(case, extra):
    """check_tp and make_plan raise ConfigError naming the values for tp_degree >
    num_attention_heads, rank >= tp_degree and rank < 0."""
    model, tp = case
    heads = model.num_attention_heads
    big = heads + extra
    for call in (lambda: check_tp(model, big, 0), lambda: make_plan(model, InferenceConfig(tp_degree=big), rank=0)):
        with pytest.raises(ConfigError, match=rf"tp_degree={big}\b.*num_attention_heads={heads}\b"):
            call()
    for rank in (tp, tp + extra, -1, -extra):
        with pytest.raises(ConfigError, match=rf"rank={rank}\b.*tp_degree={tp}\b"):
            check_tp(model, tp, rank)
        with pytest.raises(ConfigError, match=rf"rank={rank}\b.*tp_degree={tp}\b"):
            rank_shard(model, tp, rank)
        with pytest.raises(ConfigError, match=rf"rank={rank}\b.*tp_degree={tp}\b"):
            make_plan(model, InferenceConfig(tp_degree=tp), rank=rank)


def test_sequence_parallel_needs_tp():
    """InferenceConfig(sequence_parallel=True) with tp_degree=1 is a ConfigError."""
    with pytest.raises(ConfigError, match=re.escape("sequence_parallel=True")):
        InferenceConfig(sequence_parallel=True, tp_degree=1)
    assert InferenceConfig(sequence_parallel=True, tp_degree=2).sequence_parallel


def smollm2(layers: int = 1) -> ModelConfig:
    return llama(heads=9, kv=3, head_dim=64, intermediate=1536, vocab=49152, hidden=576, layers=layers, tied=True)


def test_smollm2_heads():
    """SmolLM2-135M (9 q, 3 KV heads): tp=2 pads to 6 q / 2 KV heads per rank (rank 1 holds
    q 6..8 and KV head 2 plus padding), tp=3 needs no padding, and make_plan at tp=2 rank 1 has
    a 2-head KV cache and a 6-head local model."""
    model = smollm2()
    r0, r1 = shards(model, 2)
    assert (r0.num_heads, r0.num_kv_heads, r1.num_heads, r1.num_kv_heads) == (6, 2, 6, 2)
    assert r0.q_heads == (0, 1, 2, 3, 4, 5) and r0.kv_heads == (0, 1)
    assert r1.q_heads == (6, 7, 8, None, None, None)
    assert r1.kv_heads == (2, None)
    for rank, s in enumerate(shards(model, 3)):
        assert s.q_heads == (3 * rank, 3 * rank + 1, 3 * rank + 2)
        assert s.kv_heads == (rank,)
        assert s.kv_replication == 1
    plan = make_plan(model, InferenceConfig(tp_degree=2), rank=1)
    assert plan.rank == 1 and plan.shard == r1
    assert plan.kv.shape[1] == 2
    assert plan.local_model.num_attention_heads == 6
    assert plan.local_model.num_key_value_heads == 2
    assert plan.local_model.intermediate_size == 768


def _rank_elements(model: ModelConfig, tp: int, rank: int) -> int:
    shard = rank_shard(model, tp, rank)
    shapes = expected_shapes(model)
    if model.tie_word_embeddings:
        shapes.pop("lm_head")  # one tensor serves embed and lm_head
    total = 0
    for name, shape in shapes.items():
        base = name.split(".", 2)[2] if name.startswith("layers.") else name
        count = 1
        for n in split_shape(weight_split(shard, base), shape):
            count *= n
        total += count
    return total


def test_smollm2_weights_per_rank():
    """At tp=2 each SmolLM2-135M rank (30 layers, tied embeddings counted once) holds at most
    0.55x of the tp=1 weight elements (shapes only)."""
    model = smollm2(layers=30)
    whole = _rank_elements(model, 1, 0)
    assert whole > 130_000_000
    for rank in range(2):
        assert _rank_elements(model, 2, rank) <= 0.55 * whole


def test_family_rules_extend_the_shared_ones():
    """A family's own weights get its registry entry's rules, beside the shared ones, and no
    family redefines a shared weight; a weight of another family has no rule here."""
    for model_type, family in FAMILIES.items():
        assert not set(family.shard_rules) & (set(WEIGHT_RULES) | REPLICATED), model_type
        assert not family.replicated & (set(WEIGHT_RULES) | REPLICATED), model_type
        assert weight_rules(model_type) == WEIGHT_RULES | dict(family.shard_rules)
    assert weight_rules("qwen3_moe")["experts_down"] == ("expert_intermediate", 2) and "router" in replicated("mixtral")
    assert {"post_attn_norm", "post_mlp_norm", "q_norm", "k_norm"} <= replicated("gemma3_text")
    shard = rank_shard(llama(heads=4, kv=2, head_dim=4, intermediate=8, vocab=16), 2, 0)
    with pytest.raises(ConfigError, match="'experts_gate' of model_type='llama' has no tensor-parallel rule.*shard_rules"):
        weight_split(shard, "experts_gate")
