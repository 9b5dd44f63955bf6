"""Logprobs and penalties through `kvgate serve` with the official openai client, parsed into its types; a
simulated worker answers (its tokens read ' t<id>' and have logprob 0)."""
from __future__ import annotations

import openai
import pytest

CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def client(gateway):
    c = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=30)
    yield c
    c.close()


def test_chat_with_top_logprobs_has_one_entry_per_token_in_openai_shape(client):
    out = client.chat.completions.create(model="simulated", messages=CHAT, max_tokens=5, logprobs=True,
                                         top_logprobs=3)
    choice = out.choices[0]
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert t.logprob == 0.0 and bytes(t.bytes).decode() == t.token
        assert [a.token for a in t.top_logprobs] == [t.token]  # the simulated model is sure of its token


def test_chat_without_logprobs_has_none(client):
    out = client.chat.completions.create(model="simulated", messages=CHAT, max_tokens=2)
    assert out.choices[0].logprobs is None


def test_streamed_chat_chunks_carry_the_logprobs_of_their_tokens(client):
    chunks = list(client.chat.completions.create(model="simulated", messages=CHAT, max_tokens=6, logprobs=True,
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(tokens) == 6 and "".join(t.token for t in tokens) == text
    assert all(t.top_logprobs == [] for t in tokens)  # logprobs=True alone: no alternatives


def test_completion_logprobs_in_the_legacy_shape(client):
    out = client.completions.create(model="simulated", prompt="hello there", max_tokens=4, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert lp.top_logprobs[0] == {lp.tokens[0]: 0.0}


def test_streamed_completion_offsets_continue_across_chunks(client):
    chunks = list(client.completions.create(model="simulated", prompt="hello there", max_tokens=5, logprobs=0,
                                            stream=True))
    with_lp = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    tokens = [t for lp in with_lp for t in lp.tokens]
    offsets = [o for lp in with_lp for o in lp.text_offset]
    assert len(tokens) == 5 and "".join(tokens) == "".join(c.choices[0].text for c in chunks)
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(5)]


def test_penalties_are_accepted_and_an_out_of_range_one_is_a_400_naming_it(client):
    out = client.chat.completions.create(model="simulated", messages=CHAT, max_tokens=2, frequency_penalty=1.5,
                                         presence_penalty=-0.5)
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="simulated", messages=CHAT, max_tokens=2, frequency_penalty=2.5)
    assert info.value.body["param"] == "frequency_penalty"
