"""Structured output through a real gateway and worker (issue 25): the official client's `parse` with a pydantic model,
`response_format` json_schema, vLLM's guided_choice / guided_regex and structured_outputs extra body, the SDK's
`response_format=` with `Result.parsed`, and a constraint that cannot compile answered 400 while the rest are served.
Before: every one of these bodies was a 400 (`response_format={'type': 'json_object'} is not supported`)."""
from __future__ import annotations

import json
import re

import openai
import pytest
from pydantic import BaseModel, Field

pytest.importorskip("torch", reason="a real model needs the worker's torch (make test-pythons runs without it)")
pytest.importorskip("llguidance")

import jsonschema  # noqa: E402

from kvgate.producer import Client  # noqa: E402


class City(BaseModel):
    name: str = Field(max_length=16)
    country: str = Field(max_length=16)
    population_millions: int = Field(ge=0, le=50)


def model_of(client) -> str:
    return client.models.list().data[0].id


def test_the_openai_clients_parse_and_response_format_give_valid_json(smol):
    model = model_of(smol)
    parsed = smol.chat.completions.parse(model=model, temperature=0, max_tokens=48, response_format=City,
                                         messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and parsed.choices[0].finish_reason == "stop"
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    out = smol.chat.completions.create(model=model, temperature=0.8, seed=5, max_tokens=24,
                                       messages=[{"role": "user", "content": "Is the sky blue?"}],
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "a", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_vllm_guided_extra_body_through_the_gateway(smol):
    model = model_of(smol)
    msg = [{"role": "user", "content": "Pick one."}]
    choice = smol.chat.completions.create(model=model, temperature=0.8, seed=1, max_tokens=6, messages=msg,
                                          extra_body={"guided_choice": ["left", "right"]})
    assert choice.choices[0].message.content in ("left", "right")
    regex = smol.completions.create(model=model, prompt="The year was", temperature=0, max_tokens=8,
                                    extra_body={"structured_outputs": {"regex": "1[89][0-9]{2}"}})
    assert re.fullmatch("1[89][0-9]{2}", regex.choices[0].text)


def test_a_constraint_that_does_not_compile_is_a_400_and_the_worker_serves_the_rest(smol):
    model = model_of(smol)
    with pytest.raises(openai.BadRequestError) as caught:
        smol.chat.completions.create(model=model, max_tokens=5, messages=[{"role": "user", "content": "x"}],
                                     response_format={"type": "json_schema", "json_schema": {
                                         "name": "bad", "schema": {"type": "object", "properties": {
                                             "a": {"type": "string", "pattern": "(" * 3000 + "a" + ")+" * 3000}}}}})
    assert "rejected" in str(caught.value)
    with pytest.raises(openai.BadRequestError) as caught:  # refused at the gateway: not a schema at all
        smol.chat.completions.create(model=model, max_tokens=5, messages=[{"role": "user", "content": "x"}],
                                     extra_body={"guided_json": "[1, 2"})
    assert caught.value.body["param"] == "guided_json"
    out = smol.chat.completions.create(model=model, temperature=0, max_tokens=6, extra_body={"guided_choice": ["ok"]},
                                       messages=[{"role": "user", "content": "Say ok."}])
    assert out.choices[0].message.content == "ok"


def test_the_sdk_takes_a_pydantic_model_and_gives_the_parsed_object(smol):
    url, ns = smol.kvgate
    with Client(url, ns) as client:
        handle = client.submit(messages=[{"role": "user", "content": "Describe Rome as JSON."}], temperature=0,
                               max_tokens=48, response_format=City, model=model_of(smol))
        result = handle.result(timeout=240)
    assert result.ok and isinstance(result.parsed, City), (result.text, result.parse_error)


def test_a_schema_with_no_finite_instance_is_a_400_naming_the_grammar_engines_message(smol):
    """Issue 45, break 3. Before: 200, finish_reason stop, content `{"` (the grammar engine had stopped in error)."""
    endless = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
    with pytest.raises(openai.BadRequestError) as caught:
        out = smol.chat.completions.create(
            model=model_of(smol), temperature=0, max_tokens=40,
            messages=[{"role": "user", "content": "Describe a linked list as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "endless", "schema": endless}})
        pytest.fail(f"answered {out.choices[0].finish_reason} with {out.choices[0].message.content!r}")
    assert "Too many items" in str(caught.value) and "json_schema" in str(caught.value), str(caught.value)


def test_a_simulated_worker_answers_a_json_schema_and_a_forced_tool_call(gateway):
    """Issue 45. Before: a 400 for both, `structured output: Only fast tokenizers are supported` (the simulated
    engine's tokenizer was none the grammar engine could read), so no fleet test or benchmark could run one."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=60)
    model = model_of(client)
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "rank"],
              "properties": {"city": {"type": "string", "maxLength": 12},
                             "rank": {"type": "integer", "minimum": 1, "maximum": 9}}}
    out = client.chat.completions.create(model=model, max_tokens=60, messages=[{"role": "user", "content": "x"}],
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "c", "schema": schema}})
    assert out.choices[0].finish_reason == "stop", out.choices[0]
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    tool = {"type": "function", "function": {"name": "rank_city", "description": "Rank a city", "parameters": schema}}
    called = client.chat.completions.create(model=model, max_tokens=80, tools=[tool], tool_choice="required",
                                            parallel_tool_calls=False,  # one call: a list of them may run to length
                                            messages=[{"role": "user", "content": "Rank Paris."}])
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "rank_city" and called.choices[0].finish_reason == "tool_calls", called.choices[0]
    jsonschema.validate(json.loads(call.function.arguments), schema)
