"""Tool calling without a model (issue 25): the parsers read an answer alike however its text is cut into deltas, a
name the request did not declare stays content, `required`'s schema validates the calls it lets through, the SDK and
the wire check tools and tool messages and name the field, a job without tools encodes as before, and batch lines
carry the same fields."""
from __future__ import annotations

import json

import msgspec
import pytest

from kvgate.openai.batch import parse_line
from kvgate.producer import InvalidRequest
from kvgate.producer import protocol as wire
from kvgate.producer.constraints import Function, Structured, Tools
from kvgate.producer.request import build_job, validate_request
from kvgate.producer.tool_calls import (CallDelta, Content, Hermes, Llama3, Named, Required, call_schema, collect,
                                        parse, parser_for)

NAMES = {"get_weather", "get_time"}
HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>{"name": "get_time", "arguments": {"timezone": "CET"}}</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def fed(parser, text: str, cut: int) -> list:
    pieces = []
    for i in range(0, len(text), cut):
        pieces += parser.feed(text[i:i + cut])
    return pieces + parser.close()


@pytest.mark.parametrize("cut", [1, 2, 5, 11, 10_000])
def test_hermes_reads_calls_and_content_alike_in_any_cut(cut):
    got = collect(fed(Hermes(NAMES), HERMES, cut))
    assert got.calls == [("get_weather", '{"city": "Paris"}'), ("get_time", '{"timezone": "CET"}')]
    assert got.content.strip() == "Let me look."


def test_hermes_keeps_content_streaming_and_holds_only_what_may_open_a_call():
    p = Hermes(NAMES)
    assert p.feed("Hello <tool") == [Content("Hello ")]  # "<tool" may begin <tool_call>: held
    assert p.feed("s are fine") == [Content("<tools are fine")]
    assert p.feed('<tool_call>{"name": "get_weather", "arguments": {}}') == []  # inside a call until it closes
    assert p.feed("</tool_call>") == [CallDelta(0, "get_weather", "{}")]


def test_an_undeclared_name_or_invalid_json_stays_content_and_an_unclosed_call_is_read_at_the_end():
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call><tool_call>{not json</tool_call>'
    assert parse(Hermes(NAMES), text).calls == [] and parse(Hermes(NAMES), text).content == text
    assert parse(Hermes(NAMES), '<tool_call>{"name": "get_time", "arguments": {"timezone": "UTC"}}').calls == [
        ("get_time", '{"timezone": "UTC"}')]
    deep = "[" * 100_000 + "]" * 100_000  # past the interpreter's recursion limit: not JSON, not a crash
    assert parse(Hermes(NAMES), f"<tool_call>{deep}</tool_call>").calls == []
    assert parse(Required(NAMES), deep).calls == []
    assert parse(Llama3(NAMES), "{" + deep).calls == []


@pytest.mark.parametrize("cut", [1, 3, 10_000])
def test_llama3_reads_semicolon_separated_calls_and_streams_other_answers_as_content(cut):
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
            '{"name": "get_time", "parameters": {}}')
    assert collect(fed(Llama3(NAMES), text, cut)).calls == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    p = Llama3(NAMES)
    assert p.feed("  It is") == [Content("  It is")] and p.feed(" sunny") == [Content(" sunny")] and p.close() == []
    assert parse(Llama3(NAMES), '{"name": "nope", "parameters": {}}').calls == []


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 10_000])
def test_required_sends_each_call_once_its_object_closes_in_any_cut(cut):
    text = ('[{"name": "get_time", "arguments": {"timezone": "U\\"}{TC"}}, '
            '{"name": "get_weather", "arguments": {"city": "[x]"}}]')
    assert collect(fed(Required(NAMES), text, cut)).calls == [("get_time", '{"timezone": "U\\"}{TC"}'),
                                                              ("get_weather", '{"city": "[x]"}')]
    p = Required(NAMES)
    assert p.feed('[{"name": "get_time", "arguments": {}}') == [CallDelta(0, "get_time", "{}")]  # before the "]"
    assert p.feed(', {"name": "get_ti') == [] and p.close() == [Content(', {"name": "get_ti')]  # cut off: content


def test_required_and_named_answers_become_calls_and_a_cut_off_array_stays_content():
    assert parse(Required(NAMES), '[{"name": "get_time", "arguments": {"timezone": "UTC"}}]').calls == [
        ("get_time", '{"timezone": "UTC"}')]
    assert parse(Required(NAMES), '[{"name": "get_time", "argu').calls == []
    named = Named("get_weather")
    assert named.feed('{"city"') == [CallDelta(0, "get_weather", '{"city"')]
    assert named.feed(': "Rome"}') == [CallDelta(0, None, ': "Rome"}')] and named.close() == []
    one = parse(parser_for("auto", "", list(NAMES), "hermes", parallel=False), HERMES)  # parallel_tool_calls false
    assert one.calls == [("get_weather", '{"city": "Paris"}')] and one.content.endswith("</tool_call>")
    two = '{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}'
    assert parse(Llama3(NAMES, most=1), two).calls == [("get_time", "{}")]
    assert parse(Llama3(NAMES, most=1), two).content == '; {"name": "get_time", "parameters": {}}'
    assert isinstance(parser_for("auto", "", ["f"], "llama3"), Llama3)
    assert isinstance(parser_for("auto", "", ["f"], "hermes"), Hermes)


def test_the_required_schema_lets_through_declared_calls_only():
    jsonschema = pytest.importorskip("jsonschema")
    schema = call_schema([("get_weather", json.dumps(TOOLS[0]["function"]["parameters"])), ("get_time", "")], False)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Rome"}}], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "nope", "arguments": {}}],
                [{"name": "get_time", "arguments": {}}] * 2,  # one call unless parallel
                [{"name": "get_weather", "arguments": {"city": "Rome", "extra": 1}}]):  # closed like OpenAI's strict
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    jsonschema.validate([{"name": "get_time", "arguments": {}}] * 2, call_schema([("get_time", "")], True))


def test_submit_carries_tools_and_a_tool_conversation_on_the_wire():
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "name": "get_weather"}]
    job = build_job(validate_request({"messages": history, "tools": TOOLS, "tool_choice": "required",
                                      "parallel_tool_calls": False}), "c")
    again = wire.decode_job(wire.encode(job))
    assert again.tools == Tools([Function("get_weather", "", json.dumps(
        TOOLS[0]["function"]["parameters"], separators=(",", ":")))], "required", "", False)
    assert again.messages[1].tool_calls == [wire.ToolCall("call_1", "get_weather", '{"city":"Paris"}')]
    assert again.messages[2].tool_call_id == "call_1" and again.messages[2].name == "get_weather"
    named = build_job(validate_request({"messages": ASK, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}), "c")
    assert (named.tools.choice, named.tools.function) == ("function", "get_weather")
    assert build_job(validate_request({"messages": ASK, "tools": TOOLS, "tool_choice": "none"}), "c").tools is None


def test_a_job_without_tools_encodes_as_before():
    job = wire.Job(v=1, job_id="j", client_id="c", enqueued_at=1.0, messages=[wire.Message("user", "hi")])
    assert msgspec.msgpack.decode(wire.encode(job))["messages"] == [{"role": "user", "content": "hi"}]
    assert "tools" not in msgspec.msgpack.decode(wire.encode(job))
    final = wire.Final(v=2, job_id="j", status="done", text="x")
    assert not {"tool_calls", "content"} & set(msgspec.msgpack.decode(wire.encode(final)))


@pytest.mark.parametrize("args, field", [
    ({"messages": ASK, "tools": TOOLS, "tool_choice": "get_time"}, "get_time"),  # not declared
    ({"prompt": "hi", "tools": TOOLS}, "chat messages"),
    ({"messages": ASK, "tool_choice": "required"}, "needs tools"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "bad name"}}]}, "bad name"),
    ({"messages": ASK, "tools": [{"type": "retrieval"}]}, "function tools only"),
    ({"messages": ASK, "tools": TOOLS * 2}, "declared twice"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "assistant"),
])
def test_bad_tools_and_tool_messages_are_refused_naming_the_problem(args, field):
    with pytest.raises(InvalidRequest) as caught:
        build_job(validate_request(args), "c")
    assert field in str(caught.value)


def test_the_worker_check_refuses_tools_a_producer_could_forge():
    job = wire.Job(v=1, job_id="j", client_id="c", enqueued_at=1.0, messages=[wire.Message("user", "hi")],
                   tools=Tools([Function("f", parameters="[1]")]))
    with pytest.raises(wire.ProtocolError, match="parameters must be a JSON schema object"):
        wire.decode_job(wire.encode(job))
    job.tools = Tools([Function("f")], "required")
    job.sampling = wire.Sampling(structured=Structured("regex", "a"))
    with pytest.raises(wire.ProtocolError, match="not both"):
        wire.decode_job(wire.encode(job))


def test_a_result_with_calls_answers_as_openai_does_in_a_batch_line():
    from kvgate.openai.batch import BatchRequest, answer_line
    from kvgate.producer import Result

    final = wire.Final(v=2, job_id="j", status="done", text='[{"name": "get_weather", "arguments": {}}]',
                       finish_reason="stop", tool_calls=[wire.ToolCall("call_x", "get_weather", "{}")])
    line = answer_line(BatchRequest(1, "c1", "/v1/chat/completions", "m", [{}]), [Result.from_final(final)])
    choice = line["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [{"id": "call_x", "type": "function",
                                                "function": {"name": "get_weather", "arguments": "{}"}}]


def test_a_batch_line_carries_tools():
    line = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": ASK, "tools": TOOLS, "tool_choice": "required"}}
    args = parse_line(1, json.dumps(line), "d").jobs[0]
    assert args["tools"] == TOOLS and args["tool_choice"] == "required"
