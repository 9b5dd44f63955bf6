"""A Redis Cluster on loopback ports, made the way an operator makes one (`redis-server --cluster-enabled yes` per
node, then `redis-cli --cluster create`), of kvgate.redis_server.RedisServer nodes: W-FLEET's and W-DURABILITY's
cluster contestant and the tests' cluster (tests/support.py adds the fault injection only tests use)."""
from __future__ import annotations

import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import redis

from kvgate.redis_server import RedisServer, free_port, redis_server_binary, wait_for



def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is also free and valid (<= 65535)."""
    while True:
        port = free_port()
        if port <= 55535:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port


@dataclass(slots=True)
class ClusterGroup:
    """A Redis Cluster on loopback: `primaries` primaries with `replicas` replicas each, made with `redis-cli
    --cluster create`, tight node timeouts so a SIGKILLed primary's replica is promoted within seconds. `url`
    is the redis+cluster:// form every kvgate component takes. `extra_args` go to every node after the defaults
    (W-FLEET turns the append-only file off, as on its single Redis)."""

    workdir: Path
    primaries: int = 3
    replicas: int = 1
    binary: str = field(default_factory=redis_server_binary)
    node_timeout_ms: int = 1000
    extra_args: tuple[str, ...] = ()
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:self.primaries]) + "/"

    def start(self, timeout: float = 30.0) -> "ClusterGroup":
        for i in range(self.primaries * (1 + self.replicas)):
            node = RedisServer(self.workdir / f"n{i}", self.binary, port=cluster_port(), extra_args=(
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms), "--appendfsync", "everysec",
                "--enable-debug-command", "yes",  # DEBUG SLEEP: a replica lagging on purpose
                # a replica takes over however long it has not heard from its primary: under load its link can look
                # stale ("Disconnected from master for longer than allowed"), and a test cluster must fail over
                "--cluster-replica-validity-factor", "0", *self.extra_args))
            self.nodes.append(node.start())
        cli = shutil.which("redis-cli") or str(Path(self.binary).with_name("redis-cli"))
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                        "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=timeout)
        wait_for(self._ok, timeout, "every node to report cluster_state:ok")
        return self

    def _ok(self) -> bool:
        try:
            return all(n.client().cluster("info")["cluster_state"] == "ok" for n in self.nodes if n.proc)
        except redis.RedisError:
            return False

    def primary_nodes(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.proc and n.client().info("replication")["role"] == "master"]

    def node_of(self, key: str) -> RedisServer:
        """The primary that holds `key`'s slot now, as the live nodes see it."""
        slot = redis.crc.key_slot(key.encode())
        for node in [n for n in self.nodes if n.proc]:
            try:
                ranges = node.client().execute_command("CLUSTER", "SLOTS")
            except redis.RedisError:
                continue
            port = next(int(r[2][1]) for r in ranges if int(r[0]) <= slot <= int(r[1]))
            return next(n for n in self.nodes if n.port == port)
        raise AssertionError(f"no live node answers CLUSTER SLOTS for slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop(9)
