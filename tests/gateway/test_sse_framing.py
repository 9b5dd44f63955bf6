"""The exact bytes of a streamed answer, read with raw HTTP: `data: {json}\n\n` events, then `data: [DONE]\n\n`."""
from __future__ import annotations

import json

import httpx


def _events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n"), raw[-40:]
    return raw[:-2].split(b"\n\n")


def test_a_streamed_chat_is_data_events_each_ending_in_a_blank_line_then_done(gateway):
    body = {"model": "simulated", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "frame me"}]}
    with httpx.stream("POST", f"{gateway.base_url}/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache" and r.headers["x-request-id"]
        raw = b"".join(r.iter_raw())
    events = _events(raw)
    assert events[-1] == b"data: [DONE]"
    assert all(e.startswith(b"data: {") and b"\n" not in e for e in events[:-1]), events
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"] == "chatcmpl-" + r.headers["x-request-id"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(chunks) == 1 + 4 + 1 + 1  # role, one chunk per token, the finish, the usage
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_a_streamed_completion_has_text_chunks_and_no_usage_unless_asked(gateway):
    body = {"model": "simulated", "prompt": "a b", "max_tokens": 3, "stream": True}
    r = httpx.post(f"{gateway.base_url}/completions", json=body, timeout=30)
    events = _events(r.content)
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert "".join(c["choices"][0]["text"] for c in chunks).count(" t") == 3
