"""Tracing across a SIGKILL (issue 44): a worker killed mid-job has already sent its attempt's queue-wait and admission
spans; the worker that runs the job again sends its own into the same trace, its attempt span linking to the first's.
Real `kvgate worker --simulated` processes export over OTLP/HTTP to a receiver on loopback that decodes the protobuf
payloads as a collector would."""
from __future__ import annotations

import signal
import uuid

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from kvgate.producer import Client  # noqa: E402
from kvgate.worker.tracing import attempt_span_id  # noqa: E402
from tests.otlp_collector import Collector  # noqa: E402
from tests.reliability.chaos_harness import stop_all  # noqa: E402
from tests.support import spawn_worker, wait_for  # noqa: E402

SLOW = ("--simulated", "--sim-step-ms", "15", "--sim-per-token-ms", "0", "--max-num-seqs", "4",
        "--reclaim-idle-ms", "1000")
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # the batch span processor sends every 50 ms


def test_a_job_killed_mid_run_yields_one_trace_with_both_attempts(redis_server, namespace, tmp_path):
    collector = Collector()
    trace_id = uuid.uuid4().hex
    procs = []

    def spawn(worker_id: str):
        procs.append(spawn_worker(redis_server.url, namespace, *SLOW, "--otel-endpoint", collector.url,
                                  worker_id=worker_id, log=tmp_path / f"{worker_id}.log", env=FAST_EXPORT))
        return procs[-1]

    try:
        first = spawn("traced-a")
        with Client(redis_server.url, namespace) as client:
            handle = client.submit("tell a long story", max_tokens=300, ignore_eos=True,
                                   traceparent=f"00-{trace_id}-00f067aa0ba902b7-01")
            wait_for(lambda: collector.named("kvgate.admission"), timeout=60,
                     what="the first worker's admission span")
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            spawn("traced-b")
            result = handle.result(timeout=90)
        assert result.status == "done" and result.attempt == 2
        wait_for(lambda: collector.named("kvgate.job"), timeout=30, what="the second attempt's span")
    finally:
        stop_all(procs)
    ours = [s for s in collector.spans if s["trace"] == trace_id]
    assert len(ours) == len(collector.spans), "every span is in the caller's trace"
    assert sorted(s["attributes"]["kvgate.attempt"].int_value for s in collector.named("kvgate.queue_wait")) == [1, 2]
    (attempt,) = collector.named("kvgate.job")  # the first attempt never ended: only the second's
    assert attempt["id"] == attempt_span_id(result.job_id, 2) and attempt["parent"] == 0x00f067aa0ba902b7
    assert attempt["links"] == [attempt_span_id(result.job_id, 1)]
    first_run = [s for s in ours if s["attributes"]["kvgate.attempt"].int_value == 1]
    assert {s["name"] for s in first_run} == {"kvgate.queue_wait", "kvgate.admission"}
    assert {s["parent"] for s in first_run} == {attempt_span_id(result.job_id, 1)}
