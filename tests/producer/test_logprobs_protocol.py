"""Logprobs and OpenAI penalties on the wire: round trips, range checks that name the field, no cost for jobs
that do not ask, and the stream's closing items carrying the logprobs of the tokens they add."""
from __future__ import annotations

import math

import msgspec
import pytest

from kvgate.producer import InvalidRequest
from kvgate.producer.protocol import (PROTOCOL_VERSION, Delta, Final, Job, ProtocolError, Sampling, TokenLogprob,
                                      TopLogprob, decode_event, decode_job, encode, validate_sampling)
from kvgate.producer.request import build_job, validate_request
from kvgate.producer.stream import Restart, closing_items


def _token(i: int, text: str, lp: float, top: int = 2) -> TokenLogprob:
    return TokenLogprob(i, text, text.encode(), lp, [TopLogprob(i + k, f"{text}{k}", b"\xe2", lp - k)
                                                     for k in range(top)])


def test_sampling_with_penalties_and_logprobs_round_trips_through_a_job():
    job = Job(v=1, job_id="j", client_id="c", enqueued_at=1.0, prompt="hi",
              sampling=Sampling(frequency_penalty=0.5, presence_penalty=-1.25, logprobs=5))
    back = decode_job(encode(job))
    assert (back.sampling.frequency_penalty, back.sampling.presence_penalty, back.sampling.logprobs) == (0.5, -1.25, 5)


def test_a_job_that_asks_for_none_of_them_encodes_as_before():
    # the same map: with more than 15 fields msgspec writes its header as map16 (0xde), which every reader reads alike
    assert msgspec.msgpack.decode(encode(Sampling())) == {}
    assert msgspec.msgpack.decode(encode(Sampling(logprobs=0))) == {"logprobs": 0}  # 0 asks: chosen token only


def test_final_and_delta_logprobs_round_trip_with_raw_bytes():
    tokens = [_token(7, " Paris", -0.25), _token(9, "\ufffd", -1.5, top=0)]
    tokens[1].utf8 = b"\xe6\x97"  # part of a character: its bytes are not UTF-8 on their own
    final = Final(v=PROTOCOL_VERSION, job_id="j", status="done", text=" Paris", token_ids=[7, 9], logprobs=tokens)
    assert decode_event(encode(final)).logprobs == tokens
    delta = Delta(PROTOCOL_VERSION, "j", 0, " Paris", [7], logprobs=tokens[:1])
    assert decode_event(encode(delta)).logprobs == tokens[:1]
    assert decode_event(encode(Final(v=PROTOCOL_VERSION, job_id="j", status="done"))).logprobs is None


def test_an_event_over_the_job_payload_limit_is_still_read():
    # top-20 logprobs of a long answer run to megabytes; only jobs keep the 1 MiB limit
    tokens = [_token(i, " word", -1.0, top=20) for i in range(3000)]
    data = encode(Final(v=PROTOCOL_VERSION, job_id="j", status="done", token_ids=list(range(3000)), logprobs=tokens))
    assert len(data) > 1 << 20
    assert len(decode_event(data).logprobs) == 3000


@pytest.mark.parametrize("change, named", [
    ({"frequency_penalty": 2.5}, "frequency_penalty=2.5"),
    ({"presence_penalty": -2.01}, "presence_penalty=-2.01"),
    ({"frequency_penalty": math.nan}, "frequency_penalty=nan"),
    ({"logprobs": 21}, "logprobs=21"),
    ({"logprobs": -1}, "logprobs=-1"),
])
def test_out_of_range_values_are_protocol_errors_that_name_the_field(change, named):
    with pytest.raises(ProtocolError, match=named):
        validate_sampling(Sampling(**change))


def test_edges_of_the_ranges_are_valid():
    validate_sampling(Sampling(frequency_penalty=-2.0, presence_penalty=2.0, logprobs=20))
    validate_sampling(Sampling(logprobs=0))


@pytest.mark.parametrize("name, value", [("frequency_penalty", 3.0), ("presence_penalty", -9), ("logprobs", 21),
                                         ("logprobs", True), ("logprobs", 1.5)])
def test_the_sdk_refuses_bad_values_naming_the_argument(name, value):
    with pytest.raises(InvalidRequest) as info:
        validate_request({"prompt": "hi", name: value})
    assert [e.field for e in info.value.errors] == [name]


def test_the_sdk_puts_the_arguments_on_the_wire():
    req = validate_request({"prompt": "hi", "frequency_penalty": 1.0, "presence_penalty": 0.5, "logprobs": 3})
    s = build_job(req, "client").sampling
    assert (s.frequency_penalty, s.presence_penalty, s.logprobs) == (1.0, 0.5, 3)


def test_closing_items_carry_the_logprobs_of_the_tokens_they_add():
    tokens = [_token(1, "a", -0.1), _token(2, "b", -0.2), _token(3, "c", -0.3)]
    streamed = [Delta(PROTOCOL_VERSION, "j", 0, "a", [1], logprobs=tokens[:1])]
    final = Final(v=PROTOCOL_VERSION, job_id="j", status="done", text="abc", token_ids=[1, 2, 3], logprobs=tokens)
    (tail,) = closing_items(streamed, final)
    assert tail.token_ids == [2, 3] and tail.logprobs == tokens[1:]
    other = Final(v=PROTOCOL_VERSION, job_id="j", status="done", text="xyz", token_ids=[4, 5, 6], logprobs=tokens,
                  attempt=2)
    restart, whole = closing_items(streamed, other)
    assert isinstance(restart, Restart) and whole.logprobs == tokens
