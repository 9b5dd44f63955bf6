"""decode_job either returns a Job that passes every wire check or raises ProtocolError: never another exception,
whatever the bytes. And the worker's best-effort `identify` of a rejected payload never raises at all."""
from __future__ import annotations

import math
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.producer.limits import MAX_PAYLOAD_BYTES
from kvgate.producer.protocol import Job, ProtocolError, decode_job, encode, validate_job
from kvgate.worker.intake import identify

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

VALID = {"v": 1, "job_id": "j" * 32, "client_id": "c" * 22, "enqueued_at": 1.7e9, "prompt": "hello",
         "sampling": {"max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "stop": ["\n"]},
         "priority": "normal", "stream": True, "metadata": {"k": "v"}}
FIELDS = [*VALID, "messages", "prompt_token_ids", "deadline", "idempotency_key"]
SAMPLING_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "stop", "stop_token_ids",
                   "ignore_eos", "seed"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, -0.0, 1e308]),
    st.text(max_size=40), st.binary(max_size=40), st.sampled_from(["high", "urgent", "user", "wizard", ""]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=10), inner, max_size=5)),
                      max_leaves=20)


def check(data: bytes) -> None:
    try:
        job = decode_job(data)
    except ProtocolError:
        pass
    else:
        assert isinstance(job, Job)
        validate_job(job)  # what decode accepted passes every check again
        assert encode(decode_job(encode(job))) == encode(job)  # as bytes: a NaN field is equal to itself there
    identify(data)  # must not raise


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes_decode_to_a_valid_job_or_a_protocol_error(data):
    check(data)


@FUZZ
@given(st.sampled_from(FIELDS), values)
def test_one_field_replaced_by_any_value_decodes_or_is_a_protocol_error(name, value):
    check(msgspec.msgpack.encode({**VALID, name: value}))


@FUZZ
@given(st.sampled_from(SAMPLING_FIELDS), values)
def test_one_sampling_setting_replaced_by_any_value_decodes_or_is_a_protocol_error(name, value):
    check(msgspec.msgpack.encode({**VALID, "sampling": {**VALID["sampling"], name: value}}))


@FUZZ
@given(st.sets(st.sampled_from(FIELDS)), st.dictionaries(st.text(max_size=12), values, max_size=3))
def test_fields_dropped_and_unknown_ones_added_decode_or_are_a_protocol_error(dropped, extra):
    body = {k: v for k, v in VALID.items() if k not in dropped}
    check(msgspec.msgpack.encode({**body, **extra}))


@FUZZ
@given(st.data())
def test_a_valid_payload_with_bytes_flipped_inserted_or_cut_decodes_or_is_a_protocol_error(data):
    raw = bytearray(msgspec.msgpack.encode(VALID))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        action = data.draw(st.sampled_from(["flip", "insert", "cut"]))
        if action == "flip":
            raw[at] ^= data.draw(st.integers(1, 255))
        elif action == "insert":
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        elif len(raw) > 1:
            del raw[at]
    check(bytes(raw))


@pytest.mark.parametrize("name", FIELDS + ["sampling.stop", "messages.0"])
def test_a_nesting_bomb_in_any_field_is_a_protocol_error(name):
    bomb = msgspec.Raw(b"\x91" * 100_000 + b"\xc0")  # 100k nested arrays
    body = dict(VALID)
    if name == "sampling.stop":
        body["sampling"] = {**VALID["sampling"], "stop": bomb}
    elif name == "messages.0":
        body = {**{k: v for k, v in VALID.items() if k != "prompt"}, "messages": [bomb]}
    else:
        body[name] = bomb
    with pytest.raises(ProtocolError):
        decode_job(msgspec.msgpack.encode(body))
    identify(msgspec.msgpack.encode(body))


def test_huge_length_headers_are_a_protocol_error_without_allocating():
    started = time.monotonic()
    for header in (b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff"):
        with pytest.raises(ProtocolError):
            decode_job(header)
    with pytest.raises(ProtocolError, match="over the limit"):
        decode_job(b"\x00" * (MAX_PAYLOAD_BYTES + 1))
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("name", ["enqueued_at", "deadline"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_time_that_is_not_a_finite_number_is_a_protocol_error_naming_the_field(name, value):
    with pytest.raises(ProtocolError, match=name):
        decode_job(msgspec.msgpack.encode({**VALID, name: value}))
