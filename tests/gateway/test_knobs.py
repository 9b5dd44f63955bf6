"""Completions' echo (the prompt and its logprobs before the answer), max_tokens 0 with echo, best_of > n and chat's
template arguments, through `kvgate serve` with the official openai client in front of a simulated worker (its tokens read ' t<id>'
and are sure of themselves: logprob 0). The request lm-evaluation-harness's local-completions model sends for a
loglikelihood task is built as its source builds it (lm_eval/models/openai_completions.py, 0.4.13), here against the
simulated worker and so in make test-pythons' torch-free environments too; test_lm_eval.py runs lm-eval itself (the
evals extra) against SmolLM2."""
from __future__ import annotations

import openai
import pytest
import httpx

from kvgate.engine.cost_model_runner import SimulatedTokenizer


@pytest.fixture(scope="module")
def client(gateway):
    c = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=30)
    yield c
    c.close()


def test_echo_with_logprobs_puts_the_prompt_tokens_first_with_a_null_first_logprob(client):
    out = client.completions.create(model="simulated", prompt="one two three", max_tokens=2, logprobs=1, echo=True)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == 3 + 2 == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [0.0] * 4
    assert choice.text.startswith("one two three") and "".join(lp.tokens[3:]) == choice.text[len("one two three"):]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 2


def test_echo_with_max_tokens_0_answers_the_prompt_alone(client):
    out = client.completions.create(model="simulated", prompt="alpha beta", max_tokens=0, logprobs=0, echo=True)
    choice = out.choices[0]
    assert choice.text == "alpha beta" and len(choice.logprobs.tokens) == 2
    assert choice.logprobs.token_logprobs == [None, 0.0] and out.usage.completion_tokens == 0


def test_echo_without_logprobs_prepends_the_prompt_text(client):
    out = client.completions.create(model="simulated", prompt="say it", max_tokens=3, echo=True)
    assert out.choices[0].text.startswith("say it") and out.choices[0].logprobs is None


def test_lm_evals_loglikelihood_request_of_token_id_prompts_is_answered_as_it_parses_it(gateway):
    """lm-eval's LocalCompletionsAPI._create_payload(generate=False) and parse_logprobs: a batch of token-id prompts,
    echo, logprobs 1, max_tokens 1; it sums token_logprobs[ctxlen:-1] and checks each against max(top.values())."""
    contexts, continuations = [[11, 12, 13], [21, 22]], [[14, 15], [23]]
    prompts = [c + k for c, k in zip(contexts, continuations)]
    payload = {"model": "simulated", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
               "seed": 1234, "echo": True}
    out = httpx.post(gateway.base_url + "/completions", json=payload, timeout=30)
    assert out.status_code == 200, out.text
    choices = sorted(out.json()["choices"], key=lambda c: c["index"])
    text = SimulatedTokenizer(32000).decode
    for choice, ctx, prompt in zip(choices, contexts, prompts):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1  # the prompt, then the one generated token
        assert lp["tokens"][:len(prompt)] == [text([t]) for t in prompt]
        assert choice["text"].startswith(text(prompt))
        scored = lp["token_logprobs"][len(ctx):-1]
        assert len(scored) == len(prompt) - len(ctx) and sum(scored) == 0.0
        assert all(tok == max(top.values()) for tok, top in zip(scored, lp["top_logprobs"][len(ctx):-1]))


def test_best_of_answers_the_n_choices_of_highest_cumulative_logprob_without_logprobs_unless_asked(client):
    out = client.completions.create(model="simulated", prompt=["a b", "c d"], max_tokens=3, n=2, best_of=4, seed=5)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(c.logprobs is None for c in out.choices)
    assert out.usage.completion_tokens == 2 * 4 * 3  # every generated choice is counted, as OpenAI bills them


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "best_of": 1, "n": 2}, "best_of"),
    ({"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": "x", "echo": True, "stream": True}, "echo"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),  # the simulated model has no fill-in-the-middle tokens
    ({"prompt": "x", "suffix": 3}, "suffix"),
    ({"prompt": [1, 2], "suffix": "y"}, "suffix"),  # token ids: no text to put the FIM tokens around
    ({"prompt": "x", "suffix": "y", "echo": True}, "echo"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": True}},
     "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "no"}, "add_generation_prompt"),
    ({"prompt": "x", "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ({"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),  # completions ask with echo and logprobs
])
def test_what_is_not_honoured_is_a_400_naming_the_field(gateway, body, param):
    path = "/chat/completions" if "messages" in body else "/completions"
    out = httpx.post(gateway.base_url + path, json={"model": "simulated", **body}, timeout=30)
    assert out.status_code == 400 and out.json()["error"]["param"].startswith(param), out.text


def test_suffix_on_a_model_without_fim_tokens_is_refused_by_the_gateway_naming_the_model(gateway):
    out = httpx.post(gateway.base_url + "/completions", json={"model": "simulated", "prompt": "x", "suffix": "y"},
                     timeout=30)
    error = out.json()["error"]
    assert out.status_code == 400 and error["code"] == "fill_in_the_middle_unsupported", out.text
    assert error["param"] == "suffix" and "model 'simulated' has no fill-in-the-middle tokens" in error["message"]


def test_best_of_picks_each_prompts_n_results_of_highest_cumulative_logprob_in_order():
    from kvgate.gateway.settings import GatewaySettings
    from kvgate.gateway.chat.plan import plan
    from kvgate.producer import Result, TokenLogprob
    from kvgate.producer.protocol import Timings, Usage

    p = plan("completion", {"model": "m", "prompt": ["a", "b"], "n": 2, "best_of": 3}, GatewaySettings())
    assert len(p.submits) == 6 and all(s["logprobs"] == 0 for s in p.submits) and not p.show_logprobs

    def result(*logprobs):
        return Result("j", "done", "", [], "stop", None, Usage(), None, Timings(), None,
                      logprobs=[TokenLogprob(1, "x", b"x", lp) for lp in logprobs])
    results = [result(-1, -1), result(-0.5), result(-3), result(-2), result(-0.1, -0.1), result(-0.3)]
    assert [at for at, _ in p.picked(results)] == [1, 0, 4, 5]


def test_chat_template_arguments_reach_the_job(client):
    out = client.chat.completions.create(model="simulated", messages=[{"role": "user", "content": "one two"}],
                                         max_tokens=2, extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                                   "add_generation_prompt": False})
    # the simulated template: '<user> one two', without ' <assistant>'
    assert out.usage.prompt_tokens == 3


def test_continuous_usage_stats_give_every_chunk_its_choices_usage_so_far(client):
    chunks = list(client.completions.create(model="simulated", prompt="one two three", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    token_chunks = [c for c in chunks if c.choices and c.choices[0].text]
    assert len(token_chunks) == 5
    assert [c.usage.completion_tokens for c in token_chunks] == [1, 2, 3, 4, 5]
    assert all(c.usage.prompt_tokens == 3 and c.usage.total_tokens == 3 + c.usage.completion_tokens
               for c in token_chunks)
    last = chunks[-1]
    assert not last.choices and (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 5)
    plain = list(client.completions.create(model="simulated", prompt="one two", max_tokens=2, stream=True,
                                           stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1])  # only the last chunk, as OpenAI sends it
