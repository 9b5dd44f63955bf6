"""The Responses API with a real model (the package's `smol` SmolLM2 worker and gateway): the openai client's
`responses.stream` to a completed response, `responses.parse` into a pydantic model through `text.format`, logprobs
through `include`, and LangChain's ChatOpenAI(use_responses_api=True) invoking and streaming."""
from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field

pytest.importorskip("torch", reason="a real model needs the worker's torch (make test-pythons runs without it)")
pytest.importorskip("llguidance")


class City(BaseModel):
    name: str = Field(max_length=16)
    country: str = Field(max_length=16)


def model_of(client) -> str:
    return client.models.list().data[0].id


def test_responses_stream_ends_completed_with_the_answer(smol):
    with smol.responses.stream(model=model_of(smol), input="What is the capital of France?", temperature=0,
                               max_output_tokens=24, extra_body={"stop": ["."]}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()  # needs response.completed: a stop string, not max_output_tokens
    assert final.status == "completed" and final.incomplete_details is None
    assert "Paris" in final.output_text and "".join(deltas) == final.output_text
    assert smol.responses.retrieve(final.id).output_text == final.output_text


def test_parse_with_a_pydantic_model_gives_the_parsed_object(smol):
    out = smol.responses.parse(model=model_of(smol), input="Describe Paris as JSON.", temperature=0,
                               max_output_tokens=32, text_format=City)  # text.format json_schema, strict
    assert isinstance(out.output_parsed, City), out.output_text
    assert out.text.format.type == "json_schema" and json.loads(out.output_text) == out.output_parsed.model_dump()


def test_logprobs_come_on_the_output_text_when_included(smol):
    out = smol.responses.create(model=model_of(smol), input="Say hi.", temperature=0, max_output_tokens=5,
                                include=["message.output_text.logprobs"], top_logprobs=2)
    logprobs = out.output[0].content[0].logprobs
    assert len(logprobs) == out.usage.output_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in logprobs)


def test_langchain_chat_openai_with_the_responses_api_invokes_and_streams(smol):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    llm = langchain_openai.ChatOpenAI(model=model_of(smol), base_url=str(smol.base_url), api_key="unused",
                                      use_responses_api=True, temperature=0, max_tokens=8, max_retries=0)
    answer = llm.invoke([HumanMessage("What is the capital of France?")])
    assert isinstance(answer, AIMessage) and "Paris" in answer.text
    assert answer.usage_metadata["output_tokens"] > 0
    # its own answer (an output message item with an id) goes back as input, after a system message
    follow = llm.invoke([SystemMessage("You are a geography tutor."), HumanMessage("What is the capital of France?"),
                         answer, HumanMessage("And what is the capital of Italy?")])
    assert follow.text.strip() and follow.usage_metadata["input_tokens"] > answer.usage_metadata["input_tokens"]
    streamed = "".join(chunk.text for chunk in llm.stream("What is the capital of France?"))
    assert streamed == answer.text or "Paris" in streamed


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER,
          "strict": True}]


def test_a_required_call_is_a_function_call_item_streamed_or_not(smol):
    ask = dict(model=model_of(smol), input="What is the weather in Paris?", tools=TOOLS, tool_choice="required",
               parallel_tool_calls=False, temperature=0, max_output_tokens=32)
    whole = smol.responses.create(**ask)
    (call,) = whole.output  # constrained: the model calls, and says nothing else
    assert whole.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"city"}
    with smol.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()  # the client's own accumulation of the events
    kinds = [e.type for e in events]
    assert kinds.count("response.output_item.added") == 1 and "response.output_text.delta" not in kinds
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done.arguments == call.arguments  # the same greedy answer
    (streamed,) = final.output
    assert streamed.type == "function_call" and streamed.arguments == call.arguments
    assert streamed.parsed_arguments == json.loads(call.arguments)  # strict: the client parses them
    assert smol.responses.retrieve(final.id).output[0].arguments == call.arguments


def test_a_call_answered_with_function_call_output_continues_by_previous_response_id_or_by_items(smol):
    model = model_of(smol)
    first = smol.responses.create(model=model, input="What is the weather in Paris?", tools=TOOLS,
                                  tool_choice="required", temperature=0, max_output_tokens=32)
    (call,) = first.output
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}
    later = smol.responses.create(model=model, input=[answer], previous_response_id=first.id, tools=TOOLS,
                                  tool_choice="none", temperature=0, max_output_tokens=4)
    assert later.status in ("completed", "incomplete") and later.output[0].type == "message" and later.output_text
    # the same conversation sent whole, the call as the item the first response gave (dumped whole, its nulls
    # too): the same prompt
    items = [{"role": "user", "content": "What is the weather in Paris?"}, call.model_dump(), answer]
    again = smol.responses.create(model=model, input=items, tools=TOOLS, tool_choice="none", temperature=0,
                                  max_output_tokens=4)
    assert again.output_text == later.output_text and again.usage.input_tokens == later.usage.input_tokens
