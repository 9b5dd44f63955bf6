"""Hostile bodies (issue 26.3) and CORS: every oversized or costly body is a 4xx in OpenAI's shape, answered as soon
as it is over the limit (from its Content-Length, or while a chunked body streams in), and none holds the event loop.

The raw-socket tests send a request's head and part of its body and then wait for the answer without sending the
rest: a server that reads a body to its end before refusing it never answers them."""
from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

MiB = 1 << 20
LIMIT = 8 * MiB  # GatewaySettings.max_body_bytes' default
TOKENS_50MB = b'{"model": "simulated", "max_tokens": 1, "prompt": [' + b"7," * 25_000_000 + b"7]}"


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:500]
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _answer_while_sending(root: str, head: bytes, parts: list[bytes], wait_s: float = 15.0) -> tuple[int, dict]:
    """Send `head` and then `parts` (in a thread: the server may stop reading), never the end of the body; the
    status and JSON body of the answer that comes back meanwhile. Fails when none comes within `wait_s`."""
    host, port = root.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(wait_s)

    def send():
        try:
            sock.sendall(head)
            for part in parts:
                sock.sendall(part)
        except OSError:
            pass  # the server answered and closed

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"the connection closed with no answer: {data!r}"
            data += chunk
        head_text, _, rest = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head_text.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        while len(rest) < length:
            rest += sock.recv(65536)
    except socket.timeout:
        pytest.fail(f"no answer within {wait_s} s while the body was still unfinished (the server waits for its end)")
    finally:
        sock.close()
    return int(head_text.split(b" ")[1]), json.loads(rest[:length])


def _head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _chunked(data: bytes, size: int = MiB) -> list[bytes]:
    return [b"%x\r\n" % len(data[i:i + size]) + data[i:i + size] + b"\r\n" for i in range(0, len(data), size)]


def test_a_body_declared_over_the_limit_is_a_413_before_any_of_it_is_read(gateway):
    head = _head("/v1/completions", {"Content-Type": "application/json", "Content-Length": str(len(TOKENS_50MB))})
    status, body = _answer_while_sending(gateway.root, head, [])
    assert status == 413, body
    err = body["error"]
    assert err["code"] == "request_too_large" and str(LIMIT) in err["message"] and "--max-body-size" in err["message"]


def test_a_chunked_body_is_cut_off_at_the_limit_with_a_413(gateway):
    head = _head("/v1/chat/completions", {"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    status, body = _answer_while_sending(gateway.root, head, _chunked(TOKENS_50MB[:LIMIT + 2 * MiB]))
    assert status == 413 and body["error"]["code"] == "request_too_large", body


def test_a_chunked_upload_over_max_file_size_is_a_413_as_soon_as_it_passes_it(sim_fleet, gateway_factory):
    gw = gateway_factory(*sim_fleet, max_file_bytes=MiB)
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    form = (b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B\r\n'
            b'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\n" + line * (3 * MiB // len(line)))  # no closing boundary
    head = _head("/v1/files", {"Content-Type": "multipart/form-data; boundary=B", "Transfer-Encoding": "chunked"})
    status, body = _answer_while_sending(gw.root, head, _chunked(form, 256 * 1024))
    assert status == 413, body
    assert body["error"]["code"] == "request_too_large" and "--max-file-size" in body["error"]["message"], body
    files = httpx.get(f"{gw.base_url}/files").json()["data"]
    assert files == [], "nothing of the refused upload is stored"


def test_a_body_of_too_many_arrays_or_values_is_a_400_that_says_so(gateway):
    lists = b'{"model": "simulated", "prompt": [' + b"[]," * (LIMIT // 4) + b"[]]}"
    err = _error(httpx.post(f"{gateway.base_url}/completions", content=lists, timeout=60), 400)
    assert err["code"] == "invalid_json" and "arrays or objects" in err["message"], err
    ints = b'{"model": "simulated", "prompt": [' + b"7," * (LIMIT // 3) + b"7]}"
    err = _error(httpx.post(f"{gateway.base_url}/completions", content=ints, timeout=60), 400)
    assert err["code"] == "invalid_json" and "values" in err["message"], err


def test_prompt_token_ids_are_bounded_per_request_with_its_n_copies(gateway):
    body = {"model": "simulated", "max_tokens": 1, "prompt": [7] * 512_000}  # as many as a job may hold
    err = _error(httpx.post(f"{gateway.base_url}/completions", json=body, timeout=60), 400)
    assert err["param"] == "prompt" and "512000, over" in err["message"] and "131072" in err["message"], err
    # n copies of a prompt within the limit: each copy is checked and encoded again on the event loop
    err = _error(httpx.post(f"{gateway.base_url}/completions", json=body | {"prompt": [7] * 10_000, "n": 16},
                            timeout=60), 400)
    assert err["param"] == "n" and "make 160000" in err["message"] and "--max-prompt-token-ids" in err["message"], err


# Sends hostile bodies all at once from a process of its own (a client in the gateway's process would hold the GIL
# the gateway's loop needs) and prints each answer's route, status and error keys as JSON.
HOSTILE_CLIENT = r"""
import json, sys
from concurrent.futures import ThreadPoolExecutor
import httpx
base, near_limit = sys.argv[1], int(sys.argv[2]) - 4096
tokens = b'{"model": "simulated", "max_tokens": 1, "prompt": [' + b"7," * 25_000_000 + b"7]}"  # 50 MB
ids = json.dumps([7] * 131_072).encode()  # the longest prompt a request may hold (--max-prompt-token-ids)
hostile = [
    ("completions", tokens),
    ("completions", iter([tokens[i:i + (1 << 20)] for i in range(0, len(tokens), 1 << 20)])),  # chunked
    ("completions", b'{"model": "simulated", "prompt": [' + b"[]," * (near_limit // 3) + b"[]]}"),
    ("completions", b'{"model": "simulated", "prompt": [' + b"7," * (near_limit // 2) + b"7]}"),
    ("chat/completions", b'{"model": "simulated", "messages": [' + b"{}," * (near_limit // 3) + b"{}]}"),
    ("completions", b'{"model": "simulated", "max_tokens": 1, "prompt": ' + ids + b"}"),
    ("completions", b'{"model": "simulated", "max_tokens": 1, "n": 16, "prompt": ' + ids + b"}"),
    ("completions", b'{"model": "simulated", "max_tokens": 1, "prompt": ' + json.dumps([7] * 512_000).encode() + b"}"),
    ("completions", b"[" * 100_000 + b"]" * 100_000),
]
def post(item):
    route, content = item
    try:
        r = httpx.post(f"{base}/{route}", content=content, timeout=120)
        return [route, r.status_code, sorted(r.json().get("error", {}))]
    except httpx.TransportError as e:  # a client may see its connection end before it sent everything
        return [route, repr(e), []]
with ThreadPoolExecutor(len(hostile)) as pool:
    print(json.dumps(list(pool.map(post, hostile))))
"""


class LoopProbe:
    """On the gateway's own loop, sleeps 10 ms at a time and records the CPU time the loop's thread ran meanwhile:
    what held the loop, however loaded the machine (how late each sleep ends also counts the OS running other
    processes: bounded loosely)."""

    def __init__(self, gw):
        self.loop = gw.server.servers[0].get_loop()
        self.lags: list[float] = []  # how late each 10 ms sleep ended
        self.busy: list[float] = []  # the loop thread's CPU seconds over the same span
        self.stop = threading.Event()

    async def _probe(self):
        while not self.stop.is_set():
            start, cpu = time.monotonic(), time.thread_time()
            await asyncio.sleep(0.01)
            self.lags.append(time.monotonic() - start - 0.01)
            self.busy.append(time.thread_time() - cpu)

    def __enter__(self) -> "LoopProbe":
        self.probing = asyncio.run_coroutine_threadsafe(self._probe(), self.loop)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.probing.result(30)

    def check(self, what: str) -> None:
        print(f"event loop: {len(self.lags)} probes, worst: held {max(self.busy) * 1000:.0f} ms, "
              f"late {max(self.lags) * 1000:.0f} ms")
        assert max(self.busy) < 0.1, f"the event loop was held for {max(self.busy):.2f} s while {what}"
        assert max(self.lags) < 5, f"the event loop was {max(self.lags):.1f} s late while {what}"


def test_no_hostile_body_holds_the_event_loop(gateway):
    """Hostile bodies arrive together while a LoopProbe runs. On the old code the 50 MB body of token ids alone held
    the loop for seconds."""
    with LoopProbe(gateway) as probe:
        client = subprocess.run([sys.executable, "-c", HOSTILE_CLIENT, gateway.base_url, str(LIMIT)],
                                capture_output=True, text=True, timeout=300)
    assert client.returncode == 0, client.stderr[-3000:]
    for route, status, error_keys in json.loads(client.stdout):
        if isinstance(status, int):  # else the connection ended early, after a 413 the client did not read
            assert 400 <= status < 500 and error_keys == ["code", "message", "param", "type"], (route, status)
    probe.check("hostile bodies were in flight")
    r = httpx.post(f"{gateway.base_url}/completions", json={"model": "simulated", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_cors_is_off_unless_origins_are_given(gateway):
    r = httpx.get(f"{gateway.base_url}/models", headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_answers_a_preflight_and_a_simple_request_from_an_allowed_origin(sim_fleet, gateway_factory):
    gw = gateway_factory(*sim_fleet, cors_origins=["https://app.example", "http://localhost:5173"], api_keys=["k"])
    preflight = httpx.options(f"{gw.base_url}/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    allowed = preflight.headers["access-control-allow-headers"].lower()
    assert all(h in allowed for h in ("authorization", "content-type", "x-stainless-os")), allowed
    r = httpx.post(f"{gw.base_url}/chat/completions", headers={"Origin": "http://localhost:5173", "Authorization":
                   "Bearer k"}, json={"model": "simulated", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:5173", r.headers
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    # an error is readable by the page too, and an origin not listed gets no grant
    denied = httpx.get(f"{gw.base_url}/models", headers={"Origin": "http://localhost:5173"})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "http://localhost:5173"
    other = httpx.get(f"{gw.base_url}/models", headers={"Origin": "https://evil.example", "Authorization": "Bearer k"})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    bad = httpx.options(f"{gw.base_url}/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers


def test_the_limits_and_cors_origins_come_from_flags_and_variables(monkeypatch):
    from tests.gateway.test_serve_command import serve_settings

    s = serve_settings()
    assert (s.max_body_bytes, s.max_prompt_token_ids, s.cors_origins) == (LIMIT, 131_072, [])
    monkeypatch.setenv("KVGATE_CORS_ORIGINS", "https://b.example,http://localhost:5173")
    s = serve_settings("--max-body-size", "1MiB", "--max-prompt-token-ids", "1000", "--cors-origin", "https://a.example")
    assert (s.max_body_bytes, s.max_prompt_token_ids) == (MiB, 1000)
    assert s.cors_origins == ["https://a.example", "https://b.example", "http://localhost:5173"]
    with pytest.raises(ValueError, match=r"--cors-origin .*'https://a.example/app' must be scheme://host\[:port\]"):
        serve_settings("--cors-origin", "https://a.example/app")


# ---- issue 45.7: a refusal quotes at most a short prefix of the refused value --------------------------------------

HUGE = 7_700_000  # characters: a 7.7 MB body, within --max-body-size
SHORT_ERROR = 4096  # bytes an error body may have, whatever it refuses


@pytest.fixture(scope="module")
def bare_gateway(shared_redis):
    """A gateway with no worker behind it: a refusal is answered before any job is made."""
    from tests.gateway.conftest import start_gateway

    gw = start_gateway(shared_redis.url, f"bare{abs(hash(time.monotonic())) % 10**8}")
    yield gw
    gw.stop()


def _short_error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text[:300]
    assert len(r.content) < SHORT_ERROR, f"a {len(r.content):,}-byte {status} answered: {r.content[:300]!r}..."
    return _error(r, status)


@pytest.mark.parametrize("route, body, param, marker", [
    # the SDK's check (pydantic's string_too_long, whose error holds the whole input)
    ("completions", {"prompt": "x" * HUGE}, "prompt", f"{HUGE:,} characters"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 600_000}]}, "messages.0.content",
     "600,000 characters"),
    # the gateway's own checks
    ("chat/completions", {"messages": [{"role": "x" * HUGE, "content": "hi"}]}, "messages[0].role",
     f"{HUGE:,} characters"),
    ("completions", {"prompt": "hi", "n": "x" * HUGE}, "n", f"{HUGE:,} characters"),
    ("completions", {"prompt": "hi", "stop": [{"x": "y" * HUGE}]}, "stop.0", ""),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "audio": "x" * HUGE}, "audio",
     f"{HUGE:,} characters"),
])
def test_a_refused_huge_value_is_quoted_as_a_short_prefix_with_its_length(bare_gateway, route, body, param,
                                                                          marker):
    r = httpx.post(f"{bare_gateway.base_url}/{route}", json={"model": "simulated", "max_tokens": 1} | body, timeout=60)
    err = _short_error(r)
    assert err["param"] == param and err["message"].startswith(param), err
    if marker:  # a short prefix of the value, and how long it was
        assert marker in err["message"] and "'xxxxxxxx" in err["message"], err


def test_a_huge_unknown_field_name_or_model_name_is_named_by_a_short_prefix(bare_gateway):
    name = "x" * HUGE
    r = httpx.post(f"{bare_gateway.base_url}/completions", json={"model": "simulated", "prompt": "hi", name: 1},
                   timeout=60)
    err = _short_error(r)
    assert err["param"].startswith("xxxxxxxx") and err["code"] == "unsupported_parameter", err
    r = httpx.post(f"{bare_gateway.base_url}/completions", json={"model": name, "prompt": "hi"}, timeout=60)
    err = _short_error(r)
    assert err["param"] == "model" and f"{HUGE:,} characters" in err["message"], err


def test_a_batch_file_problem_and_error_line_quote_a_short_prefix():
    from kvgate.openai.batch import error_line, file_problems

    line = json.dumps({"custom_id": "c" * HUGE, "method": "POST", "url": "/v1/" + "u" * HUGE, "body": {}})
    problems = file_problems([(1, line), (2, line)], endpoint="/v1/chat/completions")
    assert {p.code for p in problems} == {"mismatched_endpoint", "duplicate_custom_id"}, problems
    assert all(len(p.message) < 1000 for p in problems), [p.message[:300] for p in problems]
    assert len(error_line("r", "c", "invalid_request", "m" * HUGE)["error"]["message"]) <= 1000


def test_every_error_message_is_cut_to_a_short_prefix_on_its_way_out():
    """Whatever path built it: an ApiError's message and param, however long, leave as a bounded text that keeps the
    start (what was wrong), the end (what to do) and says how much was cut between."""
    from kvgate.gateway.errors import ApiError, invalid

    text = "field: is wrong (got '" + "x" * HUGE + "'); send a shorter one"
    e = ApiError(400, text, param="p" * HUGE)
    assert len(json.dumps(e.body())) < SHORT_ERROR, len(json.dumps(e.body()))
    message = e.body()["error"]["message"]
    assert message.startswith("field: is wrong (got 'xxx") and message.endswith("xxx'); send a shorter one"), message
    marker = re.search(r"\.\.\.\(([\d,]+) characters cut\)\.\.\.", message)
    assert marker and len(message) <= 1000, message
    cut = int(marker[1].replace(",", ""))
    assert len(message) - len(marker[0]) + cut == len(text), "the marker counts what was cut"
    assert e.body()["error"]["param"].startswith("ppp") and len(e.body()["error"]["param"]) <= 200
    later = invalid("prompt", "ok")
    later.message = "prompt[3]" + "y" * HUGE  # a message rewritten after the fact is cut as well
    assert len(later.message) <= 1000 and str(later) == "ok"


def test_the_sdks_invalid_request_lists_a_few_errors_each_quoted_short():
    """The SDK's InvalidRequest, which the gateway turns into its 400s, quoted every bad value: 200,000 of them made
    an 11 MB message."""
    from kvgate.producer import InvalidRequest
    from kvgate.producer.request import validate_request

    with pytest.raises(InvalidRequest) as refused:
        validate_request({"prompt": "hi", "logit_bias": {i: "x" * 1000 for i in range(200_000)}})
    assert len(refused.value.errors) == 200_000, "every error is kept, for a caller that reads them all"
    message = str(refused.value)
    assert len(message) < 2000 and "199,995 more" in message, message[:300]


# ---- issue 45.11: tool_choice required with response_format names one of them --------------------------------------

def test_tool_choice_required_with_response_format_is_a_400_naming_one_of_them(bare_gateway):
    from kvgate.producer.request import validate_request

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"model": "simulated", "max_tokens": 8, "messages": [{"role": "user", "content": "weather?"}],
            "tools": tools, "tool_choice": "required", "response_format": {"type": "json_object"}}
    err = _short_error(httpx.post(f"{bare_gateway.base_url}/chat/completions", json=body, timeout=30))
    assert err["param"] in ("tool_choice", "response_format"), err
    assert "tool_choice" in err["message"] and "response_format" in err["message"], err
    named = body | {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    err = _short_error(httpx.post(f"{bare_gateway.base_url}/chat/completions", json=named, timeout=30))
    assert err["param"] in ("tool_choice", "response_format"), err
    # auto: the model decides, and may answer in JSON instead of calling
    validate_request({"messages": body["messages"], "tools": tools, "tool_choice": "auto",
                      "response_format": {"type": "json_object"}})


# ---- issue 45, also: an upload refused with a 413 closes its connection ---------------------------------------------

UPLOAD = 64 * MiB


def _bytes_sent_before_close(root: str, head: bytes, body_part: bytes, parts: int) -> tuple[int, int]:
    """Send `head`, then `body_part` `parts` times for as long as the server takes them; the answer's status, and how
    many body bytes the client could send before the server closed the connection. Fails when the server keeps the
    connection open after its answer."""
    host, port = root.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 256 * 1024)  # the client's own buffer counts little
    sock.settimeout(60)
    sent = 0

    def send():
        nonlocal sent
        try:
            sock.sendall(head)
            for _ in range(parts):
                sock.sendall(body_part)
                sent += len(body_part)
        except OSError:
            pass  # the server closed the connection

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except ConnectionResetError:
        pass  # closed with the client's bytes unread: a reset, after the answer
    except socket.timeout:
        pytest.fail(f"the connection stayed open 60 s after the answer {data[:200]!r}, {sent:,} body bytes sent")
    sender.join(60)
    sock.close()
    assert data.startswith(b"HTTP/1.1 "), data[:200]
    return int(data.split(b" ")[1]), sent


@pytest.mark.parametrize("chunked", [False, True])
def test_an_upload_over_max_file_size_closes_its_connection_after_the_413(shared_redis, namespace, gateway_factory,
                                                                          chunked):
    gw = gateway_factory(shared_redis.url, namespace, max_file_bytes=MiB)
    form = (b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B\r\n'
            b'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\n")
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    part = line * (64 * 1024 // len(line))
    parts = UPLOAD // len(part)
    framing = {"Transfer-Encoding": "chunked"} if chunked else {"Content-Length": str(len(form) + len(part) * parts)}
    head = _head("/v1/files", {"Content-Type": "multipart/form-data; boundary=B", **framing})
    status, sent = _bytes_sent_before_close(gw.root, head + (_chunked(form)[0] if chunked else form),
                                            _chunked(part)[0] if chunked else part, parts)
    print(f"{sent:,} body bytes sent before the connection closed")
    assert status == 413
    assert sent < 8 * MiB, f"the client sent {sent:,} of {UPLOAD:,} bytes after its upload was refused"


def test_an_openai_client_uploading_over_max_file_size_still_reads_its_413(shared_redis, namespace, gateway_factory):
    """The connection closes under a client still sending: the openai client reads the 413 all the same."""
    import openai

    gw = gateway_factory(shared_redis.url, namespace, max_file_bytes=MiB)
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    client = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as refused:
        client.files.create(file=("in.jsonl", line * (32 * MiB // len(line))), purpose="batch")
    assert refused.value.status_code == 413 and "--max-file-size" in refused.value.message, refused.value
