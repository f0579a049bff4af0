"""The step-input records (config/inputs.py): the plan's specs, the trace example inputs and the
flat calling convention all come from them, and a mismatch is an error naming the field."""

from __future__ import annotations

import typing

import pytest
import torch

from neuronfx import InferenceConfig, ModelConfig, make_plan
from neuronfx.config.dtypes import dtype_name
from neuronfx.config.inputs import PHASE_INPUTS, DecodeInputs, SamplerInputs, check_inputs, dense_strides, from_leaves, leaf_fields, leaves
from neuronfx.errors import InputError
from neuronfx.graphs.phases.inputs import LayerKV, empty_kv, example_inputs

MODEL = ModelConfig(model_type="llama", vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-6)
PLAN = make_plan(MODEL, InferenceConfig(batch_size=3, max_context_length=32, sequence_length=64, prefill_buckets=(16, 32),
                                        decode_buckets=(32, 64), speculation_length=3, draft_layers=1, backend="eager"))
CHUNKED = make_plan(MODEL, InferenceConfig(batch_size=3, max_context_length=32, sequence_length=64, decode_buckets=(32, 64),
                                           prefill_chunk_size=8, backend="eager"))  # chunking excludes speculation
EMBEDDING = make_plan(MODEL, InferenceConfig(batch_size=3, max_context_length=32, prefill_buckets=(16, 32), task="embed",
                                             backend="eager"))  # embed graphs only


def test_every_graph_spec_is_its_phase_record():
    assert {g.phase for g in PLAN.graphs + CHUNKED.graphs + EMBEDDING.graphs} == set(PHASE_INPUTS)
    for g in PLAN.graphs + CHUNKED.graphs + EMBEDDING.graphs:
        fields = leaf_fields(g.record)
        assert [t.name for t in g.inputs] == [f.name for f in fields]
        assert [t.dtype for t in g.inputs] == [f.dtype for f in fields]
        tokens = {"prefill": g.bucket, "decode": 1, "greedy": 1, "draft": 1, "speculate": 3, "chunk": 8, "embed": g.bucket}[g.phase]
        dims = {"B": g.batch_size, "T": tokens, "V": 300, "P": 7, "W": 10, "N": 1}  # N: the slots layout's one block
        assert [t.shape for t in g.inputs] == [tuple(dims[s] for s in f.shape) for f in fields]


def test_example_inputs_match_their_spec_and_round_trip():
    for plan, g in [(p, g) for p in (PLAN, CHUNKED, EMBEDDING) for g in p.graphs]:
        record = example_inputs(plan, g)
        assert isinstance(record, g.record)
        tensors = leaves(record)
        assert [(tuple(t.shape), dtype_name(t.dtype)) for t in tensors] == [(t.shape, t.dtype) for t in g.inputs]
        check_inputs(g.inputs, record, "test")
        again = from_leaves(g.record, tensors)
        assert all(a is b for a, b in zip(leaves(again), tensors, strict=True))


def test_from_leaves_counts_tensors():
    with pytest.raises(InputError, match="DecodeInputs takes 10 tensors, got 2"):
        from_leaves(DecodeInputs, [torch.zeros(1), torch.zeros(1)])


def _decode_record(**changes: torch.Tensor) -> tuple:
    spec = PLAN.graph("decode", 3, 32)
    record = example_inputs(PLAN, spec)
    sampler = record.sampler._replace(**{k: v for k, v in changes.items() if k in SamplerInputs._fields})
    return spec, record._replace(sampler=sampler, **{k: v for k, v in changes.items() if k not in SamplerInputs._fields})


@pytest.mark.parametrize("field, tensor, found", [
    ("input_ids", torch.zeros(3, 2, dtype=torch.int32), "int32 [3, 2]"),
    ("seq_ids", torch.zeros(3, dtype=torch.int64), "int64 [3]"),
    ("block_table", torch.zeros(3, 2, dtype=torch.int32), "int32 [3, 2]"),
    ("logits_bias", torch.zeros(3, 299), "float32 [3, 299]"),
    ("rand", torch.zeros(3, dtype=torch.float64), "float64 [3]"),
])
def test_mismatch_names_the_field(field, tensor, found):
    spec, record = _decode_record(**{field: tensor})
    with pytest.raises(InputError) as info:
        check_inputs(spec.inputs, record, "decode graph")
    assert f"'{field}' is {found}, the graph takes" in str(info.value)


@pytest.mark.parametrize("rand", [
    torch.zeros(3, 2)[:, 0],  # not contiguous
    torch.zeros(3, 4)[:, 1:2].flatten(),  # a reshape of a strided view: still strided
])
def test_strided_input_is_named(rand):
    spec, record = _decode_record(rand=rand)
    with pytest.raises(InputError, match=r"'rand' has strides \[\d\], the graph takes dense row-major strides \[1\]"):
        check_inputs(spec.inputs, record, "decode graph")


def test_size_one_dim_with_another_stride_is_named():
    # is_contiguous() ignores a size-1 dimension's stride; dynamo's guards of a compiled part do not
    # (self-speculation at k = 4, batch 1 passed u[:, i] of a (1, 3) tensor: stride 3).
    plan = make_plan(MODEL, InferenceConfig(batch_size=1, backend="eager", max_context_length=32, sequence_length=64,
                                            prefill_buckets=(32,), decode_buckets=(64,)))
    spec = plan.graph("decode", 1, 64)
    record = example_inputs(plan, spec)
    rand = torch.zeros(1, 3)[:, 1]
    assert rand.is_contiguous() and rand.stride() == (3,)
    record = record._replace(sampler=record.sampler._replace(rand=rand))
    with pytest.raises(InputError, match=r"'rand' has strides \[3\], the graph takes dense row-major strides \[1\]"):
        check_inputs(spec.inputs, record, "decode graph")


@pytest.mark.parametrize("shape", [(), (1,), (3,), (1, 1), (2, 1, 3), (4, 0, 2)])
def test_dense_strides_are_torch_empty_strides(shape):
    assert dense_strides(shape) == torch.empty(shape).stride()


def test_kv_cache_is_named_per_layer():
    kv = empty_kv(PLAN)
    assert len(kv) == MODEL.num_hidden_layers and all(isinstance(layer, LayerKV) for layer in kv)
    assert kv[1].k.shape == kv[1].v.shape == PLAN.kv.shape and kv[0].k is not kv[0].v


# --- the phase-part records (graphs/phases/records.py) -----------------------------------------


def test_prologues_return_their_phase_record_with_the_annotated_shapes():
    """Every graph's prologue (reference ops) turns its example step inputs into its phase's
    record; each field has the shape its annotation names (B rows, T new tokens, S the decode
    bucket, H hidden, R / M the layout's RoPE and mask kinds, D rotary dims) and its dtype."""
    from neuronfx.graphs.kernels.bundles import REFERENCE_OPS
    from neuronfx.graphs.phases.compose import phase_parts
    from neuronfx.graphs.phases.records import ChunkHidden, DecodeHidden, PrefillHidden, field_shapes

    embed = torch.randn(300, 64, generator=torch.Generator().manual_seed(0))
    want = {"prefill": PrefillHidden, "decode": DecodeHidden, "greedy": DecodeHidden, "draft": DecodeHidden, "speculate": DecodeHidden,
            "chunk": ChunkHidden, "embed": PrefillHidden}
    for plan, g in [(p, g) for p in (PLAN, CHUNKED, EMBEDDING) for g in p.graphs]:
        x = phase_parts(plan, g, REFERENCE_OPS).prologue(embed, example_inputs(plan, g))
        assert type(x) is want[g.phase]
        tokens = example_inputs(plan, g).input_ids.shape[1]
        dims = {"B": g.batch_size, "T": tokens, "S": g.bucket, "H": 64, "R": 1, "M": 1, "D": 16, "1": 1, "N": 1, "G": 1}
        for name, shape in field_shapes(type(x)).items():
            assert tuple(getattr(x, name).shape) == tuple(dims[s] for s in shape), (g.key, name)
        assert x.h.dtype == torch.float32 and x.mask.dtype == torch.bool and x.offsets.dtype == torch.int64


def test_symbol_dims_find_every_dimension_of_a_symbol():
    """The inductor backend compiles the bucket's dimensions dynamic from the records'
    annotations: decode's S is the mask's last dim alone, prefill's T is in h, RoPE, mask
    (twice), the blocks and offsets it writes and the token ids, and every shared part's symbol is one its record has."""
    from neuronfx.graphs.backends.inductor_parts import BUCKET_DIMS
    from neuronfx.graphs.phases.records import DecodeHidden, PrefillHidden, field_shapes, symbol_dims

    t = [torch.zeros(2, 4, 8), torch.zeros(1, 2, 1, 4, 16), torch.zeros(1, 2, 1, 4, 16), torch.zeros(1, 2, 1, 4, 4, dtype=torch.bool),
         torch.zeros(1, 2, 4, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
         torch.zeros(2, 4, dtype=torch.int32)]
    prefill = PrefillHidden(*t)
    assert [(id(x), d) for x, d in symbol_dims(([], prefill), "T")] == [
        (id(t[0]), 1), (id(t[1]), 3), (id(t[2]), 3), (id(t[3]), 3), (id(t[3]), 4), (id(t[4]), 2), (id(t[5]), 1), (id(t[7]), 1)]
    decode = DecodeHidden(t[0], t[1], t[2], torch.zeros(1, 2, 1, 4, 32, dtype=torch.bool), torch.zeros(1, 2, 1, dtype=torch.int32),
                          torch.zeros(1, 2, 4, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64))
    assert [(id(x), d) for x, d in symbol_dims((decode, "not a record"), "S")] == [(id(decode.mask), 4)]
    for part, dims in BUCKET_DIMS.items():
        hint = typing.get_type_hints(part)["x"]
        for record in typing.get_args(hint) or (hint,):
            assert dims.symbol is None or any(dims.symbol in shape for shape in field_shapes(record).values()), (part, record)
