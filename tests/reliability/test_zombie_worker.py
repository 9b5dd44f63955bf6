"""A worker frozen (SIGSTOP) past the reclaim timeout loses its jobs to another worker; once resumed it must stop
them, not keep generating and streaming deltas for jobs already finished elsewhere (issue 14, item 10). Before
the fix the resumed zombie streamed 285 deltas after the other worker's final events."""
from __future__ import annotations

import signal
import time

import redis

from tests.reliability.chaos_harness import stop_all
from tests.support import RawQueue, spawn_worker, wait_for
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import FIELD, Delta, Final, decode_event

RECLAIM_MS = 1000
ENV = {"OMP_NUM_THREADS": "1"}


def sim(step_ms: float) -> tuple[str, ...]:
    return ("--simulated", "--sim-num-blocks", "2048", "--max-num-seqs", "4", "--sim-step-ms", str(step_ms),
            "--sim-per-token-ms", "0", "--reclaim-idle-ms", str(RECLAIM_MS))


def events(r: redis.Redis, keys: Keys, client_id: str) -> list[Delta | Final]:
    return [decode_event(f[FIELD.encode()]) for _, f in r.xrange(keys.reply(client_id))]


def deltas_after_final(evs: list[Delta | Final]) -> int:
    finished, late = set(), 0
    for e in evs:
        if isinstance(e, Final):
            finished.add(e.job_id)
        elif e.job_id in finished:
            late += 1
    return late


def test_a_resumed_worker_stops_the_jobs_it_lost_and_streams_nothing_more_for_them(redis_server, namespace, tmp_path):
    r, keys = redis_server.client(), Keys(namespace)
    stream = keys.jobs(None, "normal")
    r.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
    queue = RawQueue(redis_server, namespace)
    zombie = spawn_worker(redis_server.url, namespace, *sim(40), worker_id="zombie", log=tmp_path / "zombie.log", env=ENV)
    rescuer = None
    try:
        jobs = [queue.submit("a long stream", max_tokens=200, ignore_eos=True, stream=True) for _ in range(2)]
        wait_for(lambda: len({e.job_id for e in events(r, keys, queue.client_id)}) == 2, timeout=30,
                 what="the zombie to stream both jobs")
        zombie.send_signal(signal.SIGSTOP)
        rescuer = spawn_worker(redis_server.url, namespace, *sim(2), worker_id="rescuer", log=tmp_path / "rescuer.log", env=ENV)
        finals = lambda: [e for e in events(r, keys, queue.client_id) if isinstance(e, Final)]
        wait_for(lambda: len(finals()) == 2, timeout=30, what="the rescuer to finish both jobs")
        assert {f.worker for f in finals()} == {"rescuer"} and {f.job_id for f in finals()} == set(jobs)
        zombie.send_signal(signal.SIGCONT)
        # its next lease renewal finds the jobs gone and stops them; had it streamed on, a second more (25 of its 40 ms
        # steps, of about 150 it had left) would show it
        wait_for(lambda: "taken over by another worker" in (tmp_path / "zombie.log").read_text(), timeout=30,
                 what="the resumed worker to find its jobs taken over")
        time.sleep(1.0)
        late = deltas_after_final(events(r, keys, queue.client_id))
        print(f"deltas streamed after the rescuer's final events: {late}")
        assert late <= 2, f"the resumed worker streamed {late} deltas for jobs already finished elsewhere"
        assert zombie.poll() is None and r.exists(keys.worker("zombie")), "the resumed worker should keep serving"
        assert len(finals()) == 2
        assert r.xpending(stream, Keys.GROUP)["pending"] == 0
        # and it serves again: a new job is answered (by whichever worker reads it)
        extra = queue.submit("after the stall", max_tokens=5)
        wait_for(lambda: any(f.job_id == extra for f in finals()), timeout=15, what="a new job to be answered")
    finally:
        for proc in (zombie, rescuer):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        stop_all([p for p in (zombie, rescuer) if p is not None])
