"""Webhooks on a Redis Cluster: a batch's final status and its event are one script in shard 0's slot, the outbox's
claim and retry scripts run there, and `kvgate stats` reads the counts through the cluster client."""
from __future__ import annotations

import json
import subprocess
import sys

import openai

from tests.cluster.conftest import cluster  # noqa: F401  (the session's cluster fixture)
from tests.gateway.conftest import start_gateway
from tests.gateway.test_webhook_delivery import FAST, SECRET, failed_batch
from tests.gateway.webhook_receiver import Receiver
from tests.support import ROOT, wait_for


def test_a_batch_event_is_retried_and_delivered_on_a_cluster(cluster, namespace, tmp_path):  # noqa: F811
    receiver = Receiver(status=503).start()
    gw = start_gateway(cluster.url, namespace, files_dir=str(tmp_path), webhook_url=receiver.url,
                       webhook_secret=SECRET, **FAST)
    try:
        with openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=60) as c:
            batch_id = failed_batch(c)
        receiver.wait(2)  # refused once at least: the retry script ran
        receiver.status = 200
        wait_for(lambda: any(e.data.id == batch_id for e in receiver.events(SECRET)[-1:]), 30, "the delivery")

        def stats() -> dict:
            out = subprocess.run([sys.executable, "-m", "kvgate.commands.cli", "stats", "--json", "--redis-url",
                                  cluster.url, "--namespace", namespace], capture_output=True, text=True, cwd=ROOT,
                                 timeout=60)
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)["webhooks"]

        wait_for(lambda: stats()["delivered"] == 1, 30, "the count")
        assert stats() == {"delivered": 1, "failed": 0, "dropped": 0, "pending": 0}
    finally:
        gw.stop()
        receiver.stop()
