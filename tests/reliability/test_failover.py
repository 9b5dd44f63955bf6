"""Following a Sentinel failover, and what the replicated durability guarantees across one.

Real processes: a primary, its replica and three sentinels (tests.support.SentinelGroup, tight timeouts), and
`kvgate worker --simulated` processes. The chaos runs SIGKILL a worker, then the primary mid-run while jobs are
still being submitted; the replica is promoted and everything follows it. The old primary is restarted
afterwards (as Kubernetes would restart its pod) and Sentinel makes it the new replica: the replicated mode
needs one to settle anything.

From the SDK's view each job ends one way: a result, JobLost, or a submit that raised. Replicated: every job has
exactly one result, equal to the one Redis keeps, lost 0, answered twice 0. Primary (Redis's default): the
accounting is exact (every job is in exactly one of those outcomes) and the run says what was lost or repeated.
Reproduce: `.venv/bin/pytest -s tests/reliability/test_failover.py`.
"""
from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvgate.commands import exporter
from kvgate.producer import AsyncClient, Client, JobLost, KvgateError, NotReplicatedError
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import Final, decode_final
from kvgate.producer.redis_url import connect, keys_for
from tests.reliability.chaos_harness import stop_all
from tests.support import SentinelGroup, spawn_worker, wait_for

SIM = ("--simulated", "--sim-step-ms", "5", "--sim-per-token-ms", "0", "--max-num-seqs", "8",
       "--reclaim-idle-ms", "1500", "--max-backoff-s", "0.3", "--heartbeat-ttl-s", "3")
SUBMIT_EVERY_S = 0.1
REPLICA_LAG_S = 0.5  # the replica hears nothing from its primary this long before the primary dies


def test_jobs_go_in_and_come_back_through_sentinel_with_their_results_on_the_replica(sentinel_group, namespace,
                                                                                    tmp_path):
    url = sentinel_group.url
    worker = spawn_worker(url, namespace, *SIM, "--durability", "replicated", log=tmp_path / "w.log")
    try:
        with Client(url, namespace, durability="replicated") as client:
            handles = [client.submit(f"hello {i}", max_tokens=5, temperature=0) for i in range(5)]
            results = [h.result(timeout=30) for h in handles]
            assert len(client.stats().workers) == 1  # stats read through Sentinel too
        assert [r.status for r in results] == ["done"] * 5
        replica = sentinel_group.replica.client()
        # the reply event is readable before the worker's WAIT returns, so the replica may trail the client briefly
        wait_for(lambda: all(replica.exists(Keys(namespace).result(h.job_id)) for h in handles), 10,
                 "the results on the replica")
    finally:
        stop_all([worker])


def test_the_async_sdk_the_exporter_and_kvgate_stats_follow_a_failover(sentinel_group, namespace, tmp_path):
    url, keys = sentinel_group.url, Keys(namespace)
    worker = spawn_worker(url, namespace, *SIM, log=tmp_path / "w.log")
    registry = exporter.build_registry(connect(url, socket_timeout=5, socket_connect_timeout=5), keys)
    up = lambda: registry.get_sample_value("kvgate_exporter_redis_up", {"kvgate_namespace": namespace})

    async def one_job(client: AsyncClient) -> str:
        return (await (await client.submit("hello", max_tokens=4)).result(timeout=30)).status

    async def scenario() -> list[str]:
        async with AsyncClient(url, namespace) as client:  # the gateway's client
            before = await one_job(client)
            await asyncio.to_thread(sentinel_group.kill_primary)
            await asyncio.to_thread(sentinel_group.wait_failover)
            return [before, await one_job(client)]

    try:
        assert up() == 1
        assert asyncio.run(scenario()) == ["done", "done"]
        wait_for(lambda: up() == 1, 10, "the exporter to read the new primary")
        stats = subprocess.run([sys.executable, "-m", "kvgate.commands.cli", "stats", "--redis-url", url, "--namespace",
                                namespace, "--json"], capture_output=True, text=True, timeout=60)
        assert stats.returncode == 0 and len(json.loads(stats.stdout)["workers"]) == 1, stats.stderr
    finally:
        stop_all([worker])


def test_a_replicated_submit_without_a_replica_fails_naming_wait_and_enqueues_the_job_once(redis_server, namespace):
    with Client(redis_server.url, namespace, durability="replicated", replica_timeout_ms=20,
                failover_budget_s=0.5) as client:
        with pytest.raises(NotReplicatedError, match="0 of 1 replicas acknowledged within 20 ms"):
            client.submit("hello", max_tokens=4)
    assert redis_server.client().xlen(Keys(namespace).jobs(None, "normal")) == 1  # sent several times, enqueued once


def test_a_replicated_worker_resends_an_unconfirmed_final_without_answering_twice(redis_server, namespace, tmp_path):
    """A lone primary: WAIT says 0 replicas, so the worker keeps the final in its outbox and sends it again (the
    finish script answers once); once a replica attaches, it settles and the resending stops."""
    log = tmp_path / "w.log"
    worker = spawn_worker(redis_server.url, namespace, *SIM, "--durability", "replicated", "--replica-timeout-ms",
                          "20", log=log)
    replica = None
    try:
        with Client(redis_server.url, namespace) as client:
            result = client.submit("hello", max_tokens=4, temperature=0).result(timeout=30)
            wait_for(lambda: log.read_text().count("0 of 1 replicas acknowledged") >= 3, 15, "three unconfirmed sends")
            reply = redis_server.client().xrange(Keys(namespace).reply(client.client_id))
            assert sum(1 for _, f in reply if b"p" in f and _is_final(f[b"p"])) <= 1  # the SDK trims what it read
            assert client.get(result.job_id).attempt == result.attempt
            replica = type(redis_server)(tmp_path / "replica", extra_args=("--replicaof", "127.0.0.1",
                                                                           str(redis_server.port))).start()
            wait_for(lambda: _quiet(log, "0 of 1 replicas acknowledged", 1.0), 20, "the resending to stop")
    finally:
        stop_all([worker])
        if replica is not None:
            replica.stop()


def _is_final(payload: bytes) -> bool:
    try:
        decode_final(payload)
        return True
    except Exception:
        return False


def _quiet(log: Path, line: str, for_s: float) -> bool:
    before = log.read_text().count(line)
    time.sleep(for_s)
    return log.read_text().count(line) == before


# ---- chaos: a worker and the primary SIGKILLed in one run -------------------------------------------------------
@dataclass
class FailoverRun:
    group: SentinelGroup  # or a ClusterGroup: anything with url, fail_over(lag_s) and data_client()
    ns: str
    logdir: Path
    durability: str
    jobs: int = 60
    workers: list = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    handles: dict = field(default_factory=dict)
    submit_errors: dict = field(default_factory=dict)
    seen: dict = field(default_factory=dict)  # job id -> every distinct (attempt, worker, text) the SDK's reader saw

    def spawn(self, worker_id: str):
        return spawn_worker(self.group.url, self.ns, *SIM, "--durability", self.durability, "--seed",
                            str(len(self.workers)), worker_id=worker_id, log=self.logdir / f"{worker_id}.log",
                            env={"OMP_NUM_THREADS": "1"})

    def watch(self, client: Client) -> None:
        """Record every final the SDK's reader routes, duplicates and superseded ones included."""
        route = client.router.route

        def recording(events):
            for e in events:
                if isinstance(e, Final):
                    self.seen.setdefault(e.job_id, set()).add((e.attempt, e.worker, e.text))
            route(events)

        client.router.route = recording

    def submit_all(self, client: Client) -> None:
        rng = random.Random(7)
        for i in range(self.jobs):
            try:  # temperature without a seed: a job generated twice writes a different text
                self.handles[i] = client.submit(f"job {i} " + "token " * rng.randint(3, 30),
                                                max_tokens=rng.randint(10, 40), temperature=0.8)
            except KvgateError as e:
                self.submit_errors[i] = e
            time.sleep(SUBMIT_EVERY_S)

    def run(self) -> dict:
        self.workers = [self.spawn("w0"), self.spawn("w1")]
        client = Client(self.group.url, self.ns, durability=self.durability, failover_budget_s=30)
        self.watch(client)
        producer = threading.Thread(target=self.submit_all, args=(client,), daemon=True)
        t0 = time.monotonic()
        try:
            producer.start()
            self.after(lambda: self.finished() >= 10, t0, self.kill_worker)
            # submits still arriving, so some meet the failover
            self.after(lambda: self.finished() >= 20 and len(self.handles) >= 30, t0, self.kill_primary)
            producer.join(120)
            outcome = self.account(client)
        finally:
            client.close()
            stop_all(self.workers)
        return outcome

    def finished(self) -> int:
        return sum(1 for h in list(self.handles.values()) if h.done())

    def after(self, moment, t0: float, fault) -> None:
        wait_for(moment, 60, lambda: f"the moment of a fault ({self.finished()} finished, {len(self.handles)} sent)")
        fault()
        self.events[-1] = f"{time.monotonic() - t0:5.1f}s {self.events[-1]}"

    def kill_worker(self) -> None:
        victim = self.workers[0]
        victim.kill()
        victim.wait(10)
        self.workers.append(self.spawn("w0"))  # the same consumer name: it re-reads its own pending entries first
        self.events.append("SIGKILL worker w0, restarted under the same name")

    def kill_primary(self) -> None:
        """The replica hears nothing for a moment first: what the primary acknowledges meanwhile never reaches the
        replica that is then promoted, the asynchronous replication's window made visible."""
        self.events.append(self.group.fail_over(REPLICA_LAG_S))

    def account(self, client: Client) -> dict:
        """Each job's one outcome from the SDK's view, then how Redis's own record compares once the fleet is quiet
        (nothing pending across two reclaim timeouts, so a job that lost its finish has run again by then)."""
        new_primary = self.group.data_client()
        keys = keys_for(self.group.url, new_primary, self.ns)
        outcome = {"durability": self.durability, "jobs": self.jobs, "events": self.events, "answered": 0,
                   "lost": [], "submit_failed": [f"{i}: {e}" for i, e in sorted(self.submit_errors.items())],
                   "lost_then_answered": [], "answered_twice": [], "ran_again": [], "answer_forgotten": []}
        results, lost = {}, {}
        for i, handle in sorted(self.handles.items()):
            try:
                results[i] = handle.result(timeout=60)
                outcome["answered"] += 1
            except JobLost as e:
                lost[i] = str(e)
        pending = lambda: sum(new_primary.xpending(s, Keys.GROUP)["pending"] for s in keys.all_jobs(None))
        wait_for(lambda: pending() == 0 and _quiet_for(pending, 3.2), 60, "the fleet to go quiet")
        for i, why in lost.items():  # a worker may still have been running a job Redis lost: its final comes late
            try:
                results[i] = self.handles[i].result(timeout=0)
                outcome["lost_then_answered"].append(i)
            except JobLost:
                outcome["lost"].append(f"{i}: {why}")
        outcome["pending"] = pending()
        for i, result in results.items():
            job_id = self.handles[i].job_id
            if len(self.seen.get(job_id, ())) > 1:  # the reader got two different finals; the handle kept the first
                outcome["answered_twice"].append(f"{i}: attempts {sorted(a for a, _, _ in self.seen[job_id])}")
            raw = new_primary.get(keys.result(job_id))
            if raw is None:  # Redis lost the job and its result after the SDK read it: answered, then forgotten
                outcome["answer_forgotten"].append(i)
            elif (decode_final(raw).attempt, decode_final(raw).text) != (result.attempt, result.text):
                kept = decode_final(raw)  # its finish was lost: it ran again and Redis keeps the second answer
                outcome["ran_again"].append(f"{i}: client got attempt {result.attempt} by {result.worker}, Redis "
                                            f"keeps attempt {kept.attempt} by {kept.worker}")
        return outcome


def _quiet_for(read, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if read():
            return False
        time.sleep(0.1)
    return True


def report(outcome: dict, tmp_path: Path) -> str:
    text = json.dumps(outcome, indent=1, default=str)
    (tmp_path / "failover.json").write_text(text)
    print(text)
    return text


def run_failover(namespace: str, tmp_path, durability: str, group=None) -> tuple[dict, str]:
    """One chaos run on a fresh Sentinel group (or the given one, e.g. a Redis Cluster): its outcome and the report
    printed for it."""
    group = group or SentinelGroup(tmp_path / "sentinel").start()
    try:
        outcome = FailoverRun(group, namespace, tmp_path, durability).run()
    finally:
        group.stop()
    return outcome, report(outcome, tmp_path)


@pytest.mark.chaos
def test_replicated_durability_rides_out_a_primary_and_a_worker_sigkill_with_one_result_per_job(namespace, tmp_path):
    outcome, text = run_failover(namespace, tmp_path, "replicated")
    assert outcome["answered"] == outcome["jobs"], text
    assert (outcome["lost"], outcome["lost_then_answered"], outcome["submit_failed"]) == ([], [], []), text
    assert outcome["answered_twice"] == [], text
    assert (outcome["ran_again"], outcome["answer_forgotten"], outcome["pending"]) == ([], [], 0), text


@pytest.mark.chaos
def test_default_durability_accounts_for_every_job_across_a_failover(namespace, tmp_path):
    """Redis's default replication is asynchronous: what the old primary had acknowledged but not yet sent
    may be gone. Whatever happened, each job is answered, reported lost or refused at submit: never missing."""
    outcome, text = run_failover(namespace, tmp_path, "primary")
    accounted = outcome["answered"] + len(outcome["lost_then_answered"]) + len(outcome["lost"]) + \
        len(outcome["submit_failed"])
    assert accounted == outcome["jobs"], text
    assert outcome["pending"] == 0, text
