"""The Responses API (issue 29) through the official openai client against `kvgate serve` and a simulated worker:
create with a string or message items, typed stream events, background responses read back and cancelled,
stored responses continued with previous_response_id, tenants, and every field not honoured refused by name.
Before: POST /v1/responses was a 404."""
from __future__ import annotations

import time

import httpx
import openai
import pytest
import redis

from kvgate.producer.keys import Keys
from kvgate.producer.protocol import FIELD, Job, decode_job

FINAL = ("completed", "incomplete", "failed", "cancelled")


@pytest.fixture(scope="module")
def client(gateway):
    c = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def until_final(client, rid: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while (r := client.responses.retrieve(rid)).status not in FINAL:
        assert time.monotonic() < deadline, f"{rid} still {r.status}"
        time.sleep(0.05)
    return r


def job_of(redis_url: str, ns: str, model: str, job_id: str) -> Job:
    """The job a response submitted, as the worker read it from the job stream."""
    r = redis.Redis.from_url(redis_url)
    try:
        for _, fields in r.xrange(Keys(ns).jobs(model, "normal")):
            job = decode_job(fields[FIELD.encode()])
            if job.job_id == job_id:
                return job
    finally:
        r.close()
    raise AssertionError(f"job {job_id} is not in the stream")


def job_messages(redis_url: str, ns: str, model: str, job_id: str) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in job_of(redis_url, ns, model, job_id).messages]


def test_a_string_input_is_answered_with_a_response_cut_at_max_output_tokens(client):
    out = client.responses.create(model="simulated", input="Hi there", instructions="Be brief.", max_output_tokens=5,
                                  temperature=0)
    assert out.object == "response" and out.id.startswith("resp_") and out.model == "simulated"
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"  # never stops early
    assert out.output_text.strip() and out.output[0].role == "assistant" and out.output[0].id.startswith("msg_")
    assert out.usage.output_tokens == 5 and out.usage.input_tokens > 0
    assert out.usage.total_tokens == out.usage.input_tokens + 5
    assert out.instructions == "Be brief." and out.max_output_tokens == 5 and out.temperature == 0
    assert out.store is True and out.background is False
    again = client.responses.retrieve(out.id)  # stored: OpenAI's default
    assert again.model_dump() == out.model_dump()


def test_message_items_with_text_parts_and_an_earlier_answer_are_one_conversation(client, sim_fleet):
    items = [{"role": "developer", "content": "Answer in one word."},
             {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
             {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
              "content": [{"type": "output_text", "text": "Blue.", "annotations": []}]},
             {"role": "user", "content": "Another."}]
    out = client.responses.create(model="simulated", input=items, max_output_tokens=3, top_p=0.9,
                                  extra_body={"seed": 4})
    assert out.top_p == 0.9 and out.usage.output_tokens == 3
    assert job_messages(*sim_fleet, "simulated", out.id.removeprefix("resp_")) == [
        ("system", "Answer in one word."), ("user", "Name a colour."), ("assistant", "Blue."), ("user", "Another.")]


def test_user_safety_identifier_and_metadata_are_kept_with_the_job(client, sim_fleet):
    out = client.responses.create(model="simulated", input="x", max_output_tokens=2, user="u-1",
                                  safety_identifier="s-1", metadata={"team": "a"})
    assert out.user == "u-1" and out.safety_identifier == "s-1" and out.metadata == {"team": "a"}
    job = job_of(*sim_fleet, "simulated", out.id.removeprefix("resp_"))
    assert job.metadata == {"team": "a", "user": "u-1", "safety_identifier": "s-1"}


def test_the_stream_is_the_typed_events_numbered_in_order_and_joins_to_the_answer(client):
    ask = dict(model="simulated", input="stream me", max_output_tokens=6, extra_body={"seed": 3})
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    last = events[-1].response
    assert last.output_text == text and last.usage.output_tokens == 6 and last.incomplete_details.reason == \
        "max_output_tokens"
    assert client.responses.retrieve(last.id).output_text == text


def test_a_background_response_answers_queued_at_once_and_is_read_back_when_done(client):
    out = client.responses.create(model="simulated", input="later", max_output_tokens=4, background=True)
    assert out.status == "queued" and out.background is True and out.output == []
    done = until_final(client, out.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 4 and done.output_text.strip()


def test_a_background_response_waiting_for_its_model_is_cancelled_and_stays_cancelled(sim_fleet, gateway_factory):
    gw = gateway_factory(*sim_fleet, models=["nobody-serves-this"])
    with openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        out = c.responses.create(model="nobody-serves-this", input="x", background=True)
        assert c.responses.retrieve(out.id).status == "queued"
        assert c.responses.cancel(out.id).status == "cancelled"
        assert c.responses.retrieve(out.id).status == "cancelled"
        assert c.responses.cancel(out.id).status == "cancelled"  # again: the same answer
        done = c.responses.create(model="simulated", input="x", max_output_tokens=2, background=True)
        until_final(c, done.id)
        with pytest.raises(openai.ConflictError) as caught:
            c.responses.cancel(done.id)
        assert caught.value.body["code"] == "response_not_cancellable"
        sync = c.responses.create(model="simulated", input="x", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError) as caught:
            c.responses.cancel(sync.id)
        assert caught.value.body["code"] == "not_background"


def test_a_background_stream_that_goes_quiet_ends_with_an_error_event_and_its_job_runs_on(sim_fleet,
                                                                                             gateway_factory):
    gw = gateway_factory(*sim_fleet, models=["nobody-serves-this"], request_timeout_s=0.5)
    with openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        events = list(c.responses.create(model="nobody-serves-this", input="x", background=True, stream=True))
        assert [e.type for e in events] == ["response.created", "response.queued", "response.in_progress",
                                            "response.output_item.added", "response.content_part.added", "error"]
        assert events[-1].code == "timeout" and "runs on" in events[-1].message
        rid = events[0].response.id
        assert c.responses.retrieve(rid).status == "queued"  # not cancelled: only cancel stops a background job
        assert c.responses.cancel(rid).status == "cancelled"


def test_previous_response_id_continues_the_stored_conversation_without_its_instructions(client, sim_fleet):
    first = client.responses.create(model="simulated", input="My name is Ada.", instructions="Be kind.",
                                    max_output_tokens=3)
    second = client.responses.create(model="simulated", input="What is my name?", previous_response_id=first.id,
                                     instructions="Be short.", max_output_tokens=3)
    assert second.previous_response_id == first.id
    assert job_messages(*sim_fleet, "simulated", second.id.removeprefix("resp_")) == [
        ("system", "Be short."), ("user", "My name is Ada."), ("assistant", first.output_text),
        ("user", "What is my name?")]
    third = client.responses.create(model="simulated", input="And again?", previous_response_id=second.id,
                                    max_output_tokens=2)
    assert [m[1] for m in job_messages(*sim_fleet, "simulated", third.id.removeprefix("resp_"))] == [
        "My name is Ada.", first.output_text, "What is my name?", second.output_text, "And again?"]


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_flat_function_tools_and_tool_choice_become_the_jobs_tools_and_are_repeated(client, sim_fleet):
    tools = [{"type": "function", "name": "get_weather", "description": "The weather", "parameters": WEATHER,
              "strict": True},
             {"type": "function", "name": "get_time", "parameters": None, "strict": False}]
    out = client.responses.create(model="simulated", input="Weather in Paris?", tools=tools, parallel_tool_calls=False,
                                  max_output_tokens=3)
    assert out.tool_choice == "auto" and out.parallel_tool_calls is False
    assert [t.name for t in out.tools] == ["get_weather", "get_time"] and out.tools[0].parameters == WEATHER
    assert out.output[0].type == "message"  # the simulated model writes no call: its text is the message
    job = job_of(*sim_fleet, "simulated", out.id.removeprefix("resp_"))
    assert job.tools.choice == "auto" and job.tools.parallel is False
    assert [(f.name, f.description) for f in job.tools.functions] == [("get_weather", "The weather"), ("get_time", "")]
    named = client.responses.create(model="simulated", input="x", tools=tools, max_output_tokens=2, background=True,
                                    tool_choice={"type": "function", "name": "get_time"})
    job = job_of(*sim_fleet, "simulated", named.id.removeprefix("resp_"))
    assert (job.tools.choice, job.tools.function) == ("function", "get_time")
    assert named.tool_choice.type == "function" and named.tool_choice.name == "get_time"
    until_final(client, named.id)
    none = client.responses.create(model="simulated", input="x", tools=tools, tool_choice="none", max_output_tokens=2)
    assert job_of(*sim_fleet, "simulated", none.id.removeprefix("resp_")).tools is None  # not shown, as chat's none


def test_function_call_items_and_their_outputs_are_the_assistants_calls_and_the_tool_answers(client, sim_fleet):
    items = [{"role": "user", "content": "Weather in Paris and Rome?"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
             {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather",
              "arguments": '{"city": "Paris"}', "status": "completed"},
             {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "call_a", "output": "18 C"},
             {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "21 C"}]}]
    out = client.responses.create(model="simulated", input=items, max_output_tokens=2,
                                  tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}])
    messages = job_of(*sim_fleet, "simulated", out.id.removeprefix("resp_")).messages
    assert [(m.role, m.content, m.tool_call_id) for m in messages] == [
        ("user", "Weather in Paris and Rome?", None), ("assistant", "Looking.", None), ("tool", "18 C", "call_a"),
        ("tool", "21 C", "call_b")]
    assert [(c.id, c.name, c.arguments) for c in messages[1].tool_calls] == [
        ("call_a", "get_weather", '{"city": "Paris"}'), ("call_b", "get_weather", '{"city": "Rome"}')]
    listed = client.responses.input_items.list(out.id, order="asc").data
    assert [i.type for i in listed] == ["message", "message", "function_call", "function_call",
                                        "function_call_output", "function_call_output"]
    assert [(i.call_id, i.name, i.arguments) for i in listed[2:4]] == [
        ("call_a", "get_weather", '{"city": "Paris"}'), ("call_b", "get_weather", '{"city": "Rome"}')]
    assert [(i.call_id, i.output) for i in listed[4:]] == [("call_a", "18 C"), ("call_b", "21 C")]
    assert len({i.id for i in listed}) == len(listed)


def test_input_items_are_the_requests_own_input_in_pages(client):
    first = client.responses.create(model="simulated", input="one", max_output_tokens=2)
    items = [{"role": "user", "content": f"m{i}"} for i in range(3)]
    out = client.responses.create(model="simulated", input=items, previous_response_id=first.id,
                                  instructions="not an item", max_output_tokens=2)
    page = client.responses.input_items.list(out.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["m0", "m1"] and page.has_more
    assert [i.content[0].text for i in client.responses.input_items.list(out.id, order="asc", after=page.last_id)
            .data] == ["m2"]
    assert [i.content[0].text for i in client.responses.input_items.list(out.id)] == ["m2", "m1", "m0"]  # desc
    assert all(i.role == "user" and i.type == "message" for i in page.data)


def test_store_false_keeps_nothing_to_read_or_continue(client):
    out = client.responses.create(model="simulated", input="forget me", max_output_tokens=2, store=False)
    assert out.store is False
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(out.id)
    assert caught.value.body["code"] == "response_not_found"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="simulated", input="x", previous_response_id=out.id)
    assert caught.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_not-a-kvgate-id")


def test_a_deleted_response_is_gone(client):
    out = client.responses.create(model="simulated", input="x", max_output_tokens=2)
    client.responses.delete(out.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)


def test_another_tenants_response_is_answered_as_one_that_does_not_exist(sim_fleet, gateway_factory):
    gw = gateway_factory(*sim_fleet, api_keys=["sk-resp-a=team-a", "sk-resp-b=team-b"])
    a = openai.OpenAI(base_url=gw.base_url, api_key="sk-resp-a", max_retries=0, timeout=60)
    b = openai.OpenAI(base_url=gw.base_url, api_key="sk-resp-b", max_retries=0, timeout=60)
    with a, b:
        mine = a.responses.create(model="simulated", input="secret", max_output_tokens=2, background=True)
        for call in (lambda: b.responses.retrieve(mine.id), lambda: b.responses.cancel(mine.id),
                     lambda: b.responses.delete(mine.id)):
            with pytest.raises(openai.NotFoundError):
                call()
        with pytest.raises(openai.BadRequestError) as caught:
            b.responses.create(model="simulated", input="x", previous_response_id=mine.id)
        assert caught.value.body["code"] == "previous_response_not_found"
        assert until_final(a, mine.id).status == "incomplete"


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}, {"type": "file_search"}]}, "tools[1].type"),
    ({"tools": [{"type": "function", "name": "f", "function": {"name": "f"}}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "name": "not a name"}]}, "tools"),
    ({"tools": {"type": "function", "name": "f"}}, "tools"),
    ({"tools": ["get_weather"]}, "tools[0]"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 1}]}, "input[0].output"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1", "role": "tool"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "call_id": "c",
                 "output": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0].output[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"background": True, "store": False}, "store"),
    ({"temperature": 7000}, "temperature"),
    ({"input": [{"role": "user", "content": "x"}] * 300}, "input"),  # over the messages a job may hold
    ({"text": {"format": {"type": "json_object"}}, "structured": {"kind": "regex", "spec": "a"}}, "text.format"),
])
def test_what_is_not_honoured_is_a_400_naming_it(client, extra, param):
    body = {"model": "simulated", "input": "x"} | extra
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/responses", body=body, cast_to=object)
    assert caught.value.body["param"] == param, caught.value.body
    assert param.split("[")[0].split(".")[0] in caught.value.body["message"]


def test_resuming_a_stream_on_retrieve_is_refused_by_name(client):
    out = client.responses.create(model="simulated", input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as caught:
        client.get(f"/responses/{out.id}", options={"params": {"stream": "true"}}, cast_to=object)
    assert caught.value.body["param"] == "stream"


@pytest.mark.parametrize("body, param", [
    ([1, 2], "body"),
    ({"model": "simulated", "input": 5}, "input"),
    ({"model": "simulated", "input": ["x"]}, "input[0]"),
    ({"model": "simulated", "input": [{"role": "user", "content": ["x"]}]}, "input[0].content[0].type"),
    ({"model": "simulated", "input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
     "input[0].content[0].text"),
    ({"model": "simulated", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"model": "simulated", "input": [{"role": "user", "content": "x", "name": "bob"}]}, "input[0].name"),
    ({"model": "simulated", "input": "x", "instructions": ["a"]}, "instructions"),
    ({"model": "simulated", "input": "x", "stream": "yes"}, "stream"),
    ({"model": "simulated", "input": "x", "background": "no"}, "background"),
    ({"model": "simulated", "input": "x", "text": "json"}, "text"),
    ({"model": "simulated", "input": "x", "text": {"format": {"type": "json_schema", "schema": "[1"}}},
     "text.format.schema"),
    ({"model": "simulated", "input": "x", "include": "logprobs"}, "include"),
    ({"model": "simulated", "input": "x", "metadata": ["a"]}, "metadata"),
    ({"model": "simulated", "input": "x", "safety_identifier": 7}, "safety_identifier"),
    ({"model": "simulated", "input": "x", "previous_response_id": 7}, "previous_response_id"),
    ({"model": "simulated", "input": "x", "previous_response_id": "resp_" + "0" * 32}, "previous_response_id"),
    ({"input": "x"}, "model"),
])
def test_malformed_bodies_are_400s_naming_the_field_never_500s(gateway, body, param):
    reply = httpx.post(f"{gateway.base_url}/responses", json=body, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_any_replica_answers_a_background_response_whose_gateway_is_gone(sim_fleet, gateway_factory):
    """The record and the job's result are in Redis: a second replica reads the response, records its end, and a
    third continues it, though the replica that took it stopped before its job finished."""
    first, second = gateway_factory(*sim_fleet), gateway_factory(*sim_fleet)
    with openai.OpenAI(base_url=first.base_url, api_key="unused", max_retries=0, timeout=60) as a:
        out = a.responses.create(model="simulated", input="hand over", max_output_tokens=3, background=True)
    first.stop()
    with openai.OpenAI(base_url=second.base_url, api_key="unused", max_retries=0, timeout=60) as b:
        done = until_final(b, out.id)
        assert done.status == "incomplete" and done.usage.output_tokens == 3
        later = b.responses.create(model="simulated", input="go on", previous_response_id=out.id,
                                   max_output_tokens=2)
        assert later.status == "incomplete"


def test_a_record_shares_its_jobs_slot_on_a_redis_cluster():
    from kvgate.gateway.responses.store import record_key

    keys = Keys("ns", shards=6, cluster=True)
    for job_id in ("0" * 32, "f" * 32, "0123456789abcdef" * 2):
        tag = keys.result(job_id).split("}")[0]
        assert record_key(keys, "resp_" + job_id, job_id).startswith(tag + "}:response:resp_")
    assert len({keys.result(j).split("}")[0] for j in ("0" * 32, "f" * 32, "0123456789abcdef" * 2)}) > 1
