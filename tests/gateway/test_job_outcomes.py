"""What happens to jobs behind a request: a client that hangs up cancels its job, and a job the worker
refuses becomes a 400 (whole answer) or an error event (stream) naming the worker's reason."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import redis

from kvgate.producer import Client

LONG = {"model": "simulated", "max_tokens": 50_000, "ignore_eos": True}


def _final_status(url: str, ns: str, job_id: str, timeout: float = 15.0) -> str:
    with Client(url, namespace=ns) as sdk:
        return sdk.attach(job_id).result(timeout=timeout).status


def test_a_client_that_hangs_up_mid_stream_cancels_its_job(sim_fleet, gateway):
    body = LONG | {"prompt": "tell me everything", "stream": True}
    with httpx.stream("POST", f"{gateway.base_url}/completions", json=body, timeout=30) as r:
        job_id = r.headers["x-request-id"]
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens are flowing
    assert any(line.startswith("data: {") for line in got)
    assert _final_status(*sim_fleet, job_id) == "cancelled"


def test_a_client_that_hangs_up_on_a_whole_answer_cancels_its_job(sim_fleet, gateway):
    r = redis.Redis.from_url(sim_fleet[0])
    before = set(r.scan_iter(match=f"{sim_fleet[1]}:cancel:*"))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.base_url}/completions", json=LONG | {"prompt": "never mind"}, timeout=0.5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        new = set(r.scan_iter(match=f"{sim_fleet[1]}:cancel:*")) - before
        if new:
            break
        time.sleep(0.05)
    assert len(new) == 1, "the job of a client that hung up was not cancelled"
    job_id = new.pop().decode().rsplit(":", 1)[1]
    assert _final_status(*sim_fleet, job_id) == "cancelled"


def test_a_job_the_worker_rejects_is_a_400_with_its_reason(gateway):
    # token 40000 is outside the simulated vocabulary of 32000: only the worker can tell
    r = httpx.post(f"{gateway.base_url}/completions", json={"model": "simulated", "prompt": [40000]}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "rejected_by_worker" and "40000" in error["message"]


def test_a_job_the_worker_rejects_mid_stream_is_an_error_event_then_done(gateway):
    body = {"model": "simulated", "prompt": [40000], "stream": True}
    r = httpx.post(f"{gateway.base_url}/completions", json=body, timeout=30)
    assert r.status_code == 200  # the headers went out before the worker answered
    events = r.content.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    error = json.loads(events[-3].removeprefix("data: "))["error"]
    assert error["code"] == "rejected_by_worker" and "40000" in error["message"]
    client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.APIError, match="40000"):
        list(client.completions.create(model="simulated", prompt=[40000], stream=True))
