"""W-FLEET's yardstick: the Redis commands of kvgate's queue path with no kvgate code around them.

A backlog of jobs is XADDed, then `procs` processes each XREADGROUP a batch and, per job, run one script that
stores a result (SET NX EX), XADDs a reply and XACKs: what a worker does per job, minus the worker. kvgate's
jobs/s divided by this loop's, in the same run on the same server, says what the worker's Python costs.
"""
from __future__ import annotations

import multiprocessing as mp
import time

import redis

FINISH = """
redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', 3600)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', 10000, '*', 'e', ARGV[1])
return redis.call('XACK', KEYS[3], 'workers', ARGV[2])
"""
BATCH = 64


def _consume(url: str, stream: str, consumer: str, result: bytes, done, total: int) -> None:
    r = redis.Redis.from_url(url)
    finish = r.register_script(FINISH)
    while done.value < total:
        entries = r.xreadgroup("workers", consumer, {stream: ">"}, count=BATCH, block=100)
        if not entries:
            continue
        batch = entries[0][1]
        pipe = r.pipeline(transaction=False)
        for entry_id, _fields in batch:
            job = entry_id.decode()
            finish(keys=[f"bare:result:{job}", f"bare:reply:{consumer}", stream], args=[result, job], client=pipe)
        pipe.execute()
        with done.get_lock():
            done.value += len(batch)


def run_bare_loop(server, payloads: list[bytes], result: bytes, procs: int) -> dict:
    """Enqueue `payloads`, drain them with `procs` processes; jobs/s and Redis CPU-seconds, as kvgate's run."""
    url, stream = server.url, f"bare:jobs:{time.time_ns()}"
    r = redis.Redis.from_url(url)
    redis_cpu0 = server.cpu_seconds()
    r.xgroup_create(stream, "workers", id="0", mkstream=True)
    for start in range(0, len(payloads), 1000):
        pipe = r.pipeline(transaction=False)
        for payload in payloads[start:start + 1000]:
            pipe.xadd(stream, {"j": payload})
        pipe.execute()
    ctx = mp.get_context("fork")
    done = ctx.Value("l", 0)
    workers = [ctx.Process(target=_consume, args=(url, stream, f"bare-{i}", result, done, len(payloads)), daemon=True)
               for i in range(procs)]
    started = time.perf_counter()
    for proc in workers:
        proc.start()
    for proc in workers:
        proc.join(300)
    span = time.perf_counter() - started
    redis_cpu = server.cpu_seconds() - redis_cpu0
    pending = r.xpending(stream, "workers")["pending"]
    r.close()
    return {"jobs": len(payloads), "processes": procs, "jobs_per_s": round(len(payloads) / span, 1),
            "redis_cpu_s": round(redis_cpu, 2), "jobs_per_redis_cpu_s": round(len(payloads) / max(redis_cpu, 1e-9), 1),
            "all_acked": pending == 0 and done.value >= len(payloads)}


def bare_loop_for(server, jobs, procs: int) -> dict:
    """The bare loop over the same encoded jobs kvgate drained, with a final event of a one-token job's size."""
    from kvgate.producer.protocol import PROTOCOL_VERSION, Final, Timings, Usage, encode

    now = time.time()
    result = encode(Final(v=PROTOCOL_VERSION, job_id="0" * 32, status="done", text=" t123", token_ids=[123],
                          finish_reason="length", usage=Usage(12, 1), worker="bare-0",
                          timings=Timings(now, now, now, now)))
    return run_bare_loop(server, [encode(job) for job in jobs], result, procs)
