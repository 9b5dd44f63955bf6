"""The caller's trace, carried in the job: where the application traces with OpenTelemetry, each submit runs in a
`kvgate.enqueue` span (kind PRODUCER) under the caller's current span, and the job's `traceparent` names that span,
so the worker's spans for the job (worker/tracing.py) join the caller's trace.

The SDK needs only `opentelemetry-api`, and only if it is installed: without it, or with no tracer provider set (the
API's default does nothing), there is no span and no traceparent, and a job submitted with an explicit
`traceparent=` keeps it."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

TRACER_NAME = "kvgate"


@functools.cache
def _api() -> Any:
    """OpenTelemetry's trace API, imported at the first submit (40 ms), or None where it is not installed."""
    try:  # an optional dependency: the SDK itself never needs it
        from opentelemetry import trace
    except ImportError:
        return None
    return trace


def traceparent_of(span_context: Any) -> str | None:
    """The W3C traceparent of an OpenTelemetry SpanContext; None for an invalid (no-op) one."""
    if span_context is None or not span_context.is_valid:
        return None
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{int(span_context.trace_flags):02x}"


def current_traceparent() -> str | None:
    """The traceparent of the caller's current span, if OpenTelemetry is installed and a span is recording."""
    trace = _api()
    return None if trace is None else traceparent_of(trace.get_current_span().get_span_context())


@contextlib.contextmanager
def enqueue_span() -> Iterator[None]:
    """A `kvgate.enqueue` span around a submit, current while its jobs are built (so their traceparent names it).
    Without OpenTelemetry, or with no tracer provider set, nothing: the caller's own span, if any, stays current."""
    trace = _api()
    if trace is None:
        yield
        return
    span = trace.get_tracer(TRACER_NAME).start_span(
        "kvgate.enqueue", kind=trace.SpanKind.PRODUCER,
        attributes={"messaging.system": "redis", "messaging.operation.type": "send"})
    if not span.get_span_context().is_valid:  # the API's no-op tracer
        yield
        return
    with trace.use_span(span, end_on_exit=True):
        yield
