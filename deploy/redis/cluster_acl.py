"""Render acl-cluster.conf from acl.conf: the same users and rights for namespace `kvgate` on a Redis Cluster.

There the namespace is split into shards, each key carrying its shard's hash tag after the namespace
(`kvgate:{0.1}:jobs:default:high`), so every key pattern `~kvgate:<rest>` becomes `~kvgate:{*}:<rest>`. Two more
needs: every user's client asks a node for the slot map (CLUSTER SLOTS) and the command table (COMMAND) when it
connects, and reads the namespace's shard count at `kvgate:shards` (no tag), which workers and producers record when
they are the first. Run it after editing acl.conf: `python deploy/redis/cluster_acl.py` (a test checks the file is
up to date).
"""
from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAMESPACE = "kvgate"
DISCOVERY = "+cluster|slots +cluster|shards +cluster|nodes +cluster|myid +command +command|docs +command|info"
RECORDS_SHARDS = ("worker", "producer", "gateway")  # the first to use a namespace records its shard count
EXTRA = {"worker": "+scan"}  # pruning departed consumers lists the live heartbeats (a script may not read them there)


def cluster_acl(text: str, namespace: str = NAMESPACE) -> str:
    lines = []
    for line in text.splitlines():
        if line.startswith("user ") and not line.split()[1] == "default":
            user = line.split()[1]
            line = re.sub(rf"(~){re.escape(namespace)}:", rf"\g<1>{namespace}:{{*}}:", line)
            shards = f"~{namespace}:shards" if user in RECORDS_SHARDS else f"%R~{namespace}:shards"
            extra = f" {EXTRA[user]}" if user in EXTRA else ""
            line = line.replace(" -@all ", f" -@all {DISCOVERY}{extra} ", 1) + f" ({shards} +get +set)"
        lines.append(line)
    return "\n".join(lines) + "\n"


def main() -> None:
    # no comment: an ACL file takes only user lines (its README says where it comes from)
    (HERE / "acl-cluster.conf").write_text(cluster_acl((HERE / "acl.conf").read_text()))


if __name__ == "__main__":
    main()
