"""vLLM's server routes beside the OpenAI ones: GET /version, GET /metrics (the gateway's own Prometheus metrics),
POST /tokenize and /detokenize (answered by a serving worker's own tokenizer), through raw HTTP."""
from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvgate

CHAT = {"model": "default", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


def samples(root: str) -> dict[tuple[str, tuple], float]:
    """GET /metrics as {(sample name, sorted labels): value}."""
    got = httpx.get(f"{root}/metrics", timeout=30)
    assert got.status_code == 200 and got.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(got.text) for s in family.samples}


def test_version_answers_the_installed_kvgate_version_in_vllms_shape(gateway):
    got = httpx.get(f"{gateway.root}/version", timeout=30)
    assert got.status_code == 200 and got.json() == {"version": kvgate.__version__}


def test_metrics_count_requests_by_route_template_and_status_and_time_streams(gateway):
    root = gateway.root
    before = samples(root)
    with httpx.Client(base_url=root, timeout=60) as http:
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
        with http.stream("POST", "/v1/chat/completions", json=CHAT | {"stream": True}) as streamed:
            assert streamed.status_code == 200 and b"[DONE]" in b"".join(streamed.iter_bytes())
        assert http.post("/v1/chat/completions", json=CHAT | {"model": "no-such-model"}).status_code == 404
        for file_id in ("file-a", "file-b", "file-c"):  # three ids, one route template
            assert http.get(f"/v1/files/{file_id}").status_code == 404
        assert http.get("/no/such/route").status_code == 404
    after = samples(root)

    def grew(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("kvgate_gateway_requests_total", route="/v1/chat/completions", status="200") == 2
    assert grew("kvgate_gateway_requests_total", route="/v1/chat/completions", status="404") == 1
    assert grew("kvgate_gateway_requests_total", route="/v1/files/{file_id}", status="404") == 3
    assert grew("kvgate_gateway_requests_total", route="unmatched", status="404") == 1
    assert grew("kvgate_gateway_request_duration_seconds_count", route="/v1/chat/completions") == 3
    assert grew("kvgate_gateway_time_to_first_token_seconds_count", route="/v1/chat/completions") == 1
    assert after[("kvgate_gateway_open_streams", ())] == 0
    assert after[("kvgate_gateway_requests_in_flight", ())] == 1  # the scrape itself
    routes = {dict(labels).get("route") for (name, labels) in after if name.startswith("kvgate_gateway_")}
    assert not any("file-" in r for r in routes if r), f"an id became a label value: {sorted(filter(None, routes))}"
    assert not any({"tenant", "model"} & dict(labels).keys() for (_, labels) in after), "unbounded label"


# -- /tokenize and /detokenize: the shapes, against the simulated worker's tokenizer (the engine's own object) -------
def sim_tokenizer():
    from kvgate.engine.cost_model_runner import SimulatedTokenizer

    return SimulatedTokenizer(32000)  # `kvgate worker --simulated` keeps SimulatedEngine's vocab_size


def test_tokenize_answers_vllms_shape_from_the_serving_workers_tokenizer(gateway):
    tok = sim_tokenizer()
    with httpx.Client(base_url=gateway.root, timeout=60) as http:
        got = http.post("/tokenize", json={"model": "default", "prompt": "the cat sat on the mat"})
        assert got.status_code == 200, got.text
        expected = tok.encode("the cat sat on the mat")
        assert got.json() == {"count": len(expected), "max_model_len": 4096, "tokens": expected, "token_strs": None}
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
        chat = http.post("/tokenize", json={"model": "default", "messages": messages}).json()
        templated = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert chat["tokens"] == tok.encode(templated, add_special_tokens=False)
        assert chat["count"] == len(chat["tokens"]) == 7
        back = http.post("/detokenize", json={"model": "default", "tokens": expected})
        assert back.status_code == 200 and back.json() == {"prompt": tok.decode(expected)}


def test_tokenize_refuses_unknown_models_and_bad_bodies_in_openais_shape(gateway):
    with httpx.Client(base_url=gateway.root, timeout=60) as http:
        missing = http.post("/tokenize", json={"model": "no-such-model", "prompt": "hi"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert http.post("/detokenize", json={"model": "no-such-model", "tokens": [1]}).status_code == 404
        for body, param in [({"model": "default"}, "prompt"),
                            ({"model": "default", "prompt": 7}, "prompt"),
                            ({"model": "default", "prompt": "hi", "colour": "red"}, "colour"),
                            ({"model": "default", "messages": [{"role": "user", "content": "hi"}],
                              "add_generation_prompt": False}, "add_generation_prompt"),
                            ({"model": "default", "messages": [{"role": "user", "content": "hi"}],
                              "chat_template": "{{ messages }}"}, "chat_template"),
                            ({"model": "default", "prompt": "hi", "return_token_strs": True}, "return_token_strs")]:
            got = http.post("/tokenize", json=body)
            error = got.json()["error"]
            assert got.status_code == 400 and error["type"] == "invalid_request_error", (body, got.text)
            assert error["param"] == param, (body, error)
        for body, param in [({"model": "default", "tokens": [-1]}, "tokens.0"),
                            ({"model": "default", "tokens": []}, "tokens"),
                            ({"model": "default", "tokens": "1 2"}, "tokens")]:
            got = http.post("/detokenize", json=body)
            assert got.status_code == 400 and got.json()["error"]["param"] == param, (body, got.text)
        not_json = http.post("/tokenize", content=b"{nope", headers={"content-type": "application/json"})
        assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"


def test_tokenize_needs_a_key_and_waits_as_the_keys_tenants_high_priority_job_while_version_and_metrics_stay_open(
        shared_redis, gateway_factory):
    """A model no worker serves yet (scale from zero): the tokenize job waits in the queue like any job, as the
    key's tenant's, at high priority, and the request ends at the request timeout with the 504 of a generation; it
    counts against --max-backlog (then 429), and /metrics counts both answers under the route."""
    import redis

    from kvgate.producer.keys import Keys
    from kvgate.producer.protocol import FIELD, decode_job

    ns = f"tok{time.monotonic_ns() % 10**9}"
    gw = gateway_factory(shared_redis.url, ns, api_keys=["sk-tok-0001=team-t"], models=["cold"], request_timeout_s=1,
                         max_backlog=1)
    with httpx.Client(base_url=gw.root, timeout=60) as http:
        assert http.get("/version").status_code == 200 and http.get("/metrics").status_code == 200
        refused = http.post("/tokenize", json={"model": "cold", "prompt": "hello world"})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "invalid_request_error"
        waited = http.post("/tokenize", json={"model": "cold", "prompt": "hello world"},
                           headers={"Authorization": "Bearer sk-tok-0001"})
        assert waited.status_code == 504 and waited.json()["error"]["code"] == "timeout", waited.text
        full = http.post("/tokenize", json={"model": "cold", "prompt": "again"},
                         headers={"Authorization": "Bearer sk-tok-0001"})  # the waiting job fills --max-backlog 1
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        counted = samples(gw.root)
    assert counted[("kvgate_gateway_requests_total", (("route", "/tokenize"), ("status", "429")))] == 1
    assert counted[("kvgate_gateway_requests_total", (("route", "/tokenize"), ("status", "504")))] == 1
    r = redis.Redis.from_url(shared_redis.url)
    try:
        entries = r.xrange(Keys(ns).jobs("cold", "high"))
    finally:
        r.close()
    assert len(entries) == 1
    job = decode_job(entries[0][1][FIELD.encode()])
    assert (job.task, job.tenant, job.prompt, job.model) == ("tokenize", "team-t", "hello world", "cold")
    assert job.deadline is not None and job.deadline - job.enqueued_at == pytest.approx(1.0)
