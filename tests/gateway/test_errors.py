"""Errors in OpenAI's shape with the right status: unsupported parameters, bad input, keys, models, backpressure."""
from __future__ import annotations

import time

import httpx
import openai
import pytest
import redis

from kvgate.producer import Client

CHAT = {"model": "simulated", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f", "parameters": {}}]),  # tools are honoured now; their deprecated spelling is not
    ("guided_decoding_backend", "xgrammar"),  # response_format and guided_* are honoured now (issue 25)
    ("suffix", "the end"),  # completions only (fill-in-the-middle of a prompt); chat has no prompt to fill
    ("no_such_parameter", 1),
])
def test_an_unsupported_parameter_is_a_400_that_names_it(gateway, field, value):
    err = _error(httpx.post(f"{gateway.base_url}/chat/completions", json=CHAT | {field: value}), 400)
    assert err["param"] == field and field in err["message"] and err["code"] == "unsupported_parameter"
    assert err["type"] == "invalid_request_error"


def test_no_op_values_of_unsupported_parameters_are_accepted(gateway):
    quiet = {"logprobs": False, "top_logprobs": 0, "tools": [], "n": 1,
             "response_format": {"type": "text"}, "user": "u-1", "store": False}
    r = httpx.post(f"{gateway.base_url}/chat/completions", json=CHAT | quiet, timeout=30)
    assert r.status_code == 200, r.text


def test_invalid_values_name_the_openai_field(gateway):
    cases = [({"max_tokens": 0}, "max_tokens"), ({"max_completion_tokens": -1}, "max_completion_tokens"),
             ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "n"),
             ({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
              "messages[0].content[0].type"),
             ({"stream_options": {"include_usage": True}}, "stream_options"),
             ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"presence_penalty": -3}, "presence_penalty"),
             ({"logprobs": 3}, "logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
             ({"top_logprobs": 2}, "top_logprobs")]
    for change, param in cases:
        err = _error(httpx.post(f"{gateway.base_url}/chat/completions", json=CHAT | change), 400)
        assert err["param"] == param, (change, err)
    err = _error(httpx.post(f"{gateway.base_url}/completions", json={"model": "simulated", "prompt": ""}), 400)
    assert err["param"] == "prompt"
    for bad in (-1, 21, True):
        err = _error(httpx.post(f"{gateway.base_url}/completions", json={"model": "simulated", "prompt": "x",
                                                                          "logprobs": bad}), 400)
        assert err["param"] == "logprobs" and "0 to 20" in err["message"], (bad, err)
    err = _error(httpx.post(f"{gateway.base_url}/chat/completions", json=CHAT | {"echo": True}), 400)
    assert err["param"] == "echo"  # completions' echo is honoured (issue 29); chat has none
    err = _error(httpx.post(f"{gateway.base_url}/chat/completions", content=b"{not json"), 400)
    assert err["code"] == "invalid_json"


def test_a_model_no_live_worker_serves_is_a_404_and_a_missing_model_a_400(gateway):
    err = _error(httpx.post(f"{gateway.base_url}/chat/completions", json=CHAT | {"model": "gpt-4o"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model" and "simulated" in err["message"]
    missing = {k: v for k, v in CHAT.items() if k != "model"}
    err = _error(httpx.post(f"{gateway.base_url}/chat/completions", json=missing), 400)
    assert err["param"] == "model"


def test_unknown_routes_are_404_in_the_same_shape(gateway):
    assert _error(httpx.get(f"{gateway.base_url}/moderations"), 404)["code"] == "not_found"
    assert _error(httpx.get(f"{gateway.base_url}/chat/completions"), 405)["code"] == "method_not_allowed"


def test_with_api_keys_a_missing_or_wrong_key_is_401_and_a_right_one_passes(sim_fleet, gateway_factory):
    gw = gateway_factory(*sim_fleet, api_keys=("key-one", "key-two"))
    err = _error(httpx.post(f"{gw.base_url}/chat/completions", json=CHAT), 401)
    assert err["code"] == "invalid_api_key"
    wrong = httpx.get(f"{gw.base_url}/models", headers={"Authorization": "Bearer key-three"})
    assert "key-three" not in _error(wrong, 401)["message"]  # a key is never echoed whole
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.base_url, api_key="nope", max_retries=0).models.list()
    good = openai.OpenAI(base_url=gw.base_url, api_key="key-two", max_retries=0)
    assert good.chat.completions.create(**CHAT).choices[0].message.content
    assert httpx.get(f"{gw.root}/health").status_code == 200  # load balancer probes need no key


def test_a_full_queue_is_a_429_with_retry_after(redis_server, gateway_factory):
    # no worker: jobs wait, so the backlog only grows
    ns = "gw-backpressure"
    gw = gateway_factory(redis_server.url, ns, max_backlog=2, retry_after_s=3, request_timeout_s=30,
                         models=("simulated",))  # allowed: accepted with no worker (scale from zero)
    with Client(redis_server.url, namespace=ns) as sdk:
        sdk.submit("one", max_tokens=1), sdk.submit("two", max_tokens=1)
    r = httpx.post(f"{gw.base_url}/chat/completions", json=CHAT)
    err = _error(r, 429)
    assert r.headers["retry-after"] == "3" and err["type"] == "rate_limit_error" and "2" in err["message"]
    with pytest.raises(openai.RateLimitError):
        openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0).chat.completions.create(**CHAT)
    r = redis.Redis.from_url(redis_server.url)  # the backlog counts every model's streams; nothing more was enqueued
    assert r.xlen(f"{ns}:jobs:default:normal") == 2 and r.xlen(f"{ns}:jobs:simulated:normal") == 0


def test_an_unanswered_job_is_a_504_and_is_cancelled(redis_server, gateway_factory):
    ns = "gw-timeout"
    gw = gateway_factory(redis_server.url, ns, request_timeout_s=0.5, models=("simulated",))
    r = httpx.post(f"{gw.base_url}/chat/completions", json=CHAT, timeout=30)
    assert _error(r, 504)["code"] == "timeout"
    r = redis.Redis.from_url(redis_server.url)
    deadline = time.monotonic() + 5
    while not list(r.scan_iter(match=f"{ns}:cancel:*")) and time.monotonic() < deadline:
        time.sleep(0.02)  # the cancel is sent by a task of its own, after the answer
    assert len(list(r.scan_iter(match=f"{ns}:cancel:*"))) == 1, "the abandoned job was not cancelled"


DEEP = b"[" * 100_000 + b"]" * 100_000  # the standard library's parser raised RecursionError: a 500
HUGE_INT = b'{"model": "simulated", "messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}"


@pytest.mark.parametrize("body", [DEEP, b'{"model": "simulated", "messages": ' + DEEP + b"}", HUGE_INT],
                         ids=["deep", "deep-inside", "5000-digit-int"])
def test_hostile_json_bodies_are_400s_that_say_why(gateway, body):
    for route in ("chat/completions", "completions", "batches"):
        err = _error(httpx.post(f"{gateway.base_url}/{route}", content=body), 400)
        assert err["code"] == "invalid_json" and err["param"] == "body", (route, err)
        assert any(why in err["message"] for why in ("nested too deeply", "out of range", "arrays or objects")), err


def test_an_upload_with_a_hostile_line_is_a_400_naming_the_line(gateway):
    good = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    r = httpx.post(f"{gateway.base_url}/files", data={"purpose": "batch"},
                   files={"file": ("in.jsonl", good + DEEP + b"\n")})
    err = _error(r, 400)
    assert err["code"] == "invalid_file" and "line 2" in err["message"] and "arrays or objects" in err["message"]
