"""Iteration-level scheduling without a model: budgets, caps, decode priority, preemption, static batches."""
from __future__ import annotations

from kvgate.engine.block_manager import BlockManager
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.scheduler import Scheduler
from kvgate.engine.sequence import Sequence, SequenceStatus

BS = 4


def make(num_blocks=64, max_num_seqs=8, budget=64, policy="continuous") -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_num_seqs, budget, policy)


def add(s: Scheduler, rid: str, prompt_len: int, max_tokens: int = 8) -> Sequence:
    seq = Sequence(rid, [hash(rid) % 50 + i for i in range(prompt_len)], SamplingParams(), max_tokens)
    s.add(seq)
    return seq


def run_step(s: Scheduler) -> dict[str, int]:
    """Schedule, pretend the model ran (a sampled token is 1), retire sequences at max_tokens."""
    batch = s.schedule()
    for seq, n in batch:
        seq.num_computed_tokens += n
        s.block_manager.commit(seq)
    for seq, n in batch:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(1)
            if seq.remaining_tokens == 0:
                s.finish(seq, "length")
    return {seq.request_id: n for seq, n in batch}


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget():
    s = make(budget=16)
    add(s, "long", 40)
    assert [run_step(s)["long"] for _ in range(3)] == [16, 16, 8]
    assert run_step(s) == {"long": 1}


def test_running_decodes_are_scheduled_before_new_prefills():
    s = make(budget=10)
    for i in range(3):
        add(s, f"d{i}", 3)
    run_step(s)
    add(s, "big", 30)
    step = run_step(s)
    assert all(step[f"d{i}"] == 1 for i in range(3)) and step["big"] == 7


def test_decode_keeps_a_token_every_step_while_a_long_prompt_is_chunked():
    s = make(budget=8)
    add(s, "chat", 2, max_tokens=20)
    run_step(s)
    add(s, "big", 60)
    steps = [run_step(s) for _ in range(6)]
    assert all(step["chat"] == 1 and step["big"] == 7 for step in steps)


def test_max_num_seqs_caps_the_running_set():
    s = make(max_num_seqs=2)
    for i in range(5):
        add(s, f"r{i}", 3)
    assert len(run_step(s)) == 2 and len(s.running) == 2 and len(s.waiting) == 3


def test_out_of_blocks_preempts_the_newest_sequence_and_recomputes_it_later():
    s = make(num_blocks=4, budget=64)
    old, new = add(s, "old", 4, max_tokens=8), add(s, "new", 4, max_tokens=8)
    run_step(s)
    while s.num_preemptions == 0:
        run_step(s)
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0 and not new.block_table
    assert old.status is SequenceStatus.RUNNING
    while s.has_unfinished():
        run_step(s)
    assert old.num_output_tokens == 8 and new.num_output_tokens == 8
    assert s.block_manager.num_free == 4


def test_static_policy_refills_only_after_the_whole_batch_finishes():
    s = make(max_num_seqs=2, policy="static")
    add(s, "short", 3, max_tokens=1)
    add(s, "long", 3, max_tokens=5)
    add(s, "next", 3, max_tokens=1)
    run_step(s)
    seen = []
    while s.has_unfinished():
        seen.append(set(run_step(s)))
    first_next = next(i for i, step in enumerate(seen) if "next" in step)
    assert all("long" not in step for step in seen[first_next:])
    assert any(step == {"long"} for step in seen)  # 'long' ran alone while 'next' waited


def test_continuous_policy_refills_a_freed_slot_at_once():
    s = make(max_num_seqs=2)
    add(s, "short", 3, max_tokens=1)
    add(s, "long", 3, max_tokens=5)
    add(s, "next", 3, max_tokens=1)
    run_step(s)
    assert set(run_step(s)) == {"long", "next"}


def test_finish_frees_blocks_of_waiting_and_running_sequences():
    s = make(max_num_seqs=1)
    a, b = add(s, "a", 5), add(s, "b", 5)
    run_step(s)
    s.finish(a, "abort")
    s.finish(b, "abort")
    assert not s.has_unfinished() and s.block_manager.num_free == s.block_manager.num_blocks
