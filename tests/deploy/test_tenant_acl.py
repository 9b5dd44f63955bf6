"""Under fair share a job's tenant is what its producer says, so one SDK producer naming 50,000 tenants holds 50,000
shares of a band against each honest tenant's one. The shipped producer user may write any tenant's stream; a
producer user pinned to one tenant's streams (derived here from deploy/redis/acl.conf's producer line, as README's
fair-share section shows) serves that tenant and cannot enqueue as any other: Redis refuses the enqueue script
before it runs (a key it names is not the user's), so no other tenant's stream, backlog place or count is written."""
from __future__ import annotations

import shutil

import pytest
import redis

from kvgate import Client
from kvgate.producer.keys import Keys
from tests.support import ROOT, RedisServer, redis_major

REDIS = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(redis_major(REDIS) < 7, reason="ACL selectors need redis-server >= 7 on PATH")
SHIPPED_GRANT = "(%W~kvgate:jobs:* +xadd +xgroup|create)"


def pinned_producer(tenant: str) -> str:
    """The shipped producer user, its job-stream XADD narrowed to one tenant's streams (and the bands' bells, which
    its enqueue rings); the shared streams keep only the group creation a client makes at start."""
    line = next(x for x in (ROOT / "deploy/redis/acl.conf").read_text().splitlines() if x.startswith("user producer "))
    assert SHIPPED_GRANT in line
    pinned = (f"(%W~kvgate:jobs:*:t:{tenant} %W~kvgate:jobs:*:fair:bell +xadd) "
              "(%W~kvgate:jobs:*:high %W~kvgate:jobs:*:normal %W~kvgate:jobs:*:low +xgroup|create)")
    return (line.replace("user producer ", f"user producer-{tenant} ", 1)
            .replace(">CHANGE_ME_producer", f">CHANGE_ME_producer-{tenant}", 1).replace(SHIPPED_GRANT, pinned))


@pytest.fixture
def acl_port(tmp_path):
    (tmp_path / "acl.conf").write_text((ROOT / "deploy/redis/acl.conf").read_text() + pinned_producer("team-a") + "\n")
    server = RedisServer(tmp_path, binary=REDIS, extra_args=("--aclfile", str(tmp_path / "acl.conf"))).start()
    yield server.port
    server.stop()


def url(port: int, user: str) -> str:
    return f"redis://{user}:CHANGE_ME_{user}@127.0.0.1:{port}/0"


def test_a_producer_user_pinned_to_its_tenant_cannot_enqueue_as_any_other(acl_port):
    keys = Keys("kvgate")
    band = keys.jobs(None, "normal")
    monitor = redis.Redis.from_url(url(acl_port, "monitor"))
    redis.Redis.from_url(url(acl_port, "worker")).set(keys.fair(), 1)  # `kvgate worker --fair-share on`
    with Client(url(acl_port, "producer-team-a"), namespace="kvgate", tenant="team-a") as ours:
        ours.submit("hi", max_tokens=4)
        ours.submit("hi", max_tokens=4, idempotency_key="k1")  # the claim script's path too
    for tenant in ("team-b", "t0", "t49999"):  # one producer naming many tenants: each refused
        with Client(url(acl_port, "producer-team-a"), namespace="kvgate", tenant=tenant) as other:
            with pytest.raises(redis.ResponseError, match="can.t access at least one of the keys"):
                other.submit("hi", max_tokens=4)
    assert monitor.zrange(Keys.fair_backlog(band), 0, -1) == [b"team-a"]
    assert monitor.xlen(Keys.tenant_jobs(band, "team-a")) == 2
    assert monitor.get(Keys.fair_queued(band)) == b"2"
    with Client(url(acl_port, "producer"), namespace="kvgate", tenant="t1") as shipped:
        shipped.submit("hi", max_tokens=4)  # the shipped producer user names any tenant: trusted
    assert set(monitor.zrange(Keys.fair_backlog(band), 0, -1)) == {b"team-a", b"t1"}
