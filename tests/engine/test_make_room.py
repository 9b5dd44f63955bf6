"""Engine.make_room: a request that waited while others hold more than their share of a full engine starts now,
chosen running requests stepping aside (preempted by recompute) and resuming first once room frees; not counted as
preemptions, so the admission reserve does not grow (worker/fair.py says when the worker asks)."""
from __future__ import annotations

from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.simulated import SimulatedEngine


def engine(num_blocks: int = 1024, max_num_seqs: int = 2) -> SimulatedEngine:
    return SimulatedEngine(num_blocks, 16, max_num_seqs, 0.0, 0.0, sleep=False)


def add(e: SimulatedEngine, rid: str, prompt_len: int, max_tokens: int, ahead: bool = False) -> None:
    e.add_request(rid, [7 + (hash(rid) + i) % 900 for i in range(prompt_len)],
                  SamplingParams(max_tokens=max_tokens, ignore_eos=True), detokenize=False, ahead=ahead)


def running(e: SimulatedEngine) -> list[str]:
    return [seq.request_id for seq in e.scheduler.running]


def run_out(e: SimulatedEngine) -> dict[str, int]:
    lengths = {}
    while e.has_unfinished():
        for out in e.step():
            if out.finished:
                lengths[out.request_id] = len(out.token_ids)
    return lengths


def test_a_full_engine_makes_room_from_the_victims_given_and_the_request_runs_first():
    e = engine()
    add(e, "old", 32, 40)
    add(e, "young", 32, 40)
    e.step()
    assert not e.fits(16, 4)  # every seat taken
    assert e.make_room(16, 4, 0, ["young", "old"]) == ["young"]
    add(e, "new", 16, 4, ahead=True)
    e.step()
    assert running(e) == ["old", "new"]  # the newcomer before the one that stepped aside
    assert [seq.request_id for seq in e.scheduler.waiting] == ["young"]
    assert e.stats.stepped_aside == 1 and e.stats.preemptions == 0  # not a shortage: the reserve stays
    assert run_out(e) == {"new": 4, "old": 40, "young": 40}  # recomputed, then finished whole


def three_of_48(num_blocks: int = 12) -> SimulatedEngine:
    e = engine(num_blocks=num_blocks, max_num_seqs=8)  # 12 blocks: 192 tokens of cache
    for rid in ("a", "b", "c"):
        add(e, rid, 48, 8)  # 3 blocks each, then growth
    e.step()
    return e


def test_blocks_are_freed_youngest_victim_first_until_the_request_fits():
    e = three_of_48()
    assert not e.fits(64, 8)
    assert e.make_room(64, 8, 0, ["c", "b", "a"]) == ["c"]  # 6 free blocks cover 64 tokens and the growth
    e = three_of_48()
    assert e.make_room(120, 8, 0, ["c", "b", "a"]) == ["c", "b"]
    assert running(e) == ["a"]


def test_nothing_steps_aside_when_the_victims_cannot_make_room():
    e = three_of_48()
    assert e.make_room(120, 8, 0, ["c"]) is None  # one victim's 3 blocks are not enough
    assert e.make_room(120, 8, 0, []) is None
    assert e.make_room(4000, 8, 0, ["a", "b", "c"]) is None  # could never fit the cache
    assert sorted(running(e)) == ["a", "b", "c"] and e.stats.stepped_aside == 0


def test_the_request_that_stepped_aside_least_often_goes_first():
    e = engine()
    add(e, "x", 16, 60)
    add(e, "y", 16, 60)
    e.step()
    assert e.make_room(8, 2, 0, ["y", "x"]) == ["y"]
    add(e, "n1", 8, 2, ahead=True)
    while "y" not in running(e):  # n1 ends, y resumes
        e.step()
    assert e.make_room(8, 2, 0, ["y", "x"]) == ["x"]  # y stepped aside once already
