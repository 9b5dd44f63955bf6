"""A streamed chat answer with tools, without a server (issue 25): the text deltas a worker sends become OpenAI's
content and tool-call chunks (a call's first chunk has its index, id, type, name and arguments; later ones append
arguments), read by the parser the worker names, with the ids the worker's final gives."""
from __future__ import annotations

from kvgate.gateway import GatewaySettings
from kvgate.gateway.chat.bodies import Reply, ToolReader
from kvgate.gateway.chat.plan import plan
from kvgate.producer.tool_calls import call_id

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "Weather?"}]


def streamed(body: dict, deltas: list[str], parser: str | None) -> tuple[list[dict], bool]:
    p = plan("chat", {"model": "m", "messages": ASK, "tools": TOOLS, "stream": True, **body}, GatewaySettings())
    reply, reader = Reply(p, "chatcmpl-x"), ToolReader(p.tools, "job1")
    chunks = [c for text in deltas for c in reader.chunks(reply, 0, text, None, parser)]
    return [c["choices"][0]["delta"] for c in chunks + reader.close(reply, 0)], reader.called


def test_an_auto_answer_streams_its_content_then_its_call():
    text = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    deltas, called = streamed({}, [text[i:i + 4] for i in range(0, len(text), 4)], "hermes")
    assert "".join(d.get("content", "") for d in deltas) == "Checking." and called
    (call,) = [c for d in deltas for c in d.get("tool_calls", [])]
    assert call == {"index": 0, "id": call_id("job1", 0), "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def test_a_named_call_streams_its_arguments_as_they_come_and_plain_text_stays_content():
    deltas, called = streamed({"tool_choice": "get_weather"}, ['{"ci', 'ty": "Rome"}'], None)
    first, later = (d["tool_calls"][0] for d in deltas)
    assert first["id"] == call_id("job1", 0) and first["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert later == {"index": 0, "function": {"arguments": 'ty": "Rome"}'}} and called
    deltas, called = streamed({}, ["It is ", "sunny."], "llama3")
    assert [d["content"] for d in deltas] == ["It is ", "sunny."] and not called
