"""Webhook events outlive their gateway (issue 44): `kvgate serve` SIGKILLed before it could deliver an event, or in the
middle of delivering it, and started again: the receiver gets the event, with the webhook-id it would have had (what
receivers dedupe on: delivery is at least once)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import openai
import pytest

from tests.gateway.conftest import gateway_up
from tests.gateway.test_webhook_delivery import SECRET, counts, failed_batch, outbox
from tests.gateway.webhook_receiver import Receiver
from tests.support import ROOT, free_port, wait_for

TIMEOUT_S = 1.0  # a delivery's timeout: a killed delivery's claim lapses after it plus sender.CLAIM_MARGIN_S


def serve(url: str, ns: str, files_dir: str, port: int, receiver: Receiver) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvgate.commands.serve", "--redis-url", url, "--namespace", ns, "--port", str(port),
           "--files-dir", files_dir, "--log-level", "warning", "--batch-poll-s", "0.2", "--webhook-url", receiver.url,
           "--webhook-allow-private", "--webhook-poll-s", "0.1", "--webhook-backoff-s", "0.2",
           "--webhook-timeout-s", str(TIMEOUT_S)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVGATE_WEBHOOK_SECRET": SECRET}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


@pytest.mark.parametrize("when", ["before", "during"])
def test_an_event_is_delivered_after_its_gateway_is_killed_and_started_again(shared_redis, namespace, tmp_path, when):
    receiver, port = Receiver(), free_port()
    if when == "during":  # the receiver holds the first delivery open until long after the kill
        receiver.hang_s = 30
        receiver.start()
    procs = [serve(shared_redis.url, namespace, str(tmp_path), port, receiver)]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        wait_for(lambda: gateway_up(client), 60, "the first gateway")
        batch_id = failed_batch(client)
        if when == "during":
            receiver.wait(1)  # the delivery is in flight, unanswered
        kill(procs[0])
        killed = len(receiver.deliveries)  # none of them answered: the receiver holds every one
        assert killed >= 1 if when == "during" else killed == 0
        if when == "before":
            receiver.start()
        receiver.hang_s = 0
        procs.append(serve(shared_redis.url, namespace, str(tmp_path), port, receiver))
        wait_for(lambda: len(receiver.deliveries) > killed, 60, "the delivery after restart")
        events = receiver.events(SECRET)
        assert {e.data.id for e in events} == {batch_id} and {e.type for e in events} == {"batch.failed"}
        assert len({d.headers["webhook-id"] for d in receiver.deliveries}) == 1  # the same event each time
        wait_for(lambda: outbox(shared_redis.url, namespace)["delivered"] == 1, 30, "the outbox to record it")
        got = counts(shared_redis.url, namespace)  # kvgate stats says so too
        assert got["delivered"] == 1 and got["pending"] == 0
    finally:
        client.close()
        receiver.stop()
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
