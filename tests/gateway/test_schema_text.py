"""Issue 45.9: a schema given as JSON text nested 1,000 deep (`guided_json`, `structured_outputs.json`) was a 500
RecursionError and dropped the keep-alive connection: the body's depth limit never looked inside a string. Schema
text is parsed with the body's bounded parser: a 400 naming the field, and the connection serves the next request."""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest

NESTED_1000 = '{"a":' * 1000 + '{}' + '}' * 1000
USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("extra, param", [
    ({"guided_json": NESTED_1000}, "guided_json"),
    ({"structured_outputs": {"json": NESTED_1000}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": NESTED_1000}}},
     "response_format.json_schema.schema"),
])
def test_schema_text_nested_1000_deep_is_a_400_naming_the_field_on_a_connection_that_stays_open(gateway, extra,
                                                                                               param):
    url = urlsplit(gateway.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        body = json.dumps({"model": "simulated", "max_tokens": 3, "messages": USER, **extra})
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        answer = conn.getresponse()
        error = json.loads(answer.read())["error"]
        assert answer.status == 400, (answer.status, error)
        assert error["param"] == param and "nested too deeply" in error["message"], error
        conn.request("POST", "/v1/chat/completions", json.dumps({"model": "simulated", "max_tokens": 3,
                                                                 "messages": USER}),
                     {"Content-Type": "application/json"})
        again = conn.getresponse()  # the same connection: not dropped
        assert again.status == 200, again.read()
        assert json.loads(again.read())["choices"][0]["message"]["content"]
    finally:
        conn.close()
