"""A Responses answer with tools, without a server (issue 29, tools on /v1/responses): the text deltas a worker sends
become the typed events of function_call items (added with the name, arguments as function_call_arguments deltas,
done) beside the message of the text outside calls, every event one the openai package's types accept, and the
streamed response's output equals the whole answer's. Before: a Response had one message item and nothing else."""
from __future__ import annotations

import pydantic
import pytest
from openai.types.responses import ResponseOutputItem, ResponseStreamEvent

from kvgate.gateway import GatewaySettings
from kvgate.gateway.chat.plan import plan
from kvgate.gateway.responses.response_object import ResponseEvents, ResponseView
from kvgate.producer import Result
from kvgate.producer.protocol import Timings, ToolCall, Usage
from kvgate.producer.tool_calls import call_id, parse, parser_for

JOB = "0123456789abcdef" * 2
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
EVENT, ITEM = pydantic.TypeAdapter(ResponseStreamEvent), pydantic.TypeAdapter(ResponseOutputItem)


def streamed(choice: object, deltas: list[str], parser: str | None, finish: str = "stop") -> tuple[list[dict], dict]:
    """The events of a streamed answer, checked against openai's types, and the whole answer's body."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}
    tools = plan("chat", body | ({"tool_choice": choice} if choice else {}), GatewaySettings()).tools
    view = ResponseView("resp_" + JOB, 1.0, "m", {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True})
    events = ResponseEvents(view, tools)
    out = events.opening() + [e for text in deltas for e in events.delta(text, None, parser)]
    reader = parser_for(tools.choice, tools.function, ["get_weather"], parser or "", tools.parallel)
    got = parse(reader, "".join(deltas))  # as the worker reads the whole answer
    calls = [ToolCall(call_id(JOB, i), name, args) for i, (name, args) in enumerate(got.calls)] or None
    result = Result(JOB, "done", "".join(deltas), [], "tool_calls" if calls and finish == "stop" else finish, None,
                    Usage(3, 5), "w", Timings(), None, tool_calls=calls, content=got.content if calls else None)
    out += events.closing(result)
    for e in out:  # the Response of a lifecycle event: its output items (the rest is as without tools)
        for item in e["response"]["output"] if "response" in e else ():
            ITEM.validate_python(item)
        if "response" not in e:
            EVENT.validate_python(e)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    whole = ResponseView("resp_" + JOB, 1.0, "m", view.echo).finished(result)
    for item in whole["output"]:
        ITEM.validate_python(item)
    return out, whole


def kinds(events: list[dict]) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]


def test_text_then_a_hermes_call_is_a_message_item_then_a_function_call_item():
    text = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    events, whole = streamed(None, [text[i:i + 5] for i in range(0, len(text), 5)], "hermes")
    assert kinds(events)[:4] == ["created", "in_progress", "output_item.added", "content_part.added"]
    assert kinds(events)[-6:] == ["output_text.done", "content_part.done", "output_item.done",
                                  "function_call_arguments.done", "output_item.done", "completed"]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [a["type"] for a in added] == ["message", "function_call"]
    assert added[1] | {"arguments": "x"} == {"type": "function_call", "id": f"fc_{JOB}_0", "call_id": call_id(JOB, 0),
                                             "name": "get_weather", "arguments": "x", "status": "in_progress"}
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Checking."
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert args == '{"city": "Oslo"}' and events[-3]["arguments"] == args and events[-3]["output_index"] == 1
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"] == whole["output"]
    assert [(i["type"], i["status"]) for i in final["output"]] == [("message", "completed"),
                                                                   ("function_call", "completed")]
    assert final["output"][1]["arguments"] == args and final["output"][0]["content"][0]["text"] == "Checking."


def test_a_named_call_streams_its_arguments_and_opens_no_message():
    events, whole = streamed("get_weather", ['{"ci', 'ty": ', '"Rome"}'], None)
    assert kinds(events) == ["created", "in_progress", "output_item.added", "function_call_arguments.delta",
                             "function_call_arguments.delta", "function_call_arguments.delta",
                             "function_call_arguments.done", "output_item.done", "completed"]
    assert [e["delta"] for e in events if "delta" in e] == ['{"ci', 'ty": ', '"Rome"}']
    assert events[-1]["response"]["output"] == whole["output"] == [
        {"type": "function_call", "id": f"fc_{JOB}_0", "call_id": call_id(JOB, 0), "name": "get_weather",
         "arguments": '{"city": "Rome"}', "status": "completed"}]


def test_a_call_cut_by_max_output_tokens_is_incomplete():
    events, whole = streamed("get_weather", ['{"ci', 'ty": "Ro'], None, finish="length")
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and final["incomplete_details"] == {"reason":
                                                                                           "max_output_tokens"}
    assert final["output"] == whole["output"] and [i["status"] for i in final["output"]] == ["incomplete"]


@pytest.mark.parametrize("deltas, parser", [(["It is ", "sunny."], "hermes"), (["It is ", "sunny."], "llama3"),
                                            ([" ", ""], "hermes")])
def test_an_answer_without_calls_is_one_message_as_without_tools(deltas, parser):
    events, whole = streamed(None, deltas, parser)
    (item,) = events[-1]["response"]["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == "".join(deltas)
    assert whole["output"][0]["content"][0]["text"] == "".join(deltas)
    assert not any(e["type"].startswith("response.function_call") for e in events)


def test_blank_text_between_calls_opens_no_message():
    block = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'
    events, whole = streamed(None, [block % "Oslo", "\n", block % "Rome", "\n"], "hermes")
    output = events[-1]["response"]["output"]
    assert [i["type"] for i in output] == ["function_call", "function_call"] and output == whole["output"]
    assert [i["call_id"] for i in output] == [call_id(JOB, 0), call_id(JOB, 1)]
