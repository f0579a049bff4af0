"""The host side of a step's inputs (``runtime/pipeline.py``, ``runtime/blocks.py``): the
one-op forms a decode step takes (one position a row, the slots layout's block table, the
counts' scatter) against the general rules they shortcut, built naively here."""

import types

import torch

from neuronfx.config import InferenceConfig, ModelConfig, make_plan
from neuronfx.config.inputs import DecodeInputs, GreedyInputs, PrefillInputs
from neuronfx.config.kv import chunk_positions
from neuronfx.runtime.blocks import empty_blocks, reserve, table_rows
from neuronfx.runtime.pipeline import count_tokens, plan_rows, step_inputs

MODEL = ModelConfig(model_type="llama", vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-5)


def runtime_of(**overrides) -> types.SimpleNamespace:
    """What step_inputs and plan_rows read of a runtime: its plan."""
    return types.SimpleNamespace(plan=make_plan(MODEL, InferenceConfig(batch_size=4, max_context_length=32, sequence_length=64,
                                                                       **overrides)))


def test_decode_positions_are_the_general_rule_at_one_token():
    """A decode row's position is its start: chunk_positions' value at T = 1 (padding rows: 0),
    for greedy and decode records alike; prefill rows still take the general rule."""
    rt = runtime_of()
    slots, starts = [3, 0, 2], [17, 5, 40]
    for phase, record in (("decode", DecodeInputs), ("greedy", GreedyInputs)):
        rows = plan_rows(rt, phase, rt.plan.decode_buckets, slots, [(7,), (8,), (9,)], starts, width=1)
        inputs = step_inputs(rt, rows, None, torch.zeros(rows.bsz, 1, dtype=torch.int32))
        assert type(inputs) is record and rows.bsz == 4
        padded = torch.tensor([*starts, 0], dtype=torch.int32)
        want = chunk_positions(padded, torch.ones(4, dtype=torch.int32), 1)
        assert inputs.position_ids.dtype == torch.int32 and torch.equal(inputs.position_ids, want)
        assert inputs.position_ids.tolist() == [[17], [5], [40], [0]]
        assert inputs.input_ids.tolist() == [[7], [8], [9], [0]]
    prompts = [(1, 2, 3), (4, 5, 6, 7, 8)]
    rows = plan_rows(rt, "prefill", rt.plan.prefill_buckets, [1, 2], prompts, (0, 0))
    inputs = step_inputs(rt, rows, None, torch.zeros(rows.bsz, 1, dtype=torch.int32))
    assert type(inputs) is PrefillInputs
    lens = torch.tensor([3, 5] + [1] * (rows.bsz - 2), dtype=torch.int32)
    assert torch.equal(inputs.position_ids, chunk_positions(torch.zeros(rows.bsz, dtype=torch.int32), lens, rows.width))
    assert torch.equal(inputs.prompt_lens, lens)


def test_slot_tables_match_a_filled_table():
    """The slots layout's table in one op equals the fill-then-write form: row b ``[slot, then
    scratch]``, padding rows all scratch."""
    plan = runtime_of().plan
    kv = plan.kv
    for slots, rows in (([2, 0], 4), ([1], 1), ([3, 1, 0, 2], 4)):
        want = torch.full((rows, kv.max_blocks_per_seq), kv.scratch_block, dtype=torch.int32)
        want[: len(slots), 0] = torch.tensor(slots, dtype=torch.int32)
        got = table_rows(plan, None, slots, rows)
        assert got.dtype == torch.int32 and torch.equal(got, want)


def test_block_tables_of_a_full_batch_are_a_copy():
    """The blocks layout: a batch without padding rows gets its rows' tables gathered, a copy
    (writing it leaves the state's tables as they were); with padding rows, scratch rows after."""
    plan = runtime_of(kv_layout="blocks", kv_block_size=16).plan
    blocks = empty_blocks(plan)
    kv = [types.SimpleNamespace(k=None, v=None) for _ in range(MODEL.num_hidden_layers)]  # no shared block: nothing copied
    reserve(plan, kv, blocks, [0, 2], [0, 0], [20, 40])
    before = blocks.tables.clone()
    full = table_rows(plan, blocks, [2, 0], 2)
    assert torch.equal(full, before[[2, 0]])
    full.fill_(-1)
    assert torch.equal(blocks.tables, before)
    padded = table_rows(plan, blocks, [2], 3)
    assert torch.equal(padded[0], before[2]) and bool((padded[1:] == plan.kv.scratch_block).all())


def test_counts_add_repeated_tokens():
    """count_tokens adds every (slot, token) once per occurrence, a token repeated within a row
    (a speculate step's several tokens) included, into the state's own counts."""
    counts = torch.zeros(4, 10, dtype=torch.int32)
    state = types.SimpleNamespace(output_counts=counts)
    count_tokens(state, [2, 0, 3], [(5, 5, 7), (), (5,)])
    want = torch.zeros(4, 10, dtype=torch.int32)
    for s, row in ((2, (5, 5, 7)), (3, (5,))):
        for t in row:
            want[s, t] += 1
    assert state.output_counts is counts and torch.equal(counts, want)
    count_tokens(state, [], [])
    assert torch.equal(counts, want)
