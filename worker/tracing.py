"""A job's spans, where tracing is on (`--otel-endpoint`, or the standard OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT).

Each run of a job (an attempt: its delivery) is one `kvgate.job` span (kind CONSUMER) in the job's trace: the trace
of the job's `traceparent` (the caller's, carried from the SDK or the gateway), or without one a trace of the job's
own whose id is derived from its job id. Its children: `kvgate.queue_wait` (enqueued until read) and
`kvgate.admission` (read until the engine takes it), sent when it is admitted, so a worker killed mid-job has sent
them; `kvgate.prefill` (until its first token), `kvgate.decode` (until its last) and `kvgate.finish` (until its final
is durable), sent with the attempt's span once the final is. An attempt's span id is derived from the job id and
the attempt, so a redelivered job's second attempt, on whatever worker, joins the same trace and links to the first
attempt's span without asking anyone. Attribute names are the ones vLLM and SGLang use (`gen_ai.*`).

Times are each machine's wall clock (the job's enqueue time is its producer's): spans show where the time went;
limits are never measured by them (invariant 9)."""
from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvgate.producer.protocol import Final, Job

TRACKED = 65_536  # attempts admitted and not yet answered whose spans are kept; beyond, the oldest are forgotten
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def _derived(*parts: object, size: int) -> int:
    value = int.from_bytes(hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=size).digest(), "big")
    return value or 1  # an all-zero id is invalid


def attempt_span_id(job_id: str, attempt: int) -> int:
    """The span id of a job's attempt: the same on every worker, so a later attempt can link to an earlier one."""
    return _derived("kvgate.job", job_id, attempt, size=8)


@dataclass(frozen=True, slots=True)
class JobTrace:
    """Where a job's spans go: its trace id, the caller's span they hang under (None: the attempt is the trace's
    root), and whether the caller sampled it."""

    trace_id: int
    parent_span_id: int | None
    sampled: bool

    @classmethod
    def of(cls, job: Job) -> JobTrace:
        if job.traceparent:
            _, trace, parent, flags = job.traceparent.split("-")[:4]
            return cls(int(trace, 16), int(parent, 16), bool(int(flags, 16) & 1))
        return cls(_derived("kvgate.trace", job.job_id, size=16), None, True)


@dataclass(slots=True)
class Running:
    """An attempt admitted here, until its final is durable."""

    job: Job
    attempt: int
    trace: JobTrace
    read_at: float
    admitted_at: float


class PresetIds:
    """The tracer provider's id generator: random ids, except those the caller presets for the next span on this
    thread (an attempt's derived span id, and the derived trace id of a job no caller traced)."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
        self.random = RandomIdGenerator()
        self.local = threading.local()

    def preset(self, span_id: int, trace_id: int) -> None:
        self.local.span_id, self.local.trace_id = span_id, trace_id

    def generate_span_id(self) -> int:
        span_id, self.local.span_id = getattr(self.local, "span_id", None), None
        return span_id or self.random.generate_span_id()

    def is_trace_id_random(self) -> bool:
        return True  # a derived trace id is a hash, as uniform as a random one (ratio samplers may rely on it)

    def generate_trace_id(self) -> int:
        trace_id, self.local.trace_id = getattr(self.local, "trace_id", None), None
        return trace_id or self.random.generate_trace_id()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class JobTracing:
    """The spans of the jobs this worker runs. `provider`: a TracerProvider made with `ids` as its id generator."""

    def __init__(self, provider: Any, ids: PresetIds, worker_id: str) -> None:
        from opentelemetry import trace
        self.trace_api = trace
        self.provider, self.ids = provider, ids
        self.tracer = provider.get_tracer("kvgate.worker")
        self.worker_id = worker_id
        self.running: OrderedDict[tuple[str, int], Running] = OrderedDict()

    def _span_context(self, trace: JobTrace, span_id: int, remote: bool) -> Any:
        api = self.trace_api
        flags = api.TraceFlags(api.TraceFlags.SAMPLED if trace.sampled else api.TraceFlags.DEFAULT)
        return api.SpanContext(trace.trace_id, span_id, is_remote=remote, trace_flags=flags)

    def _under(self, trace: JobTrace, span_id: int | None, remote: bool) -> Any:
        """The context of a span under `span_id` (None: a root)."""
        if span_id is None:
            return None
        return self.trace_api.set_span_in_context(
            self.trace_api.NonRecordingSpan(self._span_context(trace, span_id, remote)))

    def _child(self, name: str, run: Running, start: float, end: float, **attributes: Any) -> None:
        context = self._under(run.trace, attempt_span_id(run.job.job_id, run.attempt), remote=False)
        span = self.tracer.start_span(name, context, attributes={"kvgate.attempt": run.attempt, **attributes},
                                      start_time=_ns(start))
        span.end(_ns(max(start, end)))

    def admitted(self, job: Job, attempt: int, read_at: float, admitted_at: float) -> None:
        """The job's attempt went into the engine here: its queue wait and admission spans go out now."""
        run = Running(job, attempt, JobTrace.of(job), min(read_at, admitted_at), admitted_at)
        self.running[(job.job_id, attempt)] = run
        while len(self.running) > TRACKED:
            self.running.popitem(last=False)
        self._child("kvgate.queue_wait", run, min(job.enqueued_at, run.read_at), run.read_at)
        self._child("kvgate.admission", run, run.read_at, admitted_at)

    def answered(self, final: Final) -> None:
        """The attempt's final is durable: its prefill, decode and finish spans and the attempt's own."""
        run = self.running.pop((final.job_id, final.attempt), None)
        if run is None:  # answered without running here (refused, expired, cancelled waiting): no spans of ours
            return
        now, t = time.time(), final.timings
        finished = t.finished or now
        first = t.first_token or finished
        self._child("kvgate.prefill", run, run.admitted_at, first)
        self._child("kvgate.decode", run, first, finished)
        self._child("kvgate.finish", run, finished, now, **{"kvgate.status": final.status})
        links = []
        if run.attempt > 1:  # the run before this one: a worker that died, or whose lease lapsed
            earlier = self._span_context(run.trace, attempt_span_id(final.job_id, run.attempt - 1), remote=True)
            links.append(self.trace_api.Link(earlier, {"kvgate.attempt": run.attempt - 1}))
        sampling, usage = run.job.sampling, final.usage
        attributes = {
            "gen_ai.operation.name": "embeddings" if run.job.task == "embed" else "text_completion",
            "gen_ai.request.id": final.job_id, "gen_ai.request.model": run.job.model or "default",
            "gen_ai.response.model": final.model or run.job.model or "default",
            "gen_ai.request.max_tokens": sampling.max_tokens, "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.usage.prompt_tokens": usage.prompt_tokens,
            "gen_ai.usage.completion_tokens": usage.completion_tokens,
            "gen_ai.usage.input_tokens": usage.prompt_tokens, "gen_ai.usage.output_tokens": usage.completion_tokens,
            "gen_ai.latency.time_in_queue": max(0.0, run.read_at - run.job.enqueued_at),
            "gen_ai.latency.e2e": max(0.0, finished - run.job.enqueued_at),
            "gen_ai.latency.time_in_model_prefill": max(0.0, first - run.admitted_at),
            "gen_ai.latency.time_in_model_decode": max(0.0, finished - first),
            "kvgate.attempt": run.attempt, "kvgate.status": final.status, "kvgate.worker": self.worker_id,
            "kvgate.priority": run.job.priority,
        }
        if t.first_token:
            attributes["gen_ai.latency.time_to_first_token"] = max(0.0, t.first_token - run.job.enqueued_at)
        if final.finish_reason:
            attributes["gen_ai.response.finish_reasons"] = [final.finish_reason]
        if run.job.tenant:
            attributes["kvgate.tenant"] = run.job.tenant
        self.ids.preset(attempt_span_id(final.job_id, run.attempt), run.trace.trace_id)
        span = self.tracer.start_span("kvgate.job", self._under(run.trace, run.trace.parent_span_id, remote=True),
                                      kind=self.trace_api.SpanKind.CONSUMER, attributes=attributes, links=links,
                                      start_time=_ns(min(run.job.enqueued_at, run.read_at)))
        if final.status != "done":
            span.set_status(self.trace_api.Status(self.trace_api.StatusCode.ERROR, final.error or final.status))
        span.end(_ns(now))

    def close(self) -> None:
        self.provider.shutdown()  # sends what the batch processor holds


class NoTracing:
    """Tracing off: nothing is kept and no OpenTelemetry module is imported."""

    def admitted(self, job: Job, attempt: int, read_at: float, admitted_at: float) -> None:
        pass

    def answered(self, final: Final) -> None:
        pass

    def close(self) -> None:
        pass


def tracing_endpoint(flag: str | None) -> str | None:
    """Where spans go: the flag, else the standard OTLP variables; None (off) also when OTEL_SDK_DISABLED is true."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    return flag or next((os.environ[v] for v in ENDPOINT_VARIABLES if os.environ.get(v)), None)


def make_provider(service: str, exporter: Any = None, endpoint: str | None = None) -> tuple[Any, PresetIds]:
    """A tracer provider sending to `exporter` (tests: the SDK's in-memory one), else OTLP over HTTP to `endpoint`,
    through a batch processor (OTEL_BSP_* tune it). OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES name the
    service, OTEL_TRACES_SAMPLER[_ARG] sample traces that no caller sampled already."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise SystemExit("tracing needs OpenTelemetry's SDK and OTLP exporter: pip install 'kvgate[tracing]'") from None
    if exporter is None:  # without a flag the exporter reads the OTEL_EXPORTER_OTLP_* variables itself
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter(endpoint=_traces_url(endpoint) if endpoint else None)
    ids = PresetIds()
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or service})
    provider = TracerProvider(resource=resource, id_generator=ids)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider, ids


def _traces_url(endpoint: str) -> str:
    """--otel-endpoint is the collector's base URL (http://collector:4318), as OTEL_EXPORTER_OTLP_ENDPOINT is; the
    traces path is added unless given."""
    return endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"


def job_tracing(endpoint_flag: str | None, worker_id: str, exporter: Any = None) -> JobTracing | NoTracing:
    """Spans for this worker's jobs where tracing is on (or an `exporter` is given), else NoTracing."""
    if tracing_endpoint(endpoint_flag) is None and exporter is None:
        return NoTracing()
    provider, ids = make_provider("kvgate-worker", exporter, endpoint_flag)
    return JobTracing(provider, ids, worker_id)
