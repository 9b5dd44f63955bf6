"""The sharded key layout, without a server: every key of a job in one slot, shards spread over the slot range, and
one Redis keeping the names it always had."""
from __future__ import annotations

import pytest
from redis.crc import key_slot

from kvgate.producer.cluster import is_moved, parse_cluster_url
from kvgate.producer.keys import Keys
from kvgate.producer.urls import check_url
from kvgate.producer.shards import shard_of, shard_tags


def slot(name: str) -> int:
    return key_slot(name.encode())


def test_one_redis_keeps_its_key_names():
    keys = Keys("kv")
    assert keys.jobs("m", "high") == "kv:jobs:m:high"
    assert keys.result("j") == "kv:result:j" and keys.reply("c") == "kv:reply:c" and keys.dead() == "kv:dead"
    assert keys.all_jobs("m") == ["kv:jobs:m:high", "kv:jobs:m:normal", "kv:jobs:m:low"]
    assert keys.of_stream("kv:jobs:m:high") is keys and keys.by_shard(["a", "b"]) == [["a", "b"]]


def test_a_jobs_keys_share_one_slot_in_the_shard_of_its_id():
    keys = Keys("kv", 6, cluster=True)
    for job_id in (f"job-{i}" for i in range(200)):
        shard = keys.at(keys.shard_of(job_id))
        names = [shard.jobs("m", "normal"), shard.jobs("m", "high", lane=3), shard.reply("client"),
                 keys.result(job_id), keys.cancel(job_id), shard.dead()]
        assert len({slot(n) for n in names}) == 1, names
        assert keys.of_stream(names[0]) is shard


def test_shards_spread_evenly_over_contiguous_primary_ranges():
    for shards, primaries in ((3, 3), (6, 3), (12, 4), (64, 8)):
        width = 16384 / primaries
        owners = [int(slot("{" + tag + "}x") // width) for tag in shard_tags(shards)]
        assert sorted(owners.count(p) for p in range(primaries)) == [shards // primaries] * primaries


def test_jobs_spread_over_every_shard():
    counts = [0] * 6
    for i in range(6000):
        counts[shard_of(f"{i:032x}", 6)] += 1
    assert min(counts) > 800, counts


def test_fleet_keys_live_in_shard_zero_and_streams_cover_every_shard():
    keys = Keys("kv", 4, cluster=True)
    assert {slot(keys.models()), slot(keys.lanes()), slot(keys.worker("w")), slot(keys.lane_ring("m"))} == \
        {slot(keys.at(0).jobs("m", "high"))}
    served = keys.served_jobs(["a", "b"])
    assert len(served) == 3 * 4 * 2 and len({keys.of_stream(s).shard for s in served}) == 4
    assert served[:8] == [keys.jobs(m, "high", shard=k) for k in range(4) for m in "ab"]  # high first, shard by shard
    groups = keys.by_shard(served)
    assert len(groups) == 4 and all(len({slot(s) for s in g}) == 1 for g in groups)


def test_a_stream_from_no_shard_is_named_in_the_error():
    keys = Keys("kv", 3, cluster=True)
    with pytest.raises(ValueError, match=r"'kv:\{99\}:jobs:x' is in no shard of namespace 'kv'"):
        keys.of_stream("kv:{99}:jobs:x")


def test_shards_need_a_cluster():
    with pytest.raises(ValueError, match="only on a Redis Cluster"):
        Keys("kv", 4)


@pytest.mark.parametrize("url, message", [
    ("redis+cluster:///", "names no node"),
    ("redis+cluster://h:1/0", "only db 0"),
    ("redis+cluster://h:1/?shards=x", "must be a whole number"),
    ("redis+cluster://h:1/?shards=0", "from 1 to 1024"),
    ("redis+cluster://h:1/?db=2", "unknown option 'db'"),
    ("redis+cluster://h:port/", "is not host:port"),
])
def test_bad_cluster_urls_are_named(url, message):
    with pytest.raises(ValueError, match=message):
        parse_cluster_url(url)


def test_cluster_urls_parse():
    c = parse_cluster_url("rediss+cluster://u:p%40ss@a:7000,b/?shards=12")
    assert c.nodes == (("a", 7000), ("b", 6379)) and c.username == "u" and c.password == "p@ss"
    assert c.ssl and c.shards == 12
    assert check_url("redis+cluster://a:7000/") == "redis+cluster://a:7000/"


def test_a_redirection_counts_as_moved_also_as_redis_py_rewrites_it_inside_a_multi():
    """Before: a MULTI sent on a node link after a failover raised MovedError('Command # 1 (EVALSHA ...) of pipeline
    caused error: 1598 127.0.0.1:32793'), which the text check missed, so the submit failed instead of retrying on
    the new primary (the cluster failover chaos run lost its producer thread in 3 runs of 4)."""
    import redis

    annotated = redis.exceptions.MovedError("1598 127.0.0.1:32793")
    annotated.args = ("Command # 1 (EVALSHA 82c0 2 ...) of pipeline caused error: 1598 127.0.0.1:32793",)
    for error in (annotated, redis.exceptions.AskError("1598 127.0.0.1:1"), redis.exceptions.TryAgainError("x"),
                  redis.exceptions.ClusterDownError("The cluster is down"), redis.exceptions.ReadOnlyError("r"),
                  redis.exceptions.ExecAbortError("Transaction discarded"),
                  redis.ResponseError("MOVED 1598 127.0.0.1:32793"),
                  redis.ResponseError("WAIT cannot be used with replica instances")):
        assert is_moved(error), error
    assert not is_moved(redis.ResponseError("WRONGTYPE Operation against a key"))
    assert not is_moved(redis.ConnectionError("MOVED in name only"))
