"""vLLM's server routes beside the OpenAI ones: GET /version, GET /metrics (the gateway's own Prometheus metrics),
POST /tokenize and /detokenize (answered by a serving worker's own tokenizer), through raw HTTP."""
from __future__ import annotations

import httpx
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
