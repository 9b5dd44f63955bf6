"""Webhook delivery (issue 44): at least once from the outbox in Redis, retried with backoff while the receiver is down,
counted failed past --webhook-retry (kvgate stats, /metrics); a tenant's own receiver from --webhooks-file. Each test
has its own namespace and gateway (a gateway delivers every event of its namespace) and no worker: a batch whose
input mixes endpoints fails at validation, which is all an event needs."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import redis

from kvgate.gateway.webhooks.outbox import WebhookKeys, read_counts
from kvgate.producer.keys import Keys
from tests.gateway.batch_files import jsonl, request, wait_final
from tests.gateway.webhook_receiver import Receiver, new_secret
from tests.support import ROOT, wait_for

SECRET = new_secret()
FAST = dict(webhook_allow_private=True, webhook_poll_s=0.1, webhook_backoff_s=0.1, webhook_timeout_s=2)


def failed_batch(c: openai.OpenAI) -> str:
    """A batch that ends failed at validation (no worker needed): its id."""
    bad = request(1)
    bad["url"] = "/v1/completions"
    f = c.files.create(file=("in.jsonl", jsonl([request(0), bad])), purpose="batch")
    batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_final(c.batches.retrieve, batch.id).status == "failed"
    return batch.id


def outbox(url: str, ns: str) -> dict:
    """The outbox's counts read in this process as `kvgate stats` reads them: cheap to poll while waiting (a poll of
    counts() starts a Python process each time); each test then checks `kvgate stats` itself with counts()."""
    with redis.Redis.from_url(url) as r:
        return read_counts(r, WebhookKeys(Keys(ns).prefix)).to_dict()


def counts(url: str, ns: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvgate.commands.cli", "stats", "--json", "--redis-url", url,
                          "--namespace", ns], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["webhooks"]


def attempts(url: str, ns: str) -> int:
    with redis.Redis.from_url(url) as r:
        return sum(int(r.hget(k, "attempts") or 0) for k in r.scan_iter(f"{ns}:webhook:evt_*"))


def test_a_receiver_down_at_first_gets_the_event_once_it_comes_up_with_one_webhook_id(shared_redis, namespace,
                                                                                    gateway_factory, tmp_path):
    receiver = Receiver()  # its port is kept but nothing listens: connections are refused
    gw = gateway_factory(shared_redis.url, namespace, files_dir=str(tmp_path), webhook_url=receiver.url,
                         webhook_secret=SECRET, **FAST)
    try:
        with openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=60) as c:
            batch_id = failed_batch(c)
            wait_for(lambda: attempts(shared_redis.url, namespace) >= 3, 30, "three refused attempts")
            receiver.status = 503  # up, but failing: retried too
            receiver.start()  # at once: the backoff doubles with every attempt (0.1 s, 0.2 s, ...)
            assert counts(shared_redis.url, namespace)["pending"] == 1  # still: a 503 is no delivery
            receiver.wait(2)
            receiver.status = 200
            wait_for(lambda: outbox(shared_redis.url, namespace)["delivered"] == 1, 30, "the delivery")
        (event,) = {e.id: e for e in receiver.events(SECRET)}.values()  # every attempt: one event, one webhook-id
        assert event.type == "batch.failed" and event.data.id == batch_id
        assert {d.headers["webhook-id"] for d in receiver.deliveries} == {event.id}
        assert counts(shared_redis.url, namespace) == {"delivered": 1, "failed": 0, "dropped": 0, "pending": 0}
    finally:
        receiver.stop()


def test_a_receiver_down_past_the_retry_time_is_counted_failed_in_stats_and_metrics(shared_redis, namespace,
                                                                                 gateway_factory, tmp_path):
    receiver = Receiver(status=500).start()
    gw = gateway_factory(shared_redis.url, namespace, files_dir=str(tmp_path), webhook_url=receiver.url,
                         webhook_secret=SECRET, **(FAST | {"webhook_retry_s": 1.0}))
    try:
        with openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=60) as c:
            failed_batch(c)
            wait_for(lambda: outbox(shared_redis.url, namespace)["failed"] == 1, 30, "the event to be given up")
        tried = len(receiver.deliveries)
        assert tried >= 2  # retried before giving up
        assert counts(shared_redis.url, namespace) == {"delivered": 0, "failed": 1, "dropped": 0, "pending": 0}
        with redis.Redis.from_url(shared_redis.url) as r:
            (event_id,) = [i.decode() for i in r.zrange(f"{namespace}:webhooks:failed", 0, -1)]
            assert r.hget(f"{namespace}:webhook:{event_id}", "error") == b"HTTP 500"
        metrics = httpx.get(f"{gw.root}/metrics").text
        assert 'kvgate_gateway_webhook_deliveries_total{outcome="failed"} 1.0' in metrics
        assert f'kvgate_gateway_webhook_deliveries_total{{outcome="retried"}} {tried - 1}.0' in metrics
        out = subprocess.run([sys.executable, "-m", "kvgate.commands.cli", "stats", "--redis-url", shared_redis.url,
                              "--namespace", namespace], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert "webhooks: delivered 0   pending 0   failed 1" in out.stdout, out.stdout
        assert len(receiver.deliveries) == tried  # no attempt after giving up
    finally:
        receiver.stop()


def test_a_tenant_in_the_webhooks_file_gets_its_events_at_its_own_url_with_its_own_secret(shared_redis, namespace,
                                                                                        gateway_factory, tmp_path):
    gateways, own, own_secret = Receiver().start(), Receiver().start(), new_secret()
    try:
        hooks = tmp_path / "webhooks.toml"
        hooks.write_text(f'[tenants.team-a]\nurl = "{own.url}"\nsecret = "{own_secret}"\n')
        gw = gateway_factory(shared_redis.url, namespace, files_dir=str(tmp_path), api_keys=["ka=team-a", "kb=team-b"],
                             webhook_url=gateways.url, webhook_secret=SECRET, webhooks_file=str(hooks), **FAST)
        with openai.OpenAI(base_url=gw.base_url, api_key="ka", max_retries=0, timeout=60) as a, \
                openai.OpenAI(base_url=gw.base_url, api_key="kb", max_retries=0, timeout=60) as b:
            mine, theirs = failed_batch(a), failed_batch(b)
        own.wait(1)
        gateways.wait(1)
        assert [e.data.id for e in own.events(own_secret)] == [mine]
        assert [e.data.id for e in gateways.events(SECRET)] == [theirs]  # the gateway's receiver and secret
    finally:
        own.stop()
        gateways.stop()


def test_with_only_tenants_receivers_another_tenants_batch_writes_no_event(shared_redis, namespace, gateway_factory,
                                                                          tmp_path):
    own, secret = Receiver().start(), new_secret()
    try:
        hooks = tmp_path / "webhooks.toml"
        hooks.write_text(f'[tenants.team-a]\nurl = "{own.url}"\nsecret = "{secret}"\n')
        gw = gateway_factory(shared_redis.url, namespace, files_dir=str(tmp_path), api_keys=["ka=team-a", "kb=team-b"],
                             webhooks_file=str(hooks), models=["simulated"], **FAST)  # queued: no worker
        with openai.OpenAI(base_url=gw.base_url, api_key="kb", max_retries=0, timeout=60) as b, \
                openai.OpenAI(base_url=gw.base_url, api_key="ka", max_retries=0, timeout=60) as a:
            failed_batch(b)
            b.responses.create(model="simulated", input="x", background=True)
            mine = failed_batch(a)
        own.wait(1)
        wait_for(lambda: outbox(shared_redis.url, namespace)["delivered"] == 1, 30, "team-a's delivery")
        assert [e.data.id for e in own.events(secret)] == [mine]
        assert counts(shared_redis.url, namespace) == {"delivered": 1, "failed": 0, "dropped": 0, "pending": 0}
        with redis.Redis.from_url(shared_redis.url) as r:
            assert r.zcard(f"{namespace}:webhooks:watch") == 0  # team-b's background response is not watched
    finally:
        own.stop()


def test_an_event_whose_tenant_lost_its_receiver_before_delivery_is_dropped_and_counted(shared_redis, namespace,
                                                                                       gateway_factory, tmp_path):
    down, other = Receiver(), Receiver().start()
    try:
        first = gateway_factory(shared_redis.url, namespace, files_dir=str(tmp_path), webhook_url=down.url,
                                webhook_secret=SECRET, **FAST)
        with openai.OpenAI(base_url=first.base_url, api_key="unused", max_retries=0, timeout=60) as c:
            failed_batch(c)
        first.stop()  # its event undelivered: the receiver never came up
        hooks = tmp_path / "webhooks.toml"  # the operator now sends only team-a's events
        hooks.write_text(f'[tenants.team-a]\nurl = "{other.url}"\nsecret = "{SECRET}"\n')
        gateway_factory(shared_redis.url, namespace, files_dir=str(tmp_path), webhooks_file=str(hooks), **FAST)
        wait_for(lambda: outbox(shared_redis.url, namespace)["dropped"] == 1, 30, "the event dropped")
        got = counts(shared_redis.url, namespace)  # kvgate stats says so too
        assert got["dropped"] == 1 and got["pending"] == 0 and other.deliveries == []
    finally:
        other.stop()
