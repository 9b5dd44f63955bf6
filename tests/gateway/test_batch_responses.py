"""/v1/responses as a batch endpoint, with the official openai client against a simulated worker: each output line's
body is the Response object POST /v1/responses returns; a line asking for what a batch cannot do (stream,
background, previous_response_id, store) gets its error line naming the field while the others run; a file that
mixes endpoints fails the batch as one of chat lines does; `kvgate batch` runs such lines too."""
from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response

from kvgate.gateway.responses.batch_line import NOT_IN_BATCH
from kvgate.openai.batch import BadLine, parse_line, plan_line
from kvgate.producer.keys import Keys
from tests.gateway.batch_files import jsonl, request, rows_of, wait_final
from tests.gateway.conftest import start_gateway

URL = "/v1/responses"


def line(i: int, **extra) -> dict:
    body = {"model": "simulated", "input": f"question {i}", "max_output_tokens": 4, "temperature": 0.0, **extra}
    return {"custom_id": f"resp-{i}", "method": "POST", "url": URL, "body": body}


@pytest.fixture(scope="module")
def client(sim_fleet, tmp_path_factory):
    gw = start_gateway(*sim_fleet, files_dir=str(tmp_path_factory.mktemp("files")), batch_window=4,
                       batch_poll_s=0.2)
    c = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()
    gw.stop()


def run(client, rows: list[dict]):
    f = client.files.create(file=("responses.jsonl", jsonl(rows)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=URL, completion_window="24h")
    assert batch.endpoint == URL
    return wait_final(client.batches.retrieve, batch.id)


def test_a_responses_batch_answers_every_line_with_a_response_object(client):
    rows = [line(i) for i in range(6)]
    rows[1]["body"] |= {"instructions": "Answer briefly.", "metadata": {"k": "v"}}
    rows[2]["body"]["input"] = [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}]
    rows[3]["body"]["max_output_tokens"] = 3
    done = run(client, rows)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (6, 6, 0)
    out = rows_of(client.files.content(done.output_file_id).content)
    assert [r["custom_id"] for r in out] == [r["custom_id"] for r in rows]  # one line per input line, in order
    for row, asked in zip(out, rows):
        assert row["error"] is None and row["response"]["status_code"] == 200, row
        resp = Response.model_validate(row["response"]["body"])  # the client's own type, strictly
        assert resp.object == "response" and resp.id == f"resp_{row['response']['request_id']}"
        assert resp.model == "simulated" and resp.store is False and resp.background is False
        assert resp.output_text and resp.output[0].type == "message"
        assert resp.usage.input_tokens > 0 and resp.usage.output_tokens == asked["body"]["max_output_tokens"]
        assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
        # the simulated model never stops early: every answer is cut at max_output_tokens, as POST answers it
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
        direct = client.responses.create(**asked["body"], store=False)
        assert (resp.status, resp.usage, resp.instructions, resp.metadata, resp.max_output_tokens) == \
            (direct.status, direct.usage, direct.instructions, direct.metadata, direct.max_output_tokens)
        assert [item.type for item in resp.output] == [item.type for item in direct.output]
    first = Response.model_validate(out[1]["response"]["body"])
    assert first.instructions == "Answer briefly." and first.metadata == {"k": "v"}


@pytest.mark.parametrize("field, value", [("stream", True), ("background", True),
                                          ("previous_response_id", "resp_" + "0" * 32), ("store", True)])
def test_a_line_asking_what_a_batch_cannot_do_gets_its_error_line_and_the_others_finish(client, field, value):
    rows = [line(i) for i in range(3)]
    rows[1]["body"][field] = value
    done = run(client, rows)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    out = rows_of(client.files.content(done.output_file_id).content)
    (bad,) = rows_of(client.files.content(done.error_file_id).content)
    assert [r["custom_id"] for r in out] == ["resp-0", "resp-2"]
    assert all(Response.model_validate(r["response"]["body"]).output_text for r in out)
    assert bad["custom_id"] == "resp-1" and bad["response"] is None
    assert bad["error"]["code"] == "unsupported_parameter" and f"body.{field}=" in bad["error"]["message"], bad


def test_a_line_the_responses_parser_refuses_names_its_field(client):
    rows = [line(0), line(1, tools=[{"type": "web_search"}]), line(2, include=["file_search_call.results"])]
    done = run(client, rows)
    errors = {r["custom_id"]: r["error"] for r in rows_of(client.files.content(done.error_file_id).content)}
    assert done.request_counts.completed == 1 and set(errors) == {"resp-1", "resp-2"}
    assert "body.tools[0].type" in errors["resp-1"]["message"] and "body.include" in errors["resp-2"]["message"]
    assert {e["code"] for e in errors.values()} == {"unsupported_parameter"}


def test_a_file_that_mixes_responses_and_chat_lines_fails_the_batch(client):
    done = run(client, [line(0), request(1)])  # request(): a chat line
    assert done.status == "failed"
    assert [(e.code, e.line, e.param) for e in done.errors.data] == [("mismatched_endpoint", 2, "url")]


def test_a_responses_line_in_a_chat_batch_fails_it_too(client):
    f = client.files.create(file=("mixed.jsonl", jsonl([request(0), line(1)])), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_final(client.batches.retrieve, batch.id)
    assert done.status == "failed" and [e.code for e in done.errors.data] == ["mismatched_endpoint"]


def test_the_refused_fields_are_declared_once_and_each_refused_by_name():
    from kvgate.gateway.responses.batch_line import TRANSLATORS
    for name, (allowed, _why) in NOT_IN_BATCH.items():
        for value in allowed:
            parse_line(1, json.dumps(line(0, **{name: value})), "d", TRANSLATORS)
        with pytest.raises(BadLine, match=f"body.{name}="):
            parse_line(1, json.dumps(line(0, **{name: 1})), "d", TRANSLATORS)  # 1 is not True, nor accepted


def test_kvgate_batch_runs_responses_lines_through_the_gateways_parser(sim_fleet, tmp_path):
    """`kvgate batch` answers /v1/responses lines as the managed batches do (each body a Response object) where the
    gateway's extra is installed; without translators a line is its invalid_url error line saying what to install."""
    from kvgate.commands.cli import main

    url, ns = sim_fleet
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(line(i)) for i in range(3)) + "\n")
    assert main(["batch", "--redis-url", url, "--namespace", ns, str(src), "-o", str(out), "--no-progress",
                 "--timeout", "60"]) == 0
    rows = [json.loads(r) for r in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == ["resp-0", "resp-1", "resp-2"]
    for row in rows:
        resp = Response.model_validate(row["response"]["body"])
        assert row["error"] is None and resp.object == "response" and resp.output_text, row
        assert resp.usage.output_tokens == 4
    bare = plan_line(1, json.dumps(line(0)), "digest", "low", Keys("ns"), "client")  # no translators given
    assert bare["error"]["code"] == "invalid_url" and "kvgate[gateway]" in bare["error"]["message"], bare