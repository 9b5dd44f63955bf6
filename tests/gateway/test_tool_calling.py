"""Tool calling through a real gateway and a SmolLM2 worker (issue 25): the official client's tools, streamed and not,
required and named calls that parse into the declared arguments at temperature 0 and 0.8, a conversation that carries
calls and tool answers, the SDK's Result.tool_calls, and LangChain's bind_tools and with_structured_output. Before:
every request with tools was a 400 (`tools=[...] is not supported (no tool calling)`)."""
from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field

pytest.importorskip("torch", reason="a real model needs the worker's torch (make test-pythons runs without it)")
pytest.importorskip("llguidance")

import jsonschema  # noqa: E402

from kvgate.producer import Client  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}}, "required": ["timezone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def model_of(client) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_required_call_parses_into_the_declared_arguments(smol, temperature):
    out = smol.chat.completions.create(model=model_of(smol), messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=temperature, seed=3, max_tokens=48)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_call_streams_as_openai_streams_tool_calls_and_matches_the_whole_answer(smol):
    body = dict(model=model_of(smol), messages=ASK, tools=TOOLS, temperature=0, max_tokens=40,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = smol.chat.completions.create(**body).choices[0]
    chunks = list(smol.chat.completions.create(**body, stream=True))
    calls = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    first = calls[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and all(d.id is None and d.function.name is None for d in calls[1:])
    arguments = "".join(d.function.arguments for d in calls)
    assert chunks[-1].choices[0].finish_reason == "tool_calls" == whole.finish_reason
    assert arguments == whole.message.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert not any(c.choices[0].delta.content for c in chunks)


def test_required_streamed_and_a_conversation_with_calls_and_tool_answers(smol):
    model = model_of(smol)
    chunks = list(smol.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, temperature=0, max_tokens=48, stream=True))
    (call,) = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    out = smol.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=8)
    assert out.choices[0].message.content and out.choices[0].message.tool_calls is None
    auto = smol.chat.completions.create(model=model, messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    message = auto.choices[0].message  # auto: whatever the model chose, as content or as calls of declared functions
    assert message.content or message.tool_calls
    assert all(c.function.name in SCHEMAS for c in message.tool_calls or [])


def test_the_sdk_gives_result_tool_calls(smol):
    url, ns = smol.kvgate
    with Client(url, ns) as client:
        result = client.submit(messages=ASK, tools=TOOLS, tool_choice="get_time", temperature=0, max_tokens=24,
                               model=model_of(smol)).result(timeout=240)
    assert result.finish_reason == "tool_calls" and result.content is None, result
    (call,) = result.tool_calls
    assert call.name == "get_time" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), TIME)


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=16)
    celsius: int = Field(ge=-50, le=50)


def test_langchain_bind_tools_and_with_structured_output(smol):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=model_of(smol), base_url=str(smol.base_url), api_key="unused",
                                      temperature=0, max_tokens=40, max_retries=0, timeout=240)
    ai = llm.bind_tools([Weather], tool_choice="Weather").invoke("What is the weather in Rome?")
    (call,) = ai.tool_calls
    assert call["name"] == "Weather" and Weather.model_validate(call["args"])
    for method in ("function_calling", "json_schema"):
        got = llm.with_structured_output(Weather, method=method).invoke("The weather in Rome, as JSON.")
        assert isinstance(got, Weather), method
    # json_mode is response_format json_object: any object, so the prompt shows the one it wants
    got = llm.bind(max_tokens=64).with_structured_output(Weather, method="json_mode").invoke(
        'Reply with one JSON object like {"city": "Oslo", "celsius": 3} for the weather in Rome.')
    assert isinstance(got, Weather)
