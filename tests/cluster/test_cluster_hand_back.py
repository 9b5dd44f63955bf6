"""Issue 45 on a Redis Cluster: a tenant's job a small worker read but cannot fit goes back to its shard's hand-back
index (worker/hand_back.py), and a big worker's next read takes it there, with no delivery counted."""
from __future__ import annotations

import uuid

from kvgate.producer.keys import Keys
from kvgate.producer.protocol import PROTOCOL_VERSION, Job, Sampling, decode_final
from kvgate.producer.redis_url import connect, keys_for
from tests.reliability.chaos_harness import stop_all
from tests.support import fair_enqueue, spawn_worker, wait_for

SIM = ("--simulated", "--fair-share", "on", "--sim-per-token-ms", "0")


def put(r, band: str, ids: list[int], max_tokens: int) -> str:
    job = Job(v=PROTOCOL_VERSION, job_id=uuid.uuid4().hex, client_id="c", enqueued_at=0.0, prompt_token_ids=ids,
              tenant="a", sampling=Sampling(max_tokens=max_tokens, ignore_eos=True))
    return fair_enqueue(r, band, [job])[0]


def test_a_job_the_small_worker_cannot_fit_is_taken_by_a_big_worker_from_another_shard(cluster, namespace, tmp_path):
    r = connect(cluster.url)
    keys = keys_for(cluster.url, r, namespace)
    bands = [keys.jobs(None, "normal", shard=k) for k in (0, 1)]
    # 128 tokens of KV cache, 1 s a step: the long job (98 tokens) runs 90 s unless cancelled (the big worker's
    # start takes seconds, tens of them on a loaded machine: 200 ms steps lost that race in a full CI run) and
    # leaves no room for the big one
    small = spawn_worker(cluster.url, namespace, *SIM, "--sim-num-blocks", "8", "--sim-step-ms", "1000",
                         "--max-num-seqs", "4", "--initial-tokens-per-job", "16", worker_id="small",
                         log=tmp_path / "small.log")
    procs = [small]
    try:
        wait_for(lambda: r.exists(keys.fair()), 30, "the namespace's fair-share switch")
        long_id = put(r, bands[0], [1] * 8, 90)
        long_stream, big_stream = Keys.tenant_jobs(bands[0], "a"), Keys.tenant_jobs(bands[1], "a")
        wait_for(lambda: r.exists(long_stream) and r.xinfo_groups(long_stream)
                 and r.xinfo_groups(long_stream)[0]["pending"] == 1, 30, "the small worker running the long job")
        big_id = put(r, bands[1], [2] * 100, 8)
        wait_for(lambda: r.zcard(keys.handed_back(1)) == 1, 30, "the big job handed back in its shard")
        procs.append(spawn_worker(cluster.url, namespace, *SIM, "--sim-step-ms", "2", worker_id="big",
                                  log=tmp_path / "big.log"))
        wait_for(lambda: r.exists(keys.at(1).result(big_id)), 60, "the big job's result")
        assert not r.exists(keys.at(0).result(long_id))  # the small worker still runs the long job
        final = decode_final(r.get(keys.at(1).result(big_id)))
        assert final.worker == "big" and final.attempt == 1
        assert r.xpending(big_stream, Keys.GROUP)["pending"] == 0 and r.zcard(keys.handed_back(1)) == 0
        # the long job's end is not this test's: the workers are killed with it still running
    finally:
        stop_all(procs)
