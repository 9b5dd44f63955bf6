"""The persistent decode inputs equal the ones rebuilt from Python lists, step after step, through new blocks,
preemptions (a freed table rewritten whole) and row reuse."""
from __future__ import annotations

import numpy as np
import torch

from kvgate.engine import LLMEngine, SamplingParams
from kvgate.engine.decode_inputs import DecodeBatch, DecodeInputs
from kvgate.engine.sequence import Sequence
from tests.engine.helpers import BLOCK_BYTES, random_prompts, tiny_source

TENSORS = [name for name in DecodeBatch.__slots__ if name != "bucket"]


def assert_same_inputs(runner, batch) -> None:
    d = runner._prepare_decode([seq for seq, _ in batch])
    ref_ids, ref_pos, ref_meta, ref_rows = runner._prepare_mixed(batch)
    assert d.bucket is None and ref_rows == list(range(len(batch)))
    assert torch.equal(d.input_ids, ref_ids) and torch.equal(d.positions, ref_pos)
    for name in ("slot_mapping", "cu_seqlens_q", "context_lens", "block_tables"):
        ours, ref = getattr(d.meta, name), getattr(ref_meta, name)
        assert ours.dtype == ref.dtype and torch.equal(ours, ref), name


def test_decode_inputs_equal_the_rebuilt_ones_through_new_blocks_and_preemptions():
    source, _ = tiny_source("llama", seed=3)
    # 12 blocks for 6 sequences that need up to 4 each: preemptions happen
    engine = LLMEngine(source, kv_cache_memory=12 * BLOCK_BYTES, max_num_seqs=6)
    runner, checked = engine.runner, []
    prepare = runner.prepare

    def checking(batch, graphed=False):
        if all(n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens for seq, n in batch):
            assert_same_inputs(runner, batch)
            checked.append(len(batch))
        return prepare(batch, graphed)

    runner.prepare = checking
    for i, prompt in enumerate(random_prompts(10, 5, 20, seed=3)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    assert len(checked) > 20 and max(checked) == 6


def test_a_new_block_is_appended_to_the_row_without_rewriting_it():
    inputs = DecodeInputs(max_num_seqs=2, max_blocks_per_seq=4, block_size=4, device=torch.device("cpu"))
    seq = Sequence("a", [1, 2, 3, 4], SamplingParams(), 8)
    seq.block_table, seq.num_computed_tokens = [7], 3
    assert inputs.build([seq]).block_tables.tolist() == [[7]]
    row = inputs.row_of[seq.seq_id]
    inputs.tables[row, 0] = 99  # were the row rewritten, this would be undone
    seq.token_ids.append(5)
    seq.block_table.append(2)
    seq.num_computed_tokens = 4
    d = inputs.build([seq])
    assert d.block_tables.tolist() == [[99, 2]] and d.slot_mapping.tolist() == [2 * 4 + 0]


def test_rows_of_sequences_gone_from_the_batch_are_reused():
    inputs = DecodeInputs(max_num_seqs=1, max_blocks_per_seq=2, block_size=4, device=torch.device("cpu"))
    for i in range(5):  # 2 rows, 5 sequences one after another
        seq = Sequence(str(i), [1, 2], SamplingParams(), 4)
        seq.block_table, seq.num_computed_tokens = [i], 1
        assert inputs.build([seq]).block_tables.tolist() == [[i]]
    assert len(inputs.row_of) <= 2


def test_a_device_gets_the_inputs_in_one_copy_each_field_in_its_dtype_without_a_cast(monkeypatch):
    """The device path (forced on the CPU): one host-to-device copy of one packed byte array; the int32 fields are
    views of it, not cast kernels, and every field equals the CPU path's."""
    def built(one_copy: bool):
        inputs = DecodeInputs(max_num_seqs=4, max_blocks_per_seq=4, block_size=4, device=torch.device("cpu"))
        inputs.one_copy = one_copy
        copies = []
        to_device = inputs._to_device
        monkeypatch.setattr(inputs, "_to_device", lambda packed: copies.append(packed.dtype) or to_device(packed))
        seqs = [Sequence(str(i), list(range(3 + 5 * i)), SamplingParams(), 8) for i in range(3)]
        for seq in seqs:
            seq.block_table = [9 - j for j in range(-(-seq.num_tokens // 4))]
            seq.num_computed_tokens = seq.num_tokens - 1
        return inputs.build(seqs), copies

    (plain, no_copies), (packed, copies) = built(False), built(True)
    assert no_copies == [] and copies == [np.uint8]
    copied = packed.input_ids.untyped_storage().data_ptr()
    for name in TENSORS:
        ours, ref = getattr(packed, name), getattr(plain, name)
        assert ours.dtype == ref.dtype and torch.equal(ours, ref), name
        assert ours.untyped_storage().data_ptr() == copied, name  # a view of the one copy: no cast made it
