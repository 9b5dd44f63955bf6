"""`--request-timeout` on a stream bounds the wait for the first token and the silence between tokens, never a stream
whose tokens are still flowing (issue 26.9)."""
from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from tests.gateway.conftest import stop_worker, wait_for_workers
from tests.support import spawn_worker

STEP_MS = 40  # one token per step: 30 tokens take 1.2 s or more, several times the timeout below
TOKENS = 30
TIMEOUT_S = 0.4


@pytest.fixture(scope="module")
def slow_fleet(shared_redis):
    ns = f"slow{os.getpid()}-{abs(hash(time.monotonic())) % 10**6}"
    proc = spawn_worker(shared_redis.url, ns, "--simulated", "--sim-step-ms", str(STEP_MS), "--sim-per-token-ms",
                        "0", "--max-num-seqs", "4", worker_id="sim-slow")
    try:
        wait_for_workers(shared_redis.url, ns, proc=proc)
        yield shared_redis.url, ns
    finally:
        stop_worker(proc)


def _chunks(raw: bytes) -> list[dict | str]:
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    return [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]


def test_a_stream_still_producing_tokens_past_the_request_timeout_completes(slow_fleet, gateway_factory):
    gw = gateway_factory(*slow_fleet, request_timeout_s=TIMEOUT_S)
    body = {"model": "simulated", "messages": [{"role": "user", "content": "keep going"}], "max_tokens": TOKENS,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.monotonic()
    r = httpx.post(f"{gw.base_url}/chat/completions", json=body, timeout=60)
    took = time.monotonic() - start
    chunks = _chunks(r.content)
    errors = [c for c in chunks if isinstance(c, dict) and "error" in c]
    tokens = [c for c in chunks if isinstance(c, dict) and c.get("choices") and c["choices"][0]["delta"].get("content")]
    assert not errors, f"cut after {len(tokens)} token chunks and {took:.2f} s: {errors[0]}"
    assert took > TIMEOUT_S  # the stream did outlast the timeout
    assert chunks[-1] == "[DONE]" and len(tokens) == TOKENS
    assert chunks[-2]["usage"]["completion_tokens"] == TOKENS


def test_a_stream_whose_first_token_never_comes_ends_with_a_timeout_error_at_the_request_timeout(
        slow_fleet, gateway_factory):
    """No worker serves the model the operator allowed: the wait for the first token is what the timeout bounds."""
    gw = gateway_factory(*slow_fleet, request_timeout_s=TIMEOUT_S, models=("nobody-serves-this",))
    body = {"model": "nobody-serves-this", "messages": [{"role": "user", "content": "hello?"}], "max_tokens": 2,
            "stream": True}
    r = httpx.post(f"{gw.base_url}/chat/completions", json=body, timeout=60)
    chunks = _chunks(r.content)
    assert chunks[-1] == "[DONE]"
    error = chunks[-2]["error"]
    assert error["code"] == "timeout" and error["type"] == "timeout_error", error
