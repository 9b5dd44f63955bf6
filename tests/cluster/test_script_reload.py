"""After a failover a promoted primary has no scripts: NOSCRIPT. `scripts_lost()` must make every script the process
loaded through run_script load again, not only those its caller thought of (the lane ring's script, which every
worker runs on every beat since issue 45.8, kept a worker without affinity refusing its own beat forever after a
cluster primary failed over: test_cluster_failover's primary run lost jobs to a 60 s timeout in 2 of 4 runs)."""
from __future__ import annotations

import redis

from kvgate.producer.cluster import is_noscript, run_script, scripts_lost
from kvgate.producer.redis_url import connect


def _run(r, script, key: str):
    pipe = r.pipeline(transaction=False)
    run_script(script, [key], ["x"], pipe)
    return pipe.execute(raise_on_error=False)[0]


def test_every_script_loaded_through_run_script_loads_again_after_scripts_lost(cluster):
    r = connect(cluster.url)
    scripts = [r.register_script(f"return ARGV[1] .. '{n}'") for n in range(3)]
    assert [_run(r, s, f"k{n}") for n, s in enumerate(scripts)] == [b"x0", b"x1", b"x2"]
    for node in r.get_primaries():
        r.execute_command("SCRIPT", "FLUSH", target_nodes=node)  # as a promoted replica has none
    lost = _run(r, scripts[2], "k2")
    assert isinstance(lost, redis.ResponseError) and is_noscript(lost)
    scripts_lost()  # the caller names none: every one of them loads again
    assert [_run(r, s, f"k{n}") for n, s in enumerate(scripts)] == [b"x0", b"x1", b"x2"]
