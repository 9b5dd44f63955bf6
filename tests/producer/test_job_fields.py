"""The job's own submit-level fields (priority, deadline, model, tenant, task, ...) are declared once, on the wire's
`Job`, with their bounds and digest markers: the SDK's submit arguments for them, the worker's check of a decoded job
and the idempotency digest all read that declaration."""
from __future__ import annotations

import inspect
import math
import time

import msgspec
import pytest

from kvgate.producer import AsyncClient, Client, InvalidRequest
from kvgate.producer import protocol as wire
from kvgate.producer.fields import NEWER, NOT_DIGESTED, Checked
from kvgate.producer.request import JOB_ARGUMENTS, NOT_DIGESTED_FIELDS, SubmitRequest, build_job, validate_request

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
PROMPT, CHAT = {"prompt": "hi"}, {"messages": [{"role": "user", "content": "hi"}]}


def test_every_job_field_a_caller_gives_is_a_submit_argument_with_jobs_default_and_markers():
    assert {s.name for s in JOB_ARGUMENTS} == {
        "priority", "deadline", "stream", "idempotency_key", "metadata", "model", "tenant", "task",
        "add_special_tokens", "chat_template_kwargs", "add_generation_prompt", "tools", "suffix", "traceparent"}
    fields = SubmitRequest.model_fields
    for spec in JOB_ARGUMENTS:
        assert fields[spec.name].default == spec.default
        assert (NEWER in fields[spec.name].metadata) == spec.newer_than_digests
        assert (NOT_DIGESTED in fields[spec.name].metadata) == (not spec.digested)
        for client in (Client, AsyncClient):
            assert inspect.signature(client.submit).parameters[spec.name].default == spec.default


def test_a_digest_always_leaves_out_the_fields_marked_not_digested_and_only_them():
    assert set(NOT_DIGESTED_FIELDS) == {"idempotency_key", "deadline", "prefix_key", "tenant", "traceparent"}
    assert {s.name for s in wire.JOB_FIELDS if not s.digested} == {"idempotency_key", "deadline", "tenant",
                                                                    "traceparent"}
    plain = validate_request({"prompt": "hi"}).digest()
    assert validate_request({"prompt": "hi", "idempotency_key": "k", "deadline": time.time() + 60,
                             "prefix_key": "p", "tenant": "team-a", "traceparent": TRACEPARENT}).digest() == plain
    assert validate_request({"prompt": "hi", "priority": "low"}).digest() != plain


BAD = [("model", "a b", PROMPT), ("tenant", "-a", PROMPT), ("chat_template_kwargs", {"tokenize": True}, CHAT),
       ("metadata", {"k": "v" * 70_000}, PROMPT)]


@pytest.mark.parametrize("name, value, base", BAD, ids=[b[0] for b in BAD])
def test_a_field_the_wire_checks_is_refused_by_the_sdk_and_the_worker_with_one_reason(name, value, base):
    job = build_job(validate_request(base), "c")
    payload = wire.encode(msgspec.structs.replace(job, **{name: value}))
    with pytest.raises(wire.ProtocolError) as worker:
        wire.decode_job(payload)
    with pytest.raises(InvalidRequest) as sdk:
        validate_request({**base, name: value})
    [error] = sdk.value.errors
    spec = next(s for s in wire.JOB_FIELDS if s.name == name)
    assert isinstance(spec.bounds, Checked) and error.field == name
    assert str(worker.value) == spec.bounds.names.format(value=value) + error.reason


@pytest.mark.parametrize("name", ["enqueued_at", "deadline"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_time_that_is_no_finite_number_is_a_protocol_error_naming_it(name, value):
    job = msgspec.structs.replace(build_job(validate_request(PROMPT), "c"), **{name: value})
    with pytest.raises(wire.ProtocolError, match=f"^{name}={value} must be a finite number of unix seconds$"):
        wire.decode_job(wire.encode(job))
