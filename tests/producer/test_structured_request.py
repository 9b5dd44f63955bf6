"""The structured-output field (issue 25) as the SDK, the wire, the gateway and batch lines take it: one field,
size-limited, checked on both sides, and every spelling (OpenAI's response_format, vLLM's guided_* and
structured_outputs, a pydantic model) mapping to the same wire value."""
from __future__ import annotations

import json

import msgspec
import pytest
from pydantic import BaseModel

from kvgate.gateway.errors import ApiError
from kvgate.gateway.settings import GatewaySettings
from kvgate.gateway.chat.plan import plan
from kvgate.openai.batch import BadLine, parse_line
from kvgate.producer import InvalidRequest
from kvgate.producer.limits import MAX_STRUCTURED_CHARS
from kvgate.producer.constraints import Structured
from kvgate.producer.protocol import JOB_VERSION, Job, ProtocolError, Sampling, decode_job, encode
from kvgate.producer.request import validate_request

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


class Point(BaseModel):
    x: int
    y: int


def wire_of(**kwargs) -> Structured | None:
    return validate_request({"prompt": "x", **kwargs}).sampling().structured


def test_every_sdk_spelling_makes_one_wire_field():
    assert wire_of(response_format={"type": "json_object"}) == Structured("json_object")
    assert wire_of(response_format={"type": "text"}) is None
    by_openai = wire_of(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}})
    assert json.loads(by_openai.spec) == SCHEMA == json.loads(wire_of(response_format=SCHEMA).spec)
    assert wire_of(regex="[0-9]+") == Structured("regex", "[0-9]+")
    assert wire_of(choice=["a", "b"]) == Structured("choice", choices=["a", "b"])
    assert wire_of(grammar='start: "x"') == Structured("grammar", 'start: "x"')
    point = json.loads(wire_of(response_format=Point).spec)
    assert point["additionalProperties"] is False and point["required"] == ["x", "y"]  # closed, as strict mode is


@pytest.mark.parametrize("kwargs, says", [
    ({"regex": "a", "choice": ["b"]}, "at most one of"),
    ({"structured": {"kind": "regex"}}, "needs a non-empty spec"),
    ({"structured": {"kind": "telepathy", "spec": "x"}}, "is not a structured constraint"),
    ({"choice": []}, "choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "no schema"}}}, "json_schema.schema"),
    ({"grammar": "x" * (MAX_STRUCTURED_CHARS + 1)}, "grammar"),
    ({"structured": {"kind": "json_schema", "spec": "[1, 2"}}, "not JSON a worker takes"),
])
def test_the_sdk_refuses_a_bad_constraint_naming_it(kwargs, says):
    with pytest.raises(InvalidRequest) as caught:
        validate_request({"prompt": "x", **kwargs})
    assert says in str(caught.value)


def test_the_worker_checks_the_field_again_after_decoding():
    def job(structured: Structured) -> bytes:
        return encode(Job(v=JOB_VERSION, job_id="j", client_id="c", enqueued_at=1.0, prompt="x",
                          sampling=Sampling(structured=structured)))

    assert decode_job(job(Structured("choice", choices=["a"]))).sampling.structured.choices == ["a"]
    for bad, says in [(Structured("regex", "x" * (MAX_STRUCTURED_CHARS + 1)), "over the limit"),
                      (Structured("choice"), "choices"), (Structured("json_schema", "3"), "JSON schema object")]:
        with pytest.raises(ProtocolError, match=says):
            decode_job(job(bad))
    raw = msgspec.msgpack.encode({"v": 1, "job_id": "j", "client_id": "c", "enqueued_at": 1.0, "prompt": "x",
                                  "sampling": {"structured": {"kind": "regex", "spec": "a", "extra": 1}}})
    with pytest.raises(ProtocolError, match="extra"):
        decode_job(raw)


def gateway_wire(body: dict) -> dict:
    args = plan("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], **body},
                GatewaySettings()).submits[0]
    return args.get("structured")


def test_the_gateway_reads_openai_and_vllm_fields_alike():
    schema_text = json.dumps(SCHEMA)
    expected = {"kind": "json_schema", "spec": schema_text}
    assert gateway_wire({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}) \
        == expected == gateway_wire({"guided_json": SCHEMA}) == gateway_wire({"structured_outputs": {"json": SCHEMA}})
    assert gateway_wire({"guided_regex": "[a-z]"}) == {"kind": "regex", "spec": "[a-z]"}
    assert gateway_wire({"guided_choice": ["y", "n"]}) == {"kind": "choice", "choices": ["y", "n"]}
    assert gateway_wire({"guided_grammar": 'start: "y"'}) == {"kind": "grammar", "spec": 'start: "y"'}
    assert gateway_wire({"response_format": {"type": "json_object"}}) == {"kind": "json_object"}
    for body, param in [({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
                        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
                        ({"response_format": {"type": "xml"}}, "response_format"),
                        ({"functions": [{"name": "f"}]}, "functions")]:
        with pytest.raises(ApiError) as caught:
            gateway_wire(body)
        assert caught.value.param == param


def test_a_batch_line_carries_the_same_fields():
    line = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "x"}], "guided_choice": ["a", "b"]}}
    assert parse_line(1, json.dumps(line), "d").jobs[0]["structured"] == {"kind": "choice", "choices": ["a", "b"]}
    line["body"] = {**line["body"], "guided_choice": None, "response_format": {"type": "json_schema"}}
    with pytest.raises(BadLine, match="json_schema.schema"):
        parse_line(1, json.dumps(line), "d")
