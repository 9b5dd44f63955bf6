"""Tracing (issue 44): a job's traceparent travels from the caller through the queue, and the worker's spans for it
(queue wait, admission, prefill, decode, finish, and the attempt's own) land in the caller's trace, with the names
vLLM and SGLang use. A worker in a thread with the SDK's in-memory exporter; the attempt link without a worker."""
from __future__ import annotations

import msgspec
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from kvgate.producer import Client, InvalidRequest  # noqa: E402
from kvgate.producer.protocol import FIELD, Final, Job, Timings, Usage  # noqa: E402
from kvgate.worker.tracing import JobTrace, attempt_span_id, job_tracing  # noqa: E402

CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
STAGES = {"kvgate.queue_wait", "kvgate.admission", "kvgate.prefill", "kvgate.decode", "kvgate.finish"}


@pytest.fixture
def exported():
    return InMemorySpanExporter()


def enqueued(queue) -> list[Job]:
    """The jobs on the default model's normal stream, oldest first."""
    return [msgspec.msgpack.decode(fields[FIELD.encode()], type=Job)
            for _, fields in queue.r.xrange(queue.keys.jobs(None, "normal"))]


def spans_by_name(exporter, tracing) -> dict[str, list]:
    tracing.provider.force_flush()
    got: dict[str, list] = {}
    for span in exporter.get_finished_spans():
        got.setdefault(span.name, []).append(span)
    return got


def test_a_jobs_spans_join_the_callers_trace_under_one_attempt_span(queue, thread_worker, exported):
    tracing = job_tracing(None, "w-trace", exporter=exported)
    with Client(queue.server.url, queue.ns) as client, thread_worker(tracing=tracing, worker_id="w-trace"):
        result = client.submit("hello there", max_tokens=6, temperature=0, traceparent=CALLER).result(timeout=30)
    assert result.status == "done"
    got = spans_by_name(exported, tracing)
    assert set(got) == STAGES | {"kvgate.job"}, sorted(got)
    (job,) = got["kvgate.job"]
    trace_id = int(CALLER.split("-")[1], 16)
    assert job.context.trace_id == trace_id and job.parent.span_id == int(CALLER.split("-")[2], 16)
    assert job.context.span_id == attempt_span_id(result.job_id, 1)
    for name in STAGES:
        (stage,) = got[name]
        assert stage.context.trace_id == trace_id and stage.parent.span_id == job.context.span_id, name
        assert stage.end_time >= stage.start_time
    a = job.attributes
    assert a["gen_ai.request.id"] == result.job_id and a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.usage.prompt_tokens"] == result.usage.prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == result.usage.completion_tokens == 6
    assert a["kvgate.attempt"] == 1 and a["kvgate.status"] == "done" and a["kvgate.worker"] == "w-trace"
    assert a["gen_ai.latency.e2e"] >= a["gen_ai.latency.time_in_queue"] >= 0
    assert got["kvgate.prefill"][0].end_time <= got["kvgate.decode"][0].start_time + 1


def test_a_job_no_caller_traced_has_a_trace_of_its_own_derived_from_its_id(queue, thread_worker, exported):
    tracing = job_tracing(None, "w-own", exporter=exported)
    with Client(queue.server.url, queue.ns) as client, thread_worker(tracing=tracing):
        result = client.submit("hi", max_tokens=3).result(timeout=30)
    (job,) = spans_by_name(exported, tracing)["kvgate.job"]
    assert job.parent is None
    assert job.context.trace_id == JobTrace.of(Job(v=1, job_id=result.job_id, client_id="c", enqueued_at=1.0)).trace_id


def test_the_sdk_carries_the_callers_current_span_as_the_jobs_traceparent(queue):
    caller = TracerProvider().get_tracer("app")  # the application's own provider, not the global one
    with Client(queue.server.url, queue.ns) as client:
        with caller.start_as_current_span("handle-request") as span:
            handle = client.submit("hi", max_tokens=2)
        job = enqueued(queue)[-1]
        context = span.get_span_context()
        assert job.job_id == handle.job_id
        assert job.traceparent == f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
        assert client.submit("hi", max_tokens=2, traceparent=CALLER) and enqueued(queue)[-1].traceparent == CALLER
        assert client.submit("hi", max_tokens=2) and enqueued(queue)[-1].traceparent is None  # no span: none


@pytest.mark.parametrize("bad", ["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",  # no flags
                                 "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
                                 "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
                                 "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero span id
                                 "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff
                                 CALLER + "-extra", "x" * 10_000])
def test_a_bad_traceparent_is_refused_naming_it(queue, bad):
    with Client(queue.server.url, queue.ns) as client, pytest.raises(InvalidRequest, match="traceparent"):
        client.submit("hi", traceparent=bad)
    assert enqueued(queue) == []


def test_a_later_attempt_on_another_worker_joins_the_trace_and_links_to_the_first(exported):
    """Worker one admits the job (its queue-wait and admission spans go out) and dies before answering; worker two
    runs it again: its attempt span is in the same trace and links to the first attempt's span."""
    job = Job(v=1, job_id="j-redelivered", client_id="c", enqueued_at=100.0, traceparent=CALLER)
    first, second = job_tracing(None, "w1", exporter=exported), job_tracing(None, "w2", exporter=exported)
    first.admitted(job, 1, read_at=101.0, admitted_at=101.5)
    second.admitted(job, 2, read_at=130.0, admitted_at=130.2)
    final = Final(v=1, job_id=job.job_id, status="done", worker="w2", attempt=2, model="m",
                  timings=Timings(queued=100.0, admitted=130.2, first_token=130.4, finished=131.0),
                  usage=Usage(5, 7, 0), finish_reason="length")
    second.answered(final)
    first.provider.force_flush()
    got = spans_by_name(exported, second)
    (attempt,) = got["kvgate.job"]
    assert [s.attributes["kvgate.attempt"] for s in got["kvgate.queue_wait"]] == [1, 2]
    trace_id = int(CALLER.split("-")[1], 16)
    assert {s.context.trace_id for spans in got.values() for s in spans} == {trace_id}
    assert [link.context.span_id for link in attempt.links] == [attempt_span_id(job.job_id, 1)]
    assert got["kvgate.queue_wait"][0].parent.span_id == attempt_span_id(job.job_id, 1)
    assert attempt.context.span_id == attempt_span_id(job.job_id, 2)
    assert attempt.attributes["gen_ai.latency.time_to_first_token"] == pytest.approx(30.4)


def test_tracing_is_off_without_an_endpoint(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert type(job_tracing(None, "w")).__name__ == "NoTracing"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    assert type(job_tracing(None, "w")).__name__ == "JobTracing"
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert type(job_tracing(None, "w")).__name__ == "NoTracing"
