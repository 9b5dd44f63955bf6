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
