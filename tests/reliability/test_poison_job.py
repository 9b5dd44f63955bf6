"""Issue 45.1: one small job must not stop the fleet (invariants 3 and 8).

A job whose schema text was nested 1,000 deep (2 KB, any producer the ACL allows) raised RecursionError out of the
intake: it killed the worker that decoded it, the worker died again on its pending entry after each restart, any
worker that reclaimed the entry died too, and the entry was never dead-lettered, because the delivery check came after
decoding. Here: real `kvgate worker` processes on a real redis-server, SIGKILL mid-run, hostile jobs among good ones.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import msgspec

from tests.reliability.chaos_harness import Ledger, stop_all
from tests.support import ROOT, RawQueue, spawn_worker, wait_for, worker_command
from kvgate.producer.keys import Keys

SIM = ("--simulated", "--sim-num-blocks", "2048", "--max-num-seqs", "8", "--sim-step-ms", "5",
       "--sim-per-token-ms", "0", "--reclaim-idle-ms", "1000")
NESTED_1000 = '{"a":' * 1000 + '{}' + '}' * 1000

# A worker that dies in the middle of decoding any entry holding POISON, as a process does on a crash nothing can
# catch (a segfault, the OOM killer): the delivery must already be counted when that happens.
DIES_DECODING = """
import os, sys
import kvgate.worker.intake as intake
decode = intake.decode_job
def dying(payload):
    if payload is not None and b"POISON" in bytes(payload):
        os._exit(70)
    return decode(payload)
intake.decode_job = dying
from kvgate.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""


def hostile_jobs(q: RawQueue) -> dict[str, bytes]:
    """job id -> a payload any producer could XADD: schema text or tool parameters nested 1,000 deep (each about 6 KB),
    and a payload that is itself a 200,000-deep msgpack nesting with nobody to answer."""
    user = [{"role": "user", "content": "hi"}]
    schema = msgspec.to_builtins(q.job("x", job_id="deep-schema", max_tokens=4))
    schema["sampling"]["structured"] = {"kind": "json_schema", "spec": NESTED_1000}
    tool = msgspec.to_builtins(q.job(None, job_id="deep-tool", messages=user, max_tokens=4))
    tool["tools"] = {"functions": [{"name": "f", "parameters": NESTED_1000}]}
    forced = msgspec.to_builtins(q.job(None, job_id="deep-forced", messages=user, max_tokens=4))
    forced["tools"] = {"functions": [{"name": "f", "parameters": NESTED_1000}], "choice": "required"}
    return {"deep-schema": msgspec.msgpack.encode(schema), "deep-tool": msgspec.msgpack.encode(tool),
            "deep-forced": msgspec.msgpack.encode(forced)}


def test_an_entry_that_kills_its_worker_while_decoding_is_dead_lettered_after_max_deliveries(redis_server, namespace,
                                                                                           tmp_path):
    r, keys = redis_server.client(), Keys(namespace)
    r.xgroup_create(keys.jobs(None, "normal"), Keys.GROUP, id="0", mkstream=True)
    q = RawQueue(redis_server, namespace)
    poison = q.submit("POISON", job_id="poison", max_tokens=3)
    cmd = [sys.executable, "-c", DIES_DECODING, *worker_command(redis_server.url, namespace, *SIM, "--max-deliveries",
                                                               "1", worker_id="w-poison")[3:]]
    ledger, deaths = Ledger(r, keys), 0
    with open(tmp_path / "w.log", "ab") as log:
        for _ in range(5):  # the same worker id restarted, as Kubernetes restarts a pod: it reads its pending first
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            wait_for(lambda: proc.poll() is not None or ledger.dead(), timeout=60, what="a death or a dead letter")
            if proc.poll() is None:
                break  # it lives and the entry is dead-lettered: it no longer reaches the decoder
            deaths += 1
            assert proc.returncode == 70, (proc.returncode, (tmp_path / "w.log").read_text()[-2000:])
    try:
        assert deaths == 1, f"the worker died {deaths} times on one entry (max_deliveries=1)"
        final = next(f for f in ledger.finals([q.client_id]) if f.job_id == poison)
        assert final.status == "error" and "over max_deliveries=1" in final.error, final
        assert "max_deliveries" in ledger.dead()[0][b"reason"].decode()
        good = q.submit("served after the poison", max_tokens=3)
        wait_for(lambda: good in ledger.final_counts([q.client_id]), timeout=20, what="the next job's answer")
        assert ledger.final_counts([q.client_id]) == {poison: 1, good: 1} and ledger.pending() == 0
    finally:
        stop_all([proc])


def test_a_fleet_under_sigkill_answers_every_job_once_while_hostile_jobs_are_refused(redis_server, namespace,
                                                                                   tmp_path):
    """Two workers, 120 good jobs with hostile ones among them (each worker reads some), one worker SIGKILLed
    mid-run and replaced: every good job done exactly once, every hostile job answered once with an error naming
    the nesting, both workers alive at the end, nothing pending."""
    r, keys = redis_server.client(), Keys(namespace)
    r.xgroup_create(keys.jobs(None, "normal"), Keys.GROUP, id="0", mkstream=True)
    q = RawQueue(redis_server, namespace)
    env = {"OMP_NUM_THREADS": "1"}
    workers = [spawn_worker(redis_server.url, namespace, *SIM, worker_id=f"w{i}", log=tmp_path / f"w{i}.log", env=env)
               for i in range(2)]
    try:
        wait_for(lambda: all(r.exists(keys.worker(f"w{i}")) for i in range(2)), timeout=30, what="both heartbeats")
        hostile = hostile_jobs(q)
        good, hostile_left = [], list(hostile.items())
        for i in range(120):
            good.append(q.submit(f"job {i}", max_tokens=12, ignore_eos=True))
            if i % 30 == 5 and hostile_left:
                q.xadd(hostile_left.pop()[1])
        ledger = Ledger(r, keys)
        answered = lambda: len(set(ledger.final_counts([q.client_id])) & set(good))
        wait_for(lambda: answered() >= 30, timeout=30, what=lambda: f"a quarter answered ({answered()})")
        workers[0].send_signal(signal.SIGKILL)
        workers[0].wait(10)
        workers[0] = spawn_worker(redis_server.url, namespace, *SIM, worker_id="w2", log=tmp_path / "w2.log", env=env)
        everyone = [*good, *hostile]
        wait_for(lambda: set(everyone) <= set(ledger.final_counts([q.client_id])), timeout=60,
                 what=lambda: f"every job answered ({answered()}/120 good)")
        wait_for(lambda: ledger.pending() == 0, timeout=20, what="nothing pending")
        time.sleep(0.5)  # a second answer to anything would land by now
        counts = ledger.final_counts([q.client_id])
        finals = {f.job_id: f for f in ledger.finals([q.client_id])}
        assert [j for j in everyone if counts[j] != 1] == []
        assert all(finals[j].status == "done" for j in good)
        for job_id in hostile:
            assert finals[job_id].status == "error" and "nested too deeply" in finals[job_id].error, finals[job_id]
        assert all(w.poll() is None for w in workers), "a worker stopped"
    finally:
        stop_all(workers)
