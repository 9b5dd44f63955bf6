"""Hostile bodies (issue 26.3) and CORS: every oversized or costly body is a 4xx in OpenAI's shape, answered as soon
as it is over the limit (from its Content-Length, or while a chunked body streams in), and none holds the event loop.

The raw-socket tests send a request's head and part of its body and then wait for the answer without sending the
rest: a server that reads a body to its end before refusing it never answers them."""
from __future__ import annotations

import asyncio
import json
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
