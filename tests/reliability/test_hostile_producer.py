"""A producer without the shipped ACL can turn a client's reply key into a string (issue 14, item 3). Before the
fix the worker resent the failing batch forever: no other job answered, WRONGTYPE logged every few seconds, the
heartbeat gone. A per-job publish failure must fail that job (its error result stored, a dead letter with the
reason) and never stop the worker (invariant 8). Real `kvgate worker --simulated` process, real redis-server."""
from __future__ import annotations

import time

from tests.reliability.chaos_harness import Ledger, stop_all
from tests.support import RawQueue, spawn_worker, wait_for
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import decode_final

SIM = ("--simulated", "--sim-num-blocks", "2048", "--max-num-seqs", "8", "--sim-step-ms", "10",
       "--sim-per-token-ms", "0", "--reclaim-idle-ms", "2000")


def test_a_reply_key_of_the_wrong_type_fails_only_its_own_jobs(redis_server, namespace, tmp_path):
    r, keys = redis_server.client(), Keys(namespace)
    r.xgroup_create(keys.jobs(None, "normal"), Keys.GROUP, id="0", mkstream=True)
    hostile, good = RawQueue(redis_server, namespace), RawQueue(redis_server, namespace)
    r.set(keys.reply(hostile.client_id), "not a stream")
    worker = spawn_worker(redis_server.url, namespace, *SIM, worker_id="w", log=tmp_path / "w.log", env={"OMP_NUM_THREADS": "1"})
    try:
        wait_for(lambda: r.exists(keys.worker("w")), timeout=30, what="the worker's heartbeat")
        streamed = hostile.submit("stream into a string", max_tokens=30, ignore_eos=True, stream=True)
        unstreamed = hostile.submit("final into a string", max_tokens=5, ignore_eos=True)
        time.sleep(0.5)  # the hostile jobs go first
        others = [good.submit("an ordinary job", max_tokens=10, ignore_eos=True, stream=i % 2 == 0) for i in range(20)]
        ledger = Ledger(r, keys)
        answered = lambda: sum(1 for f in ledger.finals([good.client_id]) if f.job_id in others)
        started = time.monotonic()
        wait_for(lambda: answered() == 20, timeout=20, what=lambda: f"the other jobs: {answered()}/20 answered")
        print(f"20/20 other jobs answered within {time.monotonic() - started:.1f}s of the check")
        assert worker.poll() is None and r.exists(keys.worker("w")), "the worker stopped or lost its heartbeat"
        for job_id in (streamed, unstreamed):
            raw = wait_for(lambda: r.get(keys.result(job_id)), timeout=10, what=f"a stored result for {job_id}")
            result = decode_final(raw)
            if job_id == streamed:
                assert result.status == "error" and "WRONGTYPE" in (result.error or ""), result
        wait_for(lambda: ledger.pending() == 0, timeout=10, what="nothing pending")
        dead = {f[b"entry"]: f[b"reason"].decode() for f in ledger.dead()}
        assert len(dead) == 2 and all(keys.reply(hostile.client_id) in reason for reason in dead.values()), dead
        assert r.type(keys.reply(hostile.client_id)) == b"string"  # the producer's key is left as it was
    finally:
        stop_all([worker])
