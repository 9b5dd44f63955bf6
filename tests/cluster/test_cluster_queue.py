"""The queue on a Redis Cluster of 3 primaries and 3 replicas: the SDKs and `kvgate worker --simulated` processes,
unchanged but for the redis+cluster:// URL. Jobs spread over every primary, each gets one final event, streams
reconstruct their text, idempotency and cancellation hold, stats add up every shard, a SIGKILLed worker's jobs
are reclaimed in every shard, and a job a producer put in the wrong shard's stream is answered, not stuck."""
from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
import uuid

from kvgate.producer import AsyncClient, Client
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import FIELD, PROTOCOL_VERSION, Job, decode_final, encode
from kvgate.producer.redis_url import connect, keys_for
from kvgate.producer.steps import run
from tests.reliability.chaos_harness import stop_all
from kvgate.worker.fair import LOCAL_CHARGE
from tests.support import fair_enqueue, spawn_worker, wait_for

SIM = ("--simulated", "--sim-step-ms", "2", "--sim-per-token-ms", "0.01", "--max-num-seqs", "16")


def workers(cluster, ns: str, n: int, *args: str, tmp_path=None) -> list:
    procs = [spawn_worker(cluster.url, ns, *SIM, *args, worker_id=f"w{i}",
                          log=tmp_path / f"w{i}.log" if tmp_path else None) for i in range(n)]
    r = connect(cluster.url)
    keys = keys_for(cluster.url, r, ns)
    wait_for(lambda: r.zcard(keys.workers()) == n, 60, f"{n} worker heartbeats")
    return procs


def test_jobs_spread_over_every_primary_and_each_gets_one_final_event(cluster, namespace, tmp_path):
    procs = workers(cluster, namespace, 2, tmp_path=tmp_path)
    try:
        with Client(cluster.url, namespace) as client:
            assert len(client.keys.parts) == 6  # two shards per primary by default, recorded for the namespace
            handles = client.submit_many([dict(prompt=f"job {i}", max_tokens=8) for i in range(150)])
            streamed = [client.submit(f"streamed {i}", max_tokens=12, stream=True) for i in range(6)]
            results = [h.result(timeout=60) for h in handles + streamed]
            texts = ["".join(d.text for d in h.stream()) for h in streamed]
        assert [r.status for r in results] == ["done"] * 156
        assert texts == [r.text for r in results[150:]]
        keys = keys_for(cluster.url, connect(cluster.url), namespace)
        primaries = {cluster.node_of(keys.result(h.job_id)).port for h in handles}
        assert primaries == {n.port for n in cluster.primary_nodes()}
        assert {keys.shard_of(h.job_id) for h in handles} == set(range(6))
    finally:
        stop_all(procs)


def test_an_idempotency_key_meets_its_claim_from_another_client_and_its_job_stays_in_one_slot(cluster, namespace):
    procs = workers(cluster, namespace, 1)
    try:
        with Client(cluster.url, namespace) as a, Client(cluster.url, namespace) as b:
            first = a.submit("same", max_tokens=4, idempotency_key="order-17")
            again = b.submit("same", max_tokens=4, idempotency_key="order-17")
            assert again.job_id == first.job_id
            assert a.keys.shard_of(first.job_id) == a.keys.shard_of("order-17")
            assert again.result(timeout=30).status == "done" and first.result(timeout=30).status == "done"
    finally:
        stop_all(procs)


def test_the_async_sdk_cancels_and_reads_stats_over_every_shard(cluster, namespace):
    async def scenario():
        async with AsyncClient(cluster.url, namespace) as client:
            handles = await client.submit_many([dict(prompt=f"waiting {i}", max_tokens=4) for i in range(30)])
            stats = await client.stats()
            cancelled = handles[:5]
            for h in cancelled:
                await client.cancel(h.job_id)
            procs = await asyncio.to_thread(workers, cluster, namespace, 1)
            try:
                results = [await h.result(timeout=60) for h in handles]
            finally:
                stop_all(procs)
            return stats, results

    stats, results = asyncio.run(scenario())
    assert stats.backlog == 30 and stats.models["default"].backlog == 30
    assert [r.status for r in results] == ["cancelled"] * 5 + ["done"] * 25


def test_kvgate_stats_adds_up_the_shards(cluster, namespace):
    with Client(cluster.url, namespace) as client:
        client.submit_many([dict(prompt=f"x {i}", max_tokens=4, priority="high" if i % 2 else "low")
                            for i in range(12)])
    out = subprocess.run([sys.executable, "-m", "kvgate.commands.cli", "stats", "--redis-url", cluster.url, "--namespace",
                          namespace, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["backlog"] == 12, stats


def test_a_sigkilled_workers_jobs_are_reclaimed_in_every_shard(cluster, namespace, tmp_path):
    slow = ("--sim-step-ms", "20", "--reclaim-idle-ms", "1500", "--max-backoff-s", "0.3")
    procs = workers(cluster, namespace, 2, *slow, tmp_path=tmp_path)
    try:
        with Client(cluster.url, namespace) as client:
            handles = client.submit_many([dict(prompt=f"long {i}", max_tokens=60, ignore_eos=True)
                                          for i in range(60)])
            wait_for(lambda: sum(h.done() for h in handles) >= 5, 60, "the first results")
            procs[0].kill()
            procs[0].wait(10)
            results = [h.result(timeout=90) for h in handles]
        assert [r.status for r in results] == ["done"] * 60
        assert any(r.attempt > 1 for r in results)  # the victim held jobs: they ran again, each answered once
        assert {r.worker for r in results if r.attempt > 1} == {"w1"}
    finally:
        stop_all(procs)


def test_a_job_in_another_shards_stream_is_answered_in_that_shard_and_the_worker_serves_on(cluster, namespace):
    """A raw producer writes a job whose id hashes to shard 0 into shard 1's stream: the worker's finish must keep
    to the stream's slot (result, reply and ack together), not fail with CROSSSLOT for ever."""
    r = connect(cluster.url)
    keys = keys_for(cluster.url, r, namespace)
    procs = workers(cluster, namespace, 1)
    try:
        job_id = next(j for j in (uuid.uuid4().hex for _ in range(1000)) if keys.shard_of(j) == 0)
        job = Job(v=PROTOCOL_VERSION, job_id=job_id, client_id=uuid.uuid4().hex, enqueued_at=0.0, prompt="misplaced")
        r.xadd(keys.jobs(None, "normal", shard=1), {FIELD: encode(job)})
        wait_for(lambda: r.get(keys.at(1).result(job_id)), 30, "the result in shard 1")
        assert decode_final(r.get(keys.at(1).result(job_id))).status == "done"
        with Client(cluster.url, namespace) as client:
            assert client.submit("after", max_tokens=4).result(timeout=30).status == "done"
    finally:
        stop_all(procs)
        r.close()



def test_replicated_durability_works_on_a_cluster_with_results_on_the_replicas(cluster, namespace):
    procs = workers(cluster, namespace, 1, "--durability", "replicated")
    try:
        with Client(cluster.url, namespace, durability="replicated") as client:
            handles = client.submit_many([dict(prompt=f"safe {i}", max_tokens=4) for i in range(24)])
            results = [h.result(timeout=60) for h in handles]
        assert [r.status for r in results] == ["done"] * 24

        async def through_the_async_sdk():  # the gateway's client: its own links, on redis.asyncio
            async with AsyncClient(cluster.url, namespace, durability="replicated") as client:
                more = await client.submit_many([dict(prompt=f"async {i}", max_tokens=4) for i in range(12)])
                return [(await h.result(timeout=60)).status for h in more]

        assert asyncio.run(through_the_async_sdk()) == ["done"] * 12
        keys = keys_for(cluster.url, connect(cluster.url), namespace)
        for h in handles:  # the worker counts a final settled only once WAIT saw the replica take it
            key = keys.result(h.job_id)
            replica = cluster.replica_of(cluster.node_of(key)).client()
            wait_for(lambda: _on_replica(replica, key), 10, f"{key} on the replica")
    finally:
        stop_all(procs)


def _on_replica(replica, key: str) -> bool:
    replica.execute_command("READONLY")  # a cluster replica answers reads of its primary's slots once asked to
    return replica.exists(key) == 1


def test_the_exporter_sums_every_shard_into_one_series_per_model_and_priority(cluster, namespace):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvgate.commands import exporter

    with Client(cluster.url, namespace) as client:
        client.submit_many([dict(prompt=f"x {i}", max_tokens=4) for i in range(18)])
    r = connect(cluster.url)
    registry = exporter.build_registry(r, keys_for(cluster.url, r, namespace))
    samples = [s for fam in text_string_to_metric_families(generate_latest(registry).decode()) for s in fam.samples
               if s.name == "kvgate_queue_lag" and s.labels.get("priority") == "normal"]
    assert [s.value for s in samples] == [18]  # one series, not one per shard


def test_affinity_lanes_work_in_every_shard(cluster, namespace, tmp_path):
    """Lanes are a dimension of each shard's streams: a job goes to its lane in its shard, and the lane's owner (or a
    thief) reads it there."""
    procs = workers(cluster, namespace, 2, "--affinity", "on", "--affinity-lanes", "8", tmp_path=tmp_path)
    try:
        with Client(cluster.url, namespace) as client:
            wait_for(lambda: run(client._lanes()) == 8, 30, "the producer to see the lanes")
            # idempotency keys place the jobs: fixed keys that cover every shard (random job ids left one empty once)
            ikeys = [f"lanes-{i}" for i in range(48)]
            assert {client.keys.shard_of(k) for k in ikeys} == set(range(6))
            handles = [client.submit(f"job {i}", max_tokens=6, prefix_key=f"tenant-{i % 4}", idempotency_key=k)
                       for i, k in enumerate(ikeys)]
            assert [h.result(timeout=60).status for h in handles] == ["done"] * 48
            streams = [client.router.entry(h.job_id)[0] for h in handles]
        assert all(st.rsplit(":", 1)[1].isdigit() for st in streams), streams  # every job in a lane stream
        assert [client.keys.of_stream(st).shard for st in streams] == [client.keys.shard_of(k) for k in ikeys]
    finally:
        stop_all(procs)


def test_fair_share_serves_several_tenants_in_every_shard(cluster, namespace, tmp_path):
    """With fair share on, each tenant's stream sits under its band's hash tag (one slot per read script); jobs of
    several tenants in every shard are each answered once."""
    procs = workers(cluster, namespace, 2, "--fair-share", "on", tmp_path=tmp_path)
    try:
        r = connect(cluster.url)
        keys = keys_for(cluster.url, r, namespace)
        wait_for(lambda: r.exists(keys.fair()), 30, "the namespace's fair-share switch")
        handles = []
        for tenant in ("a", "b", "c"):
            with Client(cluster.url, namespace, tenant=tenant) as client:
                handles += client.submit_many([dict(prompt=f"{tenant} {i}", max_tokens=4) for i in range(40)])
                band = keys.at(0).jobs(None, "normal")
                # they went to the tenants' streams (looked at now: once drained, the pruning pass may delete one)
                assert r.exists(Keys.tenant_jobs(band, tenant))
                results = [h.result(timeout=60) for h in handles[-40:]]
                assert [res.status for res in results] == ["done"] * 40
        shards = {keys.shard_of(h.job_id) for h in handles}
        assert shards == set(range(len(keys.parts)))
    finally:
        stop_all(procs)


def test_the_sdks_deal_a_tenants_jobs_out_so_every_shard_holds_the_same_tokens_of_it(cluster, namespace):
    """Issue 27, fair share on a cluster: the shards are read in turn, so a tenant whose backlog ran dry in one
    shard first gets less than its share for the rest of it. Both SDKs deal a tenant's jobs out by their estimated
    tokens (producer/spread.py): its tenant stream in every shard holds the same to within one job. A job with an
    idempotency key stays in its key's shard."""
    from kvgate.producer.quotas import estimate_tokens

    r = connect(cluster.url)
    keys = keys_for(cluster.url, r, namespace)
    r.set(keys.fair(), 1)  # as `kvgate worker --fair-share on` sets it
    rng = random.Random(7)
    requests = [dict(prompt="x" * rng.randint(10, 2000), max_tokens=rng.randint(1, 400)) for _ in range(300)]
    with Client(cluster.url, namespace, tenant="a") as client:
        handles = client.submit_many(requests, progress=False)
        keyed = [client.submit(prompt=f"k{i}", idempotency_key=f"spread-{i}") for i in range(12)]

    async def submit_async():
        async with AsyncClient(cluster.url, namespace, tenant="b") as client:
            return [await client.submit(**req) for req in requests[:60]]

    async_handles = asyncio.run(submit_async())
    assert all(keys.shard_of(h.job_id) == keys.shard_of(f"spread-{i}") for i, h in enumerate(keyed))
    for tenant, handles_, reqs in (("a", handles, requests), ("b", async_handles, requests[:60])):
        tokens = [0] * len(keys.parts)
        for h, req in zip(handles_, reqs):
            tokens[keys.shard_of(h.job_id)] += estimate_tokens(client_job(req))
        largest = max(estimate_tokens(client_job(req)) for req in reqs)
        assert max(tokens) - min(tokens) <= largest, (tenant, tokens, largest)
        in_streams = handles_ + (keyed if tenant == "a" else [])  # they sit in the tenant's stream of their shard
        queued = [r.xlen(Keys.tenant_jobs(keys.at(k).jobs(None, "normal"), tenant)) for k in range(len(keys.parts))]
        assert queued == [sum(1 for h in in_streams if keys.shard_of(h.job_id) == k) for k in range(len(keys.parts))]


def client_job(req: dict) -> Job:
    """The job a request makes, for its token estimate."""
    from kvgate.producer.request import build_job, validate_request

    return build_job(validate_request(req), "c" * 16)


def test_each_tenants_backlog_is_summed_over_the_bands_of_every_shard(cluster, namespace):
    """The per-tenant view (issue 27) reads each shard's bands: a tenant's jobs spread over the shards add up."""
    from kvgate.producer.queue_stats import read_queue_stats

    r = connect(cluster.url)
    keys = keys_for(cluster.url, r, namespace)
    r.set(keys.fair(), 1)  # as `kvgate worker --fair-share on` sets it
    for tenant, n in (("a", 40), ("b", 10)):
        with Client(cluster.url, namespace, tenant=tenant) as client:
            handles = client.submit_many([dict(prompt=f"{tenant} {i}") for i in range(n)], progress=False)
            assert len({keys.shard_of(h.job_id) for h in handles}) > 1 or n < 10
    view = read_queue_stats(r, keys).tenant_view
    assert view.backlog_by_tenant and [(t.tenant, t.backlog) for t in view.top] == [("a", 40), ("b", 10)]


def _fair_put(r, band: str, tenant: str, n: int, max_tokens: int = 16) -> list[str]:
    """n jobs of `tenant` in its stream of `band`, through the SDK's fair enqueue script; their ids."""
    from kvgate.producer.protocol import Sampling

    return fair_enqueue(r, band, [Job(v=PROTOCOL_VERSION, job_id=uuid.uuid4().hex, client_id="c", enqueued_at=0.0,
                                      prompt=f"{tenant} {i}", tenant=tenant,
                                      sampling=Sampling(max_tokens=max_tokens, ignore_eos=True)) for i in range(n)])


def test_a_big_read_takes_an_even_part_of_it_from_every_shard(cluster, namespace):
    """Issue 27, W-FAIR on a cluster: an idle fleet's first fill reads hundreds of jobs at once, and a read took
    them from the first shard in its turn that had them, so a tenant alone for a moment was left with a backlog
    uneven over the shards, and in the end sat in a few of them. A read now asks every shard for an even part of
    what it wants, then once more those that gave all of theirs, so it still takes all it can."""
    from kvgate.worker.reader import Reader, ReadPlan

    r = connect(cluster.url)
    keys = keys_for(cluster.url, r, namespace)
    bands = [keys.jobs(None, "normal", shard=k) for k in (0, 1)]
    for band in bands:
        r.xgroup_create(band, Keys.GROUP, id="0", mkstream=True)
        for i in range(40):
            r.xadd(band, {"i": i})
    reader = Reader(r, "w1", ReadPlan(bands), keys=keys)
    taken = [e.stream for e in reader.read(40)]
    assert [taken.count(band) for band in bands] == [20, 20]
    taken = [e.stream for e in reader.read(30)]  # 20 left in each: the shard read first gives its 15, the other 15
    assert [taken.count(band) for band in bands] == [15, 15]
    taken = [e.stream for e in reader.read(30)]  # 5 left in each: all of both
    assert [taken.count(band) for band in bands] == [5, 5]
    r.xadd(bands[1], {"i": 40})
    assert [e.stream for e in reader.read(30)] == [bands[1]]  # one shard empty: the other's one
    for i in range(40):
        r.xadd(bands[0], {"i": i})
    r.xadd(bands[1], {"i": 41})
    taken = [e.stream for e in reader.read(30)]  # one shard short of its part: the other gives the rest
    assert [taken.count(band) for band in bands] == [29, 1]


def test_a_workers_one_shard_reads_take_the_shards_by_their_backlogs_so_they_run_dry_together(cluster, namespace):
    """Issue 27, W-FAIR on a cluster: a step's read looks at one shard, and the shards took equal turns, so a shard
    that held three times another's backlog still held two thirds of it when the other ran dry, and a tenant whose
    jobs were left there got that shard's turns only. The reply now says what the shard's fair bands still queue,
    and the next shard is picked by those (worker/reader.py ShardTurns)."""
    from kvgate.worker.reader import Reader, ReadPlan

    r = connect(cluster.url)
    keys = keys_for(cluster.url, r, namespace)
    r.set(keys.fair(), 1)
    bands = [keys.jobs(None, "normal", shard=k) for k in (0, 1)]
    for band, n in zip(bands, (60, 20)):
        r.xgroup_create(band, Keys.GROUP, id="0", mkstream=True)
        _fair_put(r, band, "a", n)
    reader = Reader(r, "w1", ReadPlan(bands), keys=keys)
    left = [60, 20]
    while min(left):
        pipe = r.pipeline(transaction=False)
        slot = reader.queue(pipe, 2, ReadPlan(bands, fair=set(bands), charge=10))
        slot.take(iter(pipe.execute()))
        for e in slot.entries:
            left[bands.index(e.stream.rsplit(":t:", 1)[0])] -= 1
    assert left[0] <= 8, left  # in equal turns: 40 of shard 0's 60 left when shard 1's 20 were gone


def test_a_tenant_keeps_its_share_of_the_fleet_when_its_backlog_runs_out_in_one_shard_first(cluster, namespace):
    """Issue 27, fair share on a cluster: each shard's band keeps its own counters, so when A's backlog ran out in
    the shard where it had had the fleet alone for a moment, that shard served only B while A's other shard served
    them in turn: B took 20 more jobs than A in 120 while both still waited. Workers now add what a tenant took in
    one shard to its counters in the others, so A's other shard serves A the more and the two stay within a few jobs
    of each other while both wait anywhere."""
    from kvgate.worker.fair import Fair
    from kvgate.worker.reader import Reader, ReadPlan

    r = connect(cluster.url)
    keys = keys_for(cluster.url, r, namespace)
    r.set(keys.fair(), 1)
    bands = [keys.jobs(None, "normal", shard=k) for k in (0, 1)]
    for band in bands:  # as a worker makes its shared streams' group at start
        r.xgroup_create(band, Keys.GROUP, id="0", mkstream=True)
    fair = Fair(r, keys, "keep", set(bands))
    reader = Reader(r, "w1", ReadPlan(bands), keys=keys)
    taken = {"a": 0, "b": 0}

    def read(shard: int) -> int:
        got = reader.read(2, ReadPlan([bands[shard]], fair={bands[shard]}, charge=fair.read_charge(10)))
        fair.read(got, 10)  # as the worker's refill does with every read, then its flush (every 0.2 s)
        fair.flush()
        for e in got:
            taken[e.stream.rsplit(":t:", 1)[1]] += 1
        return len(got)

    for shard in (0, 1):
        _fair_put(r, bands[shard], "a", 40)
    for _ in range(10):  # A alone for a moment: the fleet fills from the shard its bulk submit reached first
        assert read(0) == 2
    for shard in (0, 1):
        _fair_put(r, bands[shard], "b", 40)
    taken.update(a=0, b=0)  # from here both wait: A's 20 left in shard 0 and 40 in shard 1, B's 40 and 40
    worst = 0
    while taken["a"] < 60:
        assert read(0) + read(1) > 0
        worst = max(worst, abs(taken["a"] - taken["b"]))
    assert worst <= 6, (worst, taken)
    while read(0) + read(1):
        pass
    assert taken == {"a": 60, "b": 80}  # every job read once


def test_what_a_read_charged_goes_onto_the_other_shards_counters_once_and_corrections_onto_all(cluster, namespace):
    """The step's pipeline carries a read's charge to the tenant's counters in the other shards (the read script
    charged its own shard's, LOCAL_CHARGE more); the flush then adds only the corrections of jobs that ended, to
    every shard's."""
    from kvgate.worker.fair import Fair
    from kvgate.worker.reader import Reader, ReadPlan

    r = connect(cluster.url)
    keys = keys_for(cluster.url, r, namespace)
    bands = [keys.jobs(None, "normal", shard=k) for k in (0, 1)]
    for band in bands:
        r.xgroup_create(band, Keys.GROUP, id="0", mkstream=True)
        _fair_put(r, band, "a", 5)
    r.zadd(Keys.fair_backlog(bands[1]), {"a": 0})  # read there before: a real counter, not a newcomer's -inf
    # another tenant backlogged in shard 0, far above: a's jobs are read beside it, not alone (alone, a read's
    # charge stands uncorrected: Fair.read)
    r.zadd(Keys.fair_backlog(bands[0]), {"a": 0, "z": 1000})
    fair = Fair(r, keys, "keep", set(bands))
    plan = ReadPlan([bands[0]], fair={bands[0]}, charge=fair.read_charge(10))  # as the worker's refill plans it
    got = Reader(r, "w1", ReadPlan(bands), keys=keys).read(2, plan)
    assert len(got) == 2 and not any(e.alone for e in got)
    fair.read(got, 10)
    pipe = r.pipeline(transaction=False)
    assert fair.queue_spread(pipe) == 1 and not fair.charged_here
    pipe.execute()
    scores = lambda: [r.zscore(Keys.fair_backlog(band), "a") for band in bands]  # noqa: E731
    assert scores() == [20 * (1 + LOCAL_CHARGE), 20]
    fair.flush()
    assert scores() == [20 * (1 + LOCAL_CHARGE), 20]  # the charge went once
    fair.finished(got[0].stream, got[0].entry_id, "a", 15)  # it took 15 tokens, charged 10
    fair.flush()
    assert scores() == [20 * (1 + LOCAL_CHARGE) + 5, 25]


def test_each_shard_serves_every_tenant_backlogged_there_not_only_the_one_whose_counter_started_lowest(
        cluster, namespace):
    """Issue 27, W-FAIR's equal phase on a cluster: a tenant's counters rise alike in every shard (what it took
    anywhere goes onto all of them), so the few jobs' worth by which B's counter in shard 0 started above A's (where
    each joined that shard's backlog) held: shard 0 served only A, shard 1 mostly B, and B's backlog in shard 0
    waited to the end, when it sat in one shard and that shard's turns of the fleet's reads were less than its share
    (one tenant at 0.23 in the last window). A read now charges its own shard's counter LOCAL_CHARGE more than the
    others' (Fair.read_charge), so shard 0 turns to B once it has served A that much more: each shard drains both
    backlogs together."""
    from kvgate.worker.fair import Fair
    from kvgate.worker.reader import Reader, ReadPlan

    r = connect(cluster.url)
    keys = keys_for(cluster.url, r, namespace)
    r.set(keys.fair(), 1)
    bands = [keys.jobs(None, "normal", shard=k) for k in (0, 1)]
    for band in bands:
        r.xgroup_create(band, Keys.GROUP, id="0", mkstream=True)
        for tenant in "ab":
            _fair_put(r, band, tenant, 40)
    r.zadd(Keys.fair_backlog(bands[0]), {"a": 0, "b": 30})  # B joined shard 0 three jobs' charge above A
    r.zadd(Keys.fair_backlog(bands[1]), {"a": 0, "b": 0})
    fair = Fair(r, keys, "keep", set(bands))
    reader = Reader(r, "w1", ReadPlan(bands), keys=keys)
    left = {(shard, tenant): 40 for shard in (0, 1) for tenant in "ab"}
    while all(left.values()):  # until one tenant's backlog runs out in one shard
        for shard in (0, 1):
            got = reader.read(2, ReadPlan([bands[shard]], fair={bands[shard]}, charge=fair.read_charge(10)))
            fair.read(got, 10)  # as the worker's refill does with every read, then the step's pipeline
            pipe = r.pipeline(transaction=False)
            fair.queue_spread(pipe)
            pipe.execute()
            for e in got:
                left[shard, e.stream.rsplit(":t:", 1)[1]] -= 1
    # what is left of either backlog in either shard: no more than the 12 jobs (30 tokens / LOCAL_CHARGE 0.25, at
    # 10 a job) by which shard 0 served A first (before: B's 40 in shard 0 and A's 40 in shard 1, untouched)
    assert max(left.values()) <= 12, left


def test_a_job_of_one_shard_makes_room_on_a_worker_full_of_jobs_read_from_another(cluster, namespace, tmp_path):
    """Issue 27, latency beside a flood on a cluster: a worker's shares counted each shard's band apart, so a worker
    full of A's jobs from shard 0 ran nothing "in" shard 1's band, had no tenant over its share there, and neither
    looked for nor made room for B's job waiting in shard 1: it waited for one of A's jobs to end (a minute here).
    Shares now count a model's priority whatever shard its jobs came from."""
    procs = workers(cluster, namespace, 1, "--fair-share", "on", "--max-num-seqs", "4", "--sim-step-ms", "20",
                    "--sim-num-blocks", "4096", tmp_path=tmp_path)
    try:
        r = connect(cluster.url)
        keys = keys_for(cluster.url, r, namespace)
        wait_for(lambda: r.exists(keys.fair()), 30, "the namespace's fair-share switch")
        bands = [keys.jobs(None, "normal", shard=k) for k in (0, 1)]
        flood = _fair_put(r, bands[0], "a", 4, max_tokens=3000)  # 3,000 steps of 20 ms each: a minute
        a_stream = Keys.tenant_jobs(bands[0], "a")
        wait_for(lambda: r.xinfo_groups(a_stream) and r.xinfo_groups(a_stream)[0]["pending"] == 4, 30,
                 "the worker full of A's jobs")
        time.sleep(0.5)  # they run
        b = _fair_put(r, bands[1], "b", 1, max_tokens=4)
        wait_for(lambda: r.exists(keys.at(1).result(b[0])), 20, "B's job answered while A's still run")
        assert not any(r.exists(keys.at(0).result(job_id)) for job_id in flood)
    finally:
        stop_all(procs)
