"""Request translation without a server: what each OpenAI body becomes as SDK submits, and what is refused."""
from __future__ import annotations

import pytest

from kvgate.gateway import GatewaySettings
from kvgate.gateway.errors import ApiError
from kvgate.gateway.chat.plan import plan

S = GatewaySettings(default_max_tokens=77, max_n=4)


def _refused(kind: str, body: dict) -> ApiError:
    with pytest.raises(ApiError) as e:
        plan(kind, body, S)
    assert e.value.status == 400
    return e.value


def test_developer_becomes_system_and_text_parts_join_with_newlines():
    p = plan("chat", {"model": "m", "messages": [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok", "tool_calls": [], "refusal": None}]}, S)
    assert p.submits[0]["messages"] == [{"role": "system", "content": "rules"}, {"role": "user", "content": "a\nb"},
                                        {"role": "assistant", "content": "ok"}]


def test_defaults_user_metadata_and_extensions_reach_the_submit():
    p = plan("completion", {"model": "m", "prompt": "x", "user": "alice", "top_k": 5, "priority": "high"}, S)
    assert p.submits == [{"prompt": "x", "max_tokens": 77, "stream": False, "metadata": {"user": "alice"},
                          "top_k": 5, "priority": "high", "model": "m"}]  # the model routes the job


def test_n_copies_each_prompt_with_successive_seeds():
    p = plan("completion", {"model": "m", "prompt": ["a", "b"], "n": 2, "seed": 10, "max_tokens": 3}, S)
    assert [(s["prompt"], s["seed"]) for s in p.submits] == [("a", 10), ("a", 11), ("b", 10), ("b", 11)]
    assert p.prompt_of == [0, 0, 1, 1]


def test_too_many_choices_disagreeing_max_tokens_and_tool_messages_are_refused():
    assert _refused("completion", {"model": "m", "prompt": ["a", "b", "c"], "n": 2}).param == "n"
    assert _refused("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                             "max_completion_tokens": 4}).param == "max_completion_tokens"
    # a tool's answer names the call it answers (tool calling, issue 25); the deprecated function role stays refused
    assert _refused("chat", {"model": "m", "messages": [{"role": "tool", "content": "x"}]}).param == \
        "messages[0].tool_call_id"
    assert _refused("chat", {"model": "m", "messages": [{"role": "function", "content": "x", "name": "f"}]}).param \
        == "messages[0].role"
    assert _refused("completion", {"model": "m", "prompt": ["ok", ""]}).param == "prompt[1]"
    assert _refused("completion", {"model": "m", "prompt": "x", "best_of": 1, "n": 2}).param == "best_of"
    assert _refused("completion", {"model": "m", "prompt": ["a", "b"], "best_of": 3}).param == "best_of"  # 6 > 4
    assert len(plan("completion", {"model": "m", "prompt": "x", "best_of": 3}, S).submits) == 3


def test_prompt_cache_key_becomes_the_jobs_prefix_key_and_a_bad_one_is_named():
    p = plan("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": "t-7"}, S)
    assert p.submits[0]["prefix_key"] == "t-7"
    assert "prompt_cache_key" in str(_refused("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                       "prompt_cache_key": ""}).body)


def test_penalties_and_logprobs_become_submit_arguments():
    chat = plan("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "frequency_penalty": 1.5,
                         "presence_penalty": -0.5, "logprobs": True, "top_logprobs": 4}, S)
    assert {k: chat.submits[0][k] for k in ("frequency_penalty", "presence_penalty", "logprobs")} == \
        {"frequency_penalty": 1.5, "presence_penalty": -0.5, "logprobs": 4}
    assert plan("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True}, S) \
        .submits[0]["logprobs"] == 0
    assert "logprobs" not in plan("completion", {"model": "m", "prompt": "x"}, S).submits[0]
    assert plan("completion", {"model": "m", "prompt": "x", "logprobs": 0}, S).submits[0]["logprobs"] == 0
    assert _refused("completion", {"model": "m", "prompt": "x", "top_logprobs": 2}).param == "top_logprobs"


def test_vllms_integer_priority_maps_onto_the_three_bands_lower_first():
    bands = [plan("completion", {"model": "m", "prompt": "x", "priority": v}, S).submits[0]["priority"]
             for v in (-5, -1, 0, 1, 10, "high", "low")]
    assert bands == ["high", "high", "normal", "low", "low", "high", "low"]
    assert _refused("completion", {"model": "m", "prompt": "x", "priority": 1.5}).param == "priority"
    assert _refused("completion", {"model": "m", "prompt": "x", "priority": True}).param == "priority"
