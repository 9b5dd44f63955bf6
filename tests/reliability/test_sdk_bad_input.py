"""Hostile submit arguments at the SDK: each raises InvalidRequest naming the field and showing the value, before
anything reaches Redis. These are the cases tests/producer/test_validation.py does not already cover (it has 33
others: NaN/negative/inf temperature, top_p 1.5, 17 stop strings, lone surrogates, unknown priority, ...)."""
from __future__ import annotations

import math

import pytest

from kvgate.producer import Client, IdempotencyConflict, InvalidRequest
from kvgate.producer.keys import PRIORITIES

USER = {"role": "user", "content": "x"}


def _nested(levels: int) -> dict:
    schema: dict = {}
    for _ in range(levels):
        schema = {"a": schema}
    return schema


DEEP_SCHEMA = _nested(1000)
BAD = {
    "temperature above 100": ({"prompt": "x", "temperature": 101.0}, "temperature"),
    "top_p NaN": ({"prompt": "x", "top_p": math.nan}, "top_p"),
    "top_p negative": ({"prompt": "x", "top_p": -0.1}, "top_p"),
    "top_k a float": ({"prompt": "x", "top_k": 5.0}, "top_k"),
    "max_tokens a float": ({"prompt": "x", "max_tokens": 12.0}, "max_tokens"),
    "max_tokens None": ({"prompt": "x", "max_tokens": None}, "max_tokens"),
    "repetition_penalty 11": ({"prompt": "x", "repetition_penalty": 11.0}, "repetition_penalty"),
    "seed of 2**63": ({"prompt": "x", "seed": 2**63}, "seed"),
    "seed a float": ({"prompt": "x", "seed": 1.5}, "seed"),
    "priority in capitals": ({"prompt": "x", "priority": "HIGH"}, "priority"),
    "priority None": ({"prompt": "x", "priority": None}, "priority"),
    "a stop string that is an int": ({"prompt": "x", "stop": ["ok", 5]}, "stop.1"),
    "stop as a dict": ({"prompt": "x", "stop": {"a": 1}}, "stop"),
    "65 stop token ids": ({"prompt": "x", "stop_token_ids": list(range(65))}, "stop_token_ids"),
    "ignore_eos a string": ({"prompt": "x", "ignore_eos": "no"}, "ignore_eos"),
    "prompt a list": ({"prompt": ["a", "b"]}, "prompt"),
    "token id above int32": ({"prompt_token_ids": [1, 2**31]}, "prompt_token_ids.1"),
    "token ids that are bools": ({"prompt_token_ids": [True]}, "prompt_token_ids.0"),
    "512001 token ids": ({"prompt_token_ids": [1] * 512_001}, "prompt_token_ids"),
    "messages a string": ({"messages": "hello"}, "messages"),
    "257 messages": ({"messages": [USER] * 257}, "messages"),
    "a message without content": ({"messages": [{"role": "user"}]}, "messages.0.content"),
    "a message with an extra field": ({"messages": [{**USER, "nick": "bob"}]}, "messages.0.nick"),  # name is OpenAI's
    "a tool call on a user message": ({"messages": [{**USER, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages"),
    "message content an int": ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    "messages over the character limit together": ({"messages": [{"role": "user", "content": "x" * 200_000}] * 3},
                                                   "messages"),
    "metadata key an int": ({"prompt": "x", "metadata": {1: "v"}}, "metadata.1"),
    "metadata nested": ({"prompt": "x", "metadata": {"k": {"k": "v"}}}, "metadata.k"),
    "deadline NaN": ({"prompt": "x", "deadline": math.nan}, "deadline"),
    "deadline infinite": ({"prompt": "x", "deadline": math.inf}, "deadline"),
    "deadline and ttl_s both": ({"prompt": "x", "deadline": 4e9, "ttl_s": 5}, "deadline"),
    "ttl_s over 30 days": ({"prompt": "x", "ttl_s": 31 * 86400}, "ttl_s"),
    "idempotency key with a newline": ({"prompt": "x", "idempotency_key": "a\nb"}, "idempotency_key"),
    "idempotency key with a NUL": ({"prompt": "x", "idempotency_key": "a\x00b"}, "idempotency_key"),
    "empty idempotency key": ({"prompt": "x", "idempotency_key": ""}, "idempotency_key"),
    # issue 45.1: the SDK raised a bare RecursionError for these
    "a schema dict nested 1,000 deep": ({"prompt": "x", "response_format": DEEP_SCHEMA}, "response_format"),
    "tool parameters nested 1,000 deep": ({"messages": [USER], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": DEEP_SCHEMA}}]}, "tools"),
}


@pytest.fixture
def client(shared_redis, namespace):
    with Client(shared_redis.url, namespace) as c:
        yield c


def enqueued(client) -> int:
    r = client.redis
    return sum(r.xlen(client.keys.jobs(None, p)) for p in PRIORITIES) + len(r.keys(f"{client.keys.ns}:idem:*"))


@pytest.mark.parametrize("name", list(BAD))
def test_a_hostile_argument_raises_invalid_request_naming_it_and_nothing_is_enqueued(client, name):
    kwargs, field = BAD[name]
    with pytest.raises(InvalidRequest) as info:
        client.submit(**kwargs)
    assert info.value.field == field, (name, info.value.field, str(info.value))
    assert f"{field}=" in str(info.value) and "nothing was enqueued" in str(info.value)
    assert enqueued(client) == 0


def test_one_bad_request_in_a_batch_enqueues_none_of_it(client):
    good = {"prompt": "fine"}
    with pytest.raises(InvalidRequest) as info:
        client.submit_many([good, good, {"prompt": "x", "top_p": 2.0}, good], progress=False)
    assert info.value.field == "requests[2].top_p" and info.value.value == 2.0
    assert enqueued(client) == 0


def test_an_idempotency_key_reused_with_another_body_raises_and_enqueues_nothing_more(client):
    first = client.submit("the original", idempotency_key="order-99")
    with pytest.raises(IdempotencyConflict) as info:
        client.submit("a different body", idempotency_key="order-99")
    assert info.value.job_id == first.job_id and "order-99" in str(info.value)
    assert client.redis.xlen(client.keys.jobs(None, "normal")) == 1
