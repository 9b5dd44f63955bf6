"""`kvgate batch FILE` and /v1/batches share one per-line implementation: the same input gives the same lines,
but for ids and timestamps."""
from __future__ import annotations

import openai
import pytest

from kvgate.commands.cli import main as kvgate
from tests.gateway.batch_files import COMPLETIONS, jsonl, rows_of, wait_final, with_bad_lines
from tests.gateway.conftest import start_gateway


@pytest.fixture(scope="module")
def batch_gateway(sim_fleet, tmp_path_factory):
    gw = start_gateway(*sim_fleet, files_dir=str(tmp_path_factory.mktemp("files")), batch_poll_s=0.2)
    yield gw
    gw.stop()


def comparable(row: dict) -> dict:
    """A line without what names this run: its ids, the job id and the finish time."""
    row = {**row, "id": None}
    if row["response"] is not None:
        body = {**row["response"]["body"], "id": None, "created": None}
        row["response"] = {**row["response"], "request_id": None, "body": body}
    return row


@pytest.mark.parametrize("url", ["/v1/chat/completions", COMPLETIONS])
def test_the_cli_and_the_gateway_write_the_same_lines(batch_gateway, sim_fleet, tmp_path, url):
    rows = with_bad_lines(30, url) + [{"custom_id": "broken", "url": url}]  # no body: an error line
    data = jsonl(rows)
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_bytes(data)
    redis_url, ns = sim_fleet
    assert kvgate(["batch", str(path), "-o", str(out), "--redis-url", redis_url, "--namespace", ns,
                   "--no-progress"]) == 0
    by_cli = {r["custom_id"]: comparable(r) for r in rows_of(out.read_bytes())}

    with openai.OpenAI(base_url=batch_gateway.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        f = c.files.create(file=("in.jsonl", data), purpose="batch")
        batch = wait_final(c.batches.retrieve, c.batches.create(input_file_id=f.id, endpoint=url,
                                                                completion_window="24h").id)
        lines = rows_of(c.files.content(batch.output_file_id).content)
        lines += rows_of(c.files.content(batch.error_file_id).content)
    by_gateway = {r["custom_id"]: comparable(r) for r in lines}
    assert by_gateway == by_cli and len(by_cli) == len(rows)
    assert batch.request_counts.failed == sum(r["error"] is not None for r in by_cli.values()) == 3


def test_embedding_lines_run_alike_in_the_cli_and_the_gateway(batch_gateway, sim_fleet, tmp_path):
    import base64
    import struct

    url = "/v1/embeddings"
    bodies = [{"model": "simulated", "input": f"text {i}"} for i in range(6)]
    bodies[1] = {"model": "simulated", "input": [5, 6, 7], "encoding_format": "base64", "dimensions": 4}
    bodies[2]["input"] = ["one", "two"]  # two inputs: one line, two jobs
    bodies[3]["pooling_type"] = "mean"  # not honoured: an error line naming it
    rows = [{"custom_id": f"e-{i}", "method": "POST", "url": url, "body": b} for i, b in enumerate(bodies)]
    data = jsonl(rows)
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_bytes(data)
    redis_url, ns = sim_fleet
    assert kvgate(["batch", str(path), "-o", str(out), "--redis-url", redis_url, "--namespace", ns,
                   "--no-progress"]) == 0
    by_cli = {r["custom_id"]: comparable(r) for r in rows_of(out.read_bytes())}
    with openai.OpenAI(base_url=batch_gateway.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        f = c.files.create(file=("in.jsonl", data), purpose="batch")
        batch = wait_final(c.batches.retrieve, c.batches.create(input_file_id=f.id, endpoint=url,
                                                                completion_window="24h").id)
        lines = rows_of(c.files.content(batch.output_file_id).content)
        lines += rows_of(c.files.content(batch.error_file_id).content)
    by_gateway = {r["custom_id"]: comparable(r) for r in lines}
    assert by_gateway == by_cli and len(by_cli) == len(rows)
    assert [d["index"] for d in by_cli["e-2"]["response"]["body"]["data"]] == [0, 1]
    assert by_cli["e-2"]["response"]["body"]["usage"]["prompt_tokens"] == 2
    assert "pooling_type" in by_cli["e-3"]["error"]["message"]
    body = by_cli["e-0"]["response"]["body"]
    assert body["object"] == "list" and len(body["data"][0]["embedding"]) == 8 and body["usage"]["prompt_tokens"] == 2
    packed = base64.b64decode(by_cli["e-1"]["response"]["body"]["data"][0]["embedding"])
    assert abs(sum(v * v for v in struct.unpack("<4f", packed)) - 1) < 1e-5
