"""/v1/embeddings lines of several inputs in batch files: one output line per input line, whose body is what
POST /v1/embeddings answers for the same body, through the gateway's managed batches (the official `openai` client)
and `kvgate batch`, against the bundled SmolLM2 (the shared `smol` fixture: --max-model-len 512)."""
from __future__ import annotations

import base64
import struct

import pytest

from kvgate.commands.cli import main as kvgate
from tests.gateway.batch_files import jsonl, rows_of, wait_final

torch = pytest.importorskip("torch", reason="a real model needs the worker's torch (make test-pythons runs without it)")

URL = "/v1/embeddings"
TEXTS = ["The capital of France is Paris.", "def fibonacci(n):", "Queues hold the work nobody has room for yet."]
TOO_LONG = "word " * 700  # more tokens than the worker's --max-model-len 512


def bodies(model: str) -> dict[str, dict]:
    return {"several": {"model": model, "input": TEXTS, "encoding_format": "float"},
            "one": {"model": model, "input": TEXTS[1], "encoding_format": "float"},
            "based": {"model": model, "input": TEXTS[:2], "encoding_format": "base64", "dimensions": 16},
            "too-long": {"model": model, "input": [TEXTS[0], TOO_LONG, TEXTS[2]], "encoding_format": "float"},
            "after": {"model": model, "input": TEXTS[::-1], "encoding_format": "float"}}


def lines_of(model: str) -> list[dict]:
    return [{"custom_id": c, "method": "POST", "url": URL, "body": b} for c, b in bodies(model).items()]


def vectors(body: dict) -> list[list[float]]:
    got = [d["embedding"] for d in body["data"]]
    if got and isinstance(got[0], str):
        got = [list(struct.unpack(f"<{len(base64.b64decode(v)) // 4}f", base64.b64decode(v))) for v in got]
    return got


def direct(smol, body: dict) -> dict:
    """What POST /v1/embeddings answers for the body, as JSON."""
    return smol.with_raw_response.embeddings.create(**body).http_response.json()


def assert_answers_as_direct(got: dict, want: dict) -> None:
    assert [d["index"] for d in got["data"]] == list(range(len(want["data"])))
    assert {k: got[k] for k in ("object", "model", "usage")} == {k: want[k] for k in ("object", "model", "usage")}
    assert all(d["object"] == "embedding" for d in got["data"])
    for g, w in zip(vectors(got), vectors(want), strict=True):
        assert g == pytest.approx(w, abs=1e-5)


def check_lines(smol, model: str, rows: dict[str, dict]) -> None:
    want = bodies(model)
    for custom_id in ("several", "one", "based", "after"):
        row = rows[custom_id]
        assert row["error"] is None and row["response"]["status_code"] == 200, row
        assert_answers_as_direct(row["response"]["body"], direct(smol, want[custom_id]))
    assert isinstance(rows["based"]["response"]["body"]["data"][0]["embedding"], str)  # encoding_format honoured
    assert len(vectors(rows["based"]["response"]["body"])[0]) == 16
    bad = rows["too-long"]
    assert bad["response"] is None and "input[1]" in bad["error"]["message"], bad
    assert "512" in bad["error"]["message"], bad  # why: the model's context length


def test_a_managed_batch_answers_a_several_input_embeddings_line_as_the_direct_route(smol):
    model = smol.models.list().data[0].id
    f = smol.files.create(file=("emb.jsonl", jsonl(lines_of(model))), purpose="batch")
    batch = wait_final(smol.batches.retrieve, smol.batches.create(input_file_id=f.id, endpoint=URL,
                                                                  completion_window="24h").id, timeout=240)
    assert batch.status == "completed", batch
    counts = batch.request_counts  # lines, not jobs
    assert (counts.total, counts.completed, counts.failed) == (5, 4, 1)
    out = rows_of(smol.files.content(batch.output_file_id).content)
    errors = rows_of(smol.files.content(batch.error_file_id).content)
    assert [r["custom_id"] for r in out] == ["several", "one", "based", "after"]
    assert [r["custom_id"] for r in errors] == ["too-long"]  # one line, no partial success beside it
    check_lines(smol, model, {r["custom_id"]: r for r in out + errors})


def test_kvgate_batch_answers_a_several_input_embeddings_line_as_the_direct_route(smol, tmp_path):
    model = smol.models.list().data[0].id
    chat = {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}}
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_bytes(jsonl(lines_of(model) + [chat]))
    url, ns = smol.kvgate
    assert kvgate(["batch", str(path), "-o", str(out), "--redis-url", url, "--namespace", ns, "--no-progress"]) == 0
    rows = rows_of(out.read_bytes())
    assert sorted(r["custom_id"] for r in rows) == sorted([*bodies(model), "chat"])  # one line per input line
    by_id = {r["custom_id"]: r for r in rows}
    check_lines(smol, model, by_id)
    assert by_id["chat"]["error"] is None and by_id["chat"]["response"]["body"]["object"] == "chat.completion"
    # a rerun finds every line answered and writes nothing more
    assert kvgate(["batch", str(path), "-o", str(out), "--redis-url", url, "--namespace", ns, "--no-progress"]) == 0
    assert len(rows_of(out.read_bytes())) == len(rows)
