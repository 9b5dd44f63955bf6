"""Every bad submit argument raises InvalidRequest naming the field and the value, and enqueues nothing."""
from __future__ import annotations

import math
import time

import pytest

from kvgate.producer import InvalidRequest
from kvgate.producer.keys import PRIORITIES

BAD = [
    ("temperature", {"prompt": "x", "temperature": math.nan}, math.nan),
    ("temperature", {"prompt": "x", "temperature": -0.5}, -0.5),
    ("temperature", {"prompt": "x", "temperature": math.inf}, math.inf),
    ("temperature", {"prompt": "x", "temperature": True}, True),
    ("top_p", {"prompt": "x", "top_p": 1.5}, 1.5),
    ("top_p", {"prompt": "x", "top_p": 0.0}, 0.0),
    ("top_k", {"prompt": "x", "top_k": 0}, 0),
    ("top_k", {"prompt": "x", "top_k": -7}, -7),
    ("repetition_penalty", {"prompt": "x", "repetition_penalty": 0}, 0),
    ("max_tokens", {"prompt": "x", "max_tokens": 10**9}, 10**9),
    ("max_tokens", {"prompt": "x", "max_tokens": 0}, 0),
    ("max_tokens", {"prompt": "x", "max_tokens": "12"}, "12"),
    ("priority", {"prompt": "x", "priority": "urgent"}, "urgent"),
    ("stop", {"prompt": "x", "stop": ["s"] * 17}, ["s"] * 17),
    ("stop.0", {"prompt": "x", "stop": "s" * 300}, "s" * 300),
    ("stop.0", {"prompt": "x", "stop": [""]}, ""),
    ("stop_token_ids.0", {"prompt": "x", "stop_token_ids": [-1]}, -1),
    ("prompt", {"prompt": "x" * 600_000}, "x" * 600_000),
    ("prompt", {"prompt": ""}, ""),
    ("prompt", {"prompt": "bad \ud800 surrogate"}, "bad \ud800 surrogate"),
    ("prompt", {"prompt": b"bytes are not text"}, b"bytes are not text"),
    ("messages.0.content", {"messages": [{"role": "user", "content": "\udcff"}]}, "\udcff"),
    ("messages.0.role", {"messages": [{"role": "wizard", "content": "hi"}]}, "wizard"),
    ("messages", {"messages": []}, []),
    ("prompt_token_ids.1", {"prompt_token_ids": [1, -2]}, -2),
    ("seed", {"prompt": "x", "seed": -1}, -1),
    ("ttl_s", {"prompt": "x", "ttl_s": -1}, -1),
    ("ttl_s", {"prompt": "x", "ttl_s": math.nan}, math.nan),
    ("metadata.k", {"prompt": "x", "metadata": {"k": 1}}, 1),
    ("metadata", {"prompt": "x", "metadata": {"k": "v" * 20_000}}, {"k": "v" * 20_000}),
    ("idempotency_key", {"prompt": "x", "idempotency_key": "has space"}, "has space"),
    ("idempotency_key", {"prompt": "x", "idempotency_key": "k" * 201}, "k" * 201),
    ("stream", {"prompt": "x", "stream": "yes"}, "yes"),
]


@pytest.mark.parametrize("field,kwargs,value", BAD, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BAD)])
def test_bad_argument_raises_invalid_request_naming_field_and_value(client, redis_server, keys, field, kwargs, value):
    with pytest.raises(InvalidRequest) as info:
        client.submit(**kwargs)
    err = info.value
    assert err.field == field
    assert err.value == value or (isinstance(value, float) and math.isnan(value) and math.isnan(err.value))
    assert field in str(err) and "nothing was enqueued" in str(err)
    assert isinstance(err, ValueError)
    r = redis_server.client()
    assert sum(r.xlen(keys.jobs(None, p)) for p in PRIORITIES) == 0


def test_deadline_in_the_past_is_rejected_naming_deadline(client):
    past = time.time() - 10
    with pytest.raises(InvalidRequest) as info:
        client.submit("x", deadline=past)
    assert info.value.field == "deadline" and info.value.value == past and "in the past" in str(info.value)


@pytest.mark.parametrize("kwargs", [{}, {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}])
def test_exactly_one_of_prompt_messages_token_ids_is_required(client, kwargs):
    with pytest.raises(InvalidRequest, match="exactly one of prompt, messages, prompt_token_ids"):
        client.submit(**kwargs)


def test_unknown_argument_in_submit_many_is_named_with_its_index(client, redis_server, keys):
    with pytest.raises(InvalidRequest) as info:
        client.submit_many([{"prompt": "ok"}, {"prompt": "x", "temprature": 0.5}], progress=False)
    assert info.value.field == "requests[1].temprature" and "spelling" in str(info.value)
    assert redis_server.client().xlen(keys.jobs(None, "normal")) == 0  # the valid first one was not enqueued either
