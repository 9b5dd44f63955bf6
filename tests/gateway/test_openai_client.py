"""The official openai client (sync, async, streaming) against `kvgate serve` and a simulated worker."""
from __future__ import annotations

import asyncio

import openai
import pytest


@pytest.fixture(scope="module")
def client(gateway):
    c = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def test_chat_completion_answers_with_text_finish_reason_and_usage(client):
    out = client.chat.completions.create(model="simulated", max_tokens=5, temperature=0,
                                         messages=[{"role": "developer", "content": "Be brief."},
                                                   {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and out.model == "simulated"
    choice = out.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason == "length"  # the simulated engine never stops early
    assert out.usage.completion_tokens == 5 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 5


def test_max_completion_tokens_bounds_the_answer(client):
    out = client.chat.completions.create(model="simulated", max_completion_tokens=3,
                                         messages=[{"role": "user", "content": "Count"}])
    assert out.usage.completion_tokens == 3


def test_the_same_seed_gives_the_same_answer_and_n_gives_n_distinct_choices(client):
    ask = dict(model="simulated", max_tokens=8, temperature=1.0, seed=7, messages=[{"role": "user", "content": "x"}])
    first, second = client.chat.completions.create(**ask), client.chat.completions.create(**ask)
    assert first.choices[0].message.content == second.choices[0].message.content
    three = client.chat.completions.create(**ask, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.usage.completion_tokens == 24
    assert three.usage.prompt_tokens == first.usage.prompt_tokens  # one prompt, counted once


def test_completions_take_a_string_an_array_of_strings_and_token_ids(client):
    one = client.completions.create(model="simulated", prompt="Once upon a time", max_tokens=4)
    assert one.object == "text_completion" and one.choices[0].text.strip() and one.usage.completion_tokens == 4
    many = client.completions.create(model="simulated", prompt=["a b c", "d e"], max_tokens=2, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.usage.prompt_tokens == 3 + 2  # the simulated tokenizer: one token per word
    ids = client.completions.create(model="simulated", prompt=[5, 6, 7], max_tokens=2)
    assert ids.usage.prompt_tokens == 3
    nested = client.completions.create(model="simulated", prompt=[[5, 6], [7]], max_tokens=2)
    assert nested.usage.prompt_tokens == 3 and len(nested.choices) == 2


def test_streamed_chat_chunks_join_to_the_answer_and_end_with_usage(client):
    ask = dict(model="simulated", max_tokens=6, seed=3, messages=[{"role": "user", "content": "stream me"}])
    whole = client.chat.completions.create(**ask).choices[0].message.content
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_completion_with_n_2_streams_each_choice_by_index(client):
    chunks = list(client.completions.create(model="simulated", prompt="go on", max_tokens=5, n=2, seed=1,
                                            stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].text
    whole = client.completions.create(model="simulated", prompt="go on", max_tokens=5, n=2, seed=1)
    assert texts == {c.index: c.text for c in whole.choices}
    assert all(c.usage is None for c in chunks)  # not asked for


def test_the_async_client_runs_concurrent_requests_and_streams(gateway):
    async def main():
        async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0) as c:
            ask = dict(model="simulated", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
            outs = await asyncio.gather(*(c.chat.completions.create(**ask, seed=i) for i in range(8)))
            stream = await c.chat.completions.create(**ask, seed=0, stream=True)
            streamed = "".join([ch.choices[0].delta.content or "" async for ch in stream])
            return outs, streamed

    outs, streamed = asyncio.run(main())
    assert len({o.id for o in outs}) == 8 and all(o.usage.completion_tokens == 4 for o in outs)
    assert streamed == outs[0].choices[0].message.content


def test_models_lists_what_live_workers_serve(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["simulated"] and models[0].owned_by == "kvgate"
    assert client.models.retrieve("simulated").id == "simulated"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
