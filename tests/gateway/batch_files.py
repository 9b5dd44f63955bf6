"""Batch input files for the gateway's batch tests, and reading the answers back."""
from __future__ import annotations

import json
import time

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
FINAL = ("completed", "failed", "cancelled", "expired")


def request(i: int, url: str = CHAT, max_tokens: int = 4, **extra) -> dict:
    body = {"model": "simulated", "max_tokens": max_tokens, "seed": i, **extra}
    if url == CHAT:
        body["messages"] = [{"role": "user", "content": f"question {i}"}]
    else:
        body["prompt"] = f"prompt {i}"
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def with_bad_lines(n: int, url: str = CHAT) -> list[dict]:
    """n requests, two of which fail on their own: one asks for an unsupported field, one for a bad value."""
    rows = [request(i, url) for i in range(n)]
    rows[3]["body"]["functions"] = [{"name": "f"}]  # the deprecated spelling of tools
    rows[7]["body"]["temperature"] = -1
    return rows


def rows_of(content: bytes) -> list[dict]:
    return [json.loads(line) for line in content.decode().splitlines() if line.strip()]


def wait_final(retrieve, batch_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        batch = retrieve(batch_id)
        if batch.status in FINAL:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout:g}s: {batch}")
        time.sleep(0.1)
