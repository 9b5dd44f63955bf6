"""Reading by held prefixes: a worker remembers what each lane's jobs share, and when its room no longer fits a
whole job it still reads jobs of lanes whose prefix its running sequences hold, sized by their tails."""
from __future__ import annotations

from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer.keys import DEFAULT_MODEL
from kvgate.producer.protocol import FIELD, encode
from kvgate.worker.lane_prefixes import LanePrefixes, common_blocks

BS = 16
PREFIX = list(range(1, 257))  # 16 blocks
LANE = (DEFAULT_MODEL, 3)


def prompt(tag: int, suffix: int = 32) -> list[int]:
    return PREFIX + [1000 + tag] * suffix


def holding(ids: list[int]):
    """A shared_prefix_tokens stand-in for an engine that holds the leading blocks of `ids`."""
    return lambda tokens, hashes: common_blocks(ids, tokens, BS) * BS


def test_a_lane_shares_what_its_jobs_have_in_common_once_two_were_seen():
    lanes = LanePrefixes(BS)
    lanes.observe(LANE, prompt(1), 320)
    assert lanes.held(holding(prompt(1))) == {}  # one job: its own prompt is all held while it runs
    lanes.observe(LANE, prompt(2), 320)
    assert lanes.kept[LANE].ids == PREFIX
    assert lanes.held(holding(PREFIX)) == {LANE: 64}  # its tail: 32 prompt tokens past the prefix and 32 output
    assert lanes.held(holding(PREFIX[:128])) == {LANE: 64 + 128}  # the prefix's part not held is claimed too
    assert lanes.held(holding([])) == {}  # nothing of it held: nothing to read by tails


def test_a_lane_whose_jobs_share_too_little_is_not_read_by_tails():
    lanes = LanePrefixes(BS)
    lanes.observe(LANE, prompt(1), 320)
    lanes.observe(LANE, [7] * 288, 320)  # another prefix hashed to the same lane
    assert lanes.kept[LANE].ids == []
    assert lanes.held(holding(prompt(1))) == {} and lanes.cheapest() is None


def test_only_the_lanes_read_most_recently_are_kept():
    lanes = LanePrefixes(BS)
    for lane in range(6):
        lanes.observe((DEFAULT_MODEL, lane), prompt(lane), 320)
    assert list(lanes.kept) == [(DEFAULT_MODEL, lane) for lane in range(2, 6)]


def lane_worker(queue, num_blocks: int):
    from tests.worker.conftest import ThreadWorker

    engine = SimulatedEngine(num_blocks=num_blocks, block_size=BS, max_num_seqs=8, step_overhead_s=0.0,
                             per_token_s=0.0, sleep=False)
    worker = ThreadWorker(queue, engine, worker_id="w", affinity="on", affinity_lanes=8).worker
    worker._redis(worker._ensure_groups)  # the only member: it owns every lane
    assert worker.affinity.own[DEFAULT_MODEL] == list(range(8))
    # nothing of its own pending: busy refills read new entries
    worker.refill.cursors = dict.fromkeys(worker.refill.cursors)
    return engine, worker


def refill_of(worker):
    """What the busy worker's next round trip would read."""
    from kvgate.worker.refill import Capacity

    return worker.refill.request(Capacity(worker.engine), draining=False)


def run_one(engine, worker, tag: int) -> None:
    """A job of the lane running in the engine (its prefix held), as read from the lane's stream."""
    ids = prompt(tag)
    engine.add_request(f"r{tag}", ids, SamplingParams(max_tokens=32, ignore_eos=True))
    engine.step()
    worker.lane_prefixes.observe(LANE, ids, len(ids) + 32)


def test_a_worker_without_room_for_a_whole_job_reads_the_held_lane_by_its_tails(queue):
    engine, worker = lane_worker(queue, num_blocks=38)
    run_one(engine, worker, 1)
    worker.lane_prefixes.observe(LANE, prompt(2), 320)
    worker.queue.tokens_per_job = 320.0
    adm = engine.admission()
    assert 2 * 64 <= adm.admissible_tokens < 320  # no whole job fits, a few tails do
    request = refill_of(worker)
    assert request.count == 0 and request.lanes == [LANE] and request.held == adm.admissible_tokens // 64

    worker.lane_prefixes.kept[LANE].jobs = 1  # what the lane shares is not known yet
    assert not refill_of(worker)


def test_no_read_by_tails_while_a_job_waits_in_the_local_queue(queue):
    from kvgate.worker.admission import Ticket

    engine, worker = lane_worker(queue, num_blocks=38)
    run_one(engine, worker, 1)
    worker.lane_prefixes.observe(LANE, prompt(2), 320)
    worker.queue.tokens_per_job = 320.0
    worker.queue.tickets.append(Ticket(None, "s", "0-1", prompt(3), SamplingParams(max_tokens=32), b""))
    request = refill_of(worker)
    assert (request.lanes, request.held) == ([], 0)


def test_jobs_of_the_held_lane_are_read_and_started_beside_the_running_one(queue):
    engine, worker = lane_worker(queue, num_blocks=38)
    run_one(engine, worker, 1)
    worker.lane_prefixes.observe(LANE, prompt(2), 320)
    worker.queue.tokens_per_job = 320.0
    stream = worker.affinity.names[DEFAULT_MODEL, "normal"][LANE[1]][0]
    for tag in range(2, 8):
        queue.r.xadd(stream, {FIELD: encode(queue.job(prompt_token_ids=prompt(tag), max_tokens=32,
                                                      ignore_eos=True))})
    worker._exchange()
    worker._settle_exchange()
    tails = engine.admission().admissible_tokens // 64
    worker._admit_local()
    started = engine.stats.running + engine.stats.waiting
    assert tails >= 2 and started == 1 + tails  # every job read fits beside the running one: none waits here
    assert len(worker.queue) == 0


def test_a_read_of_held_lanes_takes_its_own_lanes_first_then_full_owners_then_the_others(queue):
    engine, worker = lane_worker(queue, num_blocks=38)
    a = worker.affinity
    a.own = {DEFAULT_MODEL: [0]}
    a.ring_seen[DEFAULT_MODEL] = (None, ["w", "x", "y", "x", "y", "x", "y", "x"])
    a.full = {"x"}
    plan = a.held_plan([(DEFAULT_MODEL, 2), (DEFAULT_MODEL, 1), (DEFAULT_MODEL, 0)])
    streams, home, urgent = plan.streams, plan.home, plan.urgent
    lanes = [int(st.rsplit(":", 1)[1]) for st in streams]
    assert lanes == [0, 0, 0, 1, 1, 1, 2, 2, 2] and (home, urgent) == (3, 3)  # three priorities each
    assert [st.split(":")[-2] for st in streams[:3]] == ["high", "normal", "low"]
