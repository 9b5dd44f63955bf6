"""The gateway's request span (issue 44): a request with a W3C traceparent header gets a SERVER span under the
caller's, and the worker's spans for the job it enqueued hang under that span, in one trace. The official `openai`
client sends the header; a gateway in a thread and a `kvgate worker --simulated` subprocess both export over
OTLP/HTTP to a receiver on loopback."""
from __future__ import annotations

import uuid

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from openai import OpenAI  # noqa: E402

from tests.gateway.conftest import SIM, running_worker  # noqa: E402
from tests.otlp_collector import Collector  # noqa: E402
from tests.support import wait_for  # noqa: E402

SERVER = 2  # OTLP's SPAN_KIND_SERVER


def test_a_requests_span_joins_the_callers_trace_and_the_jobs_spans_hang_under_it(shared_redis, gateway_factory,
                                                                                  monkeypatch):
    collector = Collector()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # spans sent every 50 ms: the gateway's and the worker's
    namespace = f"trace{uuid.uuid4().hex[:8]}"
    trace_id, caller_span = uuid.uuid4().hex, "00f067aa0ba902b7"
    with running_worker(shared_redis.url, namespace, *SIM, "--otel-endpoint", collector.url, worker_id="sim-traced"):
        gw = gateway_factory(shared_redis.url, namespace, otel_endpoint=collector.url)
        client = OpenAI(base_url=gw.base_url, api_key="none")
        answer = client.completions.create(model="default", prompt="hello", max_tokens=5,
                                           extra_headers={"traceparent": f"00-{trace_id}-{caller_span}-01"})
        assert answer.choices[0].text
        client.models.list()  # a request without the header: a trace of its own
        wait_for(lambda: collector.named("kvgate.job") and len(collector.named("GET /v1/models")) == 1, timeout=30,
                 what="the worker's and the gateway's spans")
    (request,) = collector.named("POST /v1/completions")
    assert request["kind"] == SERVER and request["trace"] == trace_id and request["parent"] == int(caller_span, 16)
    assert request["attributes"]["http.response.status_code"].int_value == 200
    (job,) = collector.named("kvgate.job")
    assert job["trace"] == trace_id and job["parent"] == request["id"]
    assert job["attributes"]["gen_ai.usage.completion_tokens"].int_value == 5
    (models,) = collector.named("GET /v1/models")
    assert models["trace"] != trace_id and models["parent"] is None
    assert not collector.named("GET /health")
