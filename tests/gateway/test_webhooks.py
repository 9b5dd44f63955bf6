"""Webhooks (issue 44): batch.completed, .failed, .cancelled, .expired and response.completed events in OpenAI's shape,
signed as Standard Webhooks and verified by the official client's webhooks.unwrap, from a real gateway to a real HTTP
receiver on loopback (hence --webhook-allow-private). Delivery (retries, tenants' receivers): test_webhook_delivery.py."""
from __future__ import annotations

import openai
import pytest

from tests.gateway.batch_files import jsonl, request, wait_final
from tests.gateway.conftest import start_gateway
from tests.gateway.webhook_receiver import Receiver, new_secret
from tests.support import wait_for

SECRET = new_secret()
FAST = dict(webhook_allow_private=True, webhook_poll_s=0.1, webhook_backoff_s=0.1, batch_poll_s=0.2,
            batch_min_window_s=1)


@pytest.fixture(scope="module")
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def client(sim_fleet, receiver, tmp_path_factory):
    """`ghost`: a model no worker serves, whose lines wait (to cancel or expire a batch that never runs)."""
    gw = start_gateway(*sim_fleet, files_dir=str(tmp_path_factory.mktemp("files")), webhook_url=receiver.url,
                       webhook_secret=SECRET, models=["ghost"], **FAST)
    with openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    gw.stop()


def batch_of(c, rows, window="24h"):
    f = c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window=window)


def event_about(receiver: Receiver, object_id: str, secret: str = SECRET):
    """The one event about `object_id`, verified by openai's unwrap (a bad signature raises)."""
    wait_for(lambda: any(object_id.encode() in d.body for d in receiver.deliveries), 30, f"an event for {object_id}")
    events = [e for e in receiver.events(secret) if e.data.id == object_id]
    assert len(events) == 1, events
    return events[0]


def ghost(i: int) -> dict:
    row = request(i)
    row["body"]["model"] = "ghost"
    return row


def test_a_completed_batch_sends_batch_completed_signed_as_standard_webhooks(client, receiver):
    batch = batch_of(client, [request(i) for i in range(3)])
    done = wait_final(client.batches.retrieve, batch.id)
    assert done.status == "completed"
    event = event_about(receiver, batch.id)
    assert type(event).__name__ == "BatchCompletedWebhookEvent"
    assert event.type == "batch.completed" and event.object == "event" and event.id.startswith("evt_")
    assert event.created_at == done.completed_at
    delivery = next(d for d in receiver.deliveries if batch.id.encode() in d.body)
    assert delivery.headers["webhook-id"] == event.id and delivery.headers["webhook-signature"].startswith("v1,")


def test_a_delivery_with_another_secret_fails_openai_verification(client, receiver):
    batch = batch_of(client, [request(0)])
    wait_final(client.batches.retrieve, batch.id)
    wait_for(lambda: any(batch.id.encode() in d.body for d in receiver.deliveries), 30, "the event")
    delivery = next(d for d in receiver.deliveries if batch.id.encode() in d.body)
    with openai.OpenAI(api_key="unused") as c, pytest.raises(openai.InvalidWebhookSignatureError):
        c.webhooks.unwrap(delivery.body, delivery.headers, secret=new_secret())


def test_a_batch_that_fails_validation_sends_batch_failed(client, receiver):
    bad = request(1)
    bad["url"] = "/v1/completions"  # mixes endpoints: the batch fails at validation
    batch = batch_of(client, [request(0), bad])
    assert wait_final(client.batches.retrieve, batch.id).status == "failed"
    assert event_about(receiver, batch.id).type == "batch.failed"


def test_a_cancelled_batch_sends_batch_cancelled(client, receiver):
    batch = batch_of(client, [ghost(i) for i in range(2)])
    wait_for(lambda: client.batches.retrieve(batch.id).status == "in_progress", 30, "the batch to start")
    client.batches.cancel(batch.id)
    assert wait_final(client.batches.retrieve, batch.id).status == "cancelled"
    assert event_about(receiver, batch.id).type == "batch.cancelled"


def test_a_batch_past_its_window_sends_batch_expired(client, receiver):
    batch = batch_of(client, [ghost(0)], window="2s")
    assert wait_final(client.batches.retrieve, batch.id, 30).status == "expired"
    assert event_about(receiver, batch.id).type == "batch.expired"


def test_a_background_response_sends_response_completed_once(client, receiver):
    # the simulated model's words are " t<n>": a stop string ends the answer, completed (not cut by max tokens)
    out = client.responses.create(model="simulated", input="later", max_output_tokens=8, background=True,
                                  extra_body={"stop": [" t"]})
    event = event_about(receiver, out.id)
    assert event.type == "response.completed" and type(event).__name__ == "ResponseCompletedWebhookEvent"
    assert client.responses.retrieve(out.id).status == "completed"


def test_a_background_response_cut_by_max_output_tokens_sends_response_incomplete(client, receiver):
    out = client.responses.create(model="simulated", input="later", max_output_tokens=4, background=True)
    event = event_about(receiver, out.id)
    assert event.type == "response.incomplete" and type(event).__name__ == "ResponseIncompleteWebhookEvent"
    assert client.responses.retrieve(out.id).status == "incomplete"


def test_a_cancelled_background_response_sends_response_cancelled(client, receiver):
    out = client.responses.create(model="ghost", input="never run", background=True)
    assert client.responses.cancel(out.id).status == "cancelled"
    assert event_about(receiver, out.id).type == "response.cancelled"


def test_a_response_that_is_not_background_sends_no_event(client, receiver):
    out = client.responses.create(model="simulated", input="now", max_output_tokens=4)
    later = client.responses.create(model="simulated", input="later", max_output_tokens=4, background=True)
    event_about(receiver, later.id)  # sent after the first one's end: had the first sent one, it would be here
    assert not any(out.id.encode() in d.body for d in receiver.deliveries)


def test_a_streamed_background_response_sends_its_event_too(client, receiver):
    with client.responses.create(model="simulated", input="later", max_output_tokens=4, background=True,
                                 stream=True) as stream:
        rid = next(iter(stream)).response.id
    assert event_about(receiver, rid).type == "response.incomplete"
