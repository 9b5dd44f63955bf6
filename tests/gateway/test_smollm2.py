"""A real answer through the gateway: the bundled SmolLM2-135M in a `kvgate worker` subprocess (CPU, ~15 s load)."""
from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="a real model needs the worker's torch (make test-pythons runs without it)")


def test_smollm2_answers_a_chat_through_the_openai_client(smol):
    model = smol.models.list().data[0].id
    out = smol.chat.completions.create(model=model, temperature=0, max_tokens=12,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens > 0
    stream = smol.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=6,
                                     stream=True)
    assert "Paris" in "".join(c.choices[0].text for c in stream)


def test_smollm2_logprobs_through_the_openai_client(smol):
    model = smol.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = smol.chat.completions.create(model=model, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3,
                                       messages=messages)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(t.token for t in content if t.token != "<|im_end|>") == out.choices[0].message.content
    for t in content:  # greedy: the chosen token heads its three alternatives
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.logprob == t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    streamed = [t for c in smol.chat.completions.create(model=model, temperature=0, max_tokens=8, logprobs=True,
                                                        top_logprobs=3, messages=messages, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.bytes) for t in streamed] == [(t.token, t.bytes) for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    legacy = smol.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=4,
                                     logprobs=2, frequency_penalty=0.5)
    lp = legacy.choices[0].logprobs
    assert "".join(lp.tokens) == legacy.choices[0].text and lp.text_offset[0] == 0
    assert all(len(top) == 2 and max(top.values()) == chosen for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))


def test_smollm2_answers_a_small_managed_batch(smol):
    from tests.gateway.batch_files import jsonl, rows_of, wait_final

    model = smol.models.list().data[0].id
    questions = {"france": "What is the capital of France?"}  # one line: the CPU model is slow
    rows = [{"custom_id": k, "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "temperature": 0, "max_tokens": 8, "messages": [{"role": "user", "content": q}]}}
            for k, q in questions.items()]
    f = smol.files.create(file=("q.jsonl", jsonl(rows)), purpose="batch")
    batch = smol.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_final(smol.batches.retrieve, batch.id, timeout=240)
    assert done.status == "completed" and done.request_counts.completed == 1
    answers = {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"]
               for r in rows_of(smol.files.content(done.output_file_id).content)}
    assert "Paris" in answers["france"]


def test_smollm2_tokenize_and_detokenize_equal_hfs_tokenizer_of_the_serving_model(smol):
    """vLLM's /tokenize and /detokenize over raw HTTP, answered by the worker, against transformers' own tokenizer
    of the bundled model: the prompt with and without special tokens, chat messages through the chat template."""
    import httpx

    from kvgate.engine.loader import resolve_model

    tok = resolve_model("smollm2-135m").tokenizer
    model = smol.models.list().data[0].id
    prompt = "Déjà vu: the café's naïve 🦊 ran 3×."
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    with httpx.Client(base_url=str(smol.base_url).rstrip("/").removesuffix("/v1"), timeout=240) as http:
        for special in (True, False):
            got = http.post("/tokenize", json={"model": model, "prompt": prompt, "add_special_tokens": special})
            assert got.status_code == 200, got.text
            expected = tok.encode(prompt, add_special_tokens=special)
            assert got.json() == {"count": len(expected), "max_model_len": 512, "tokens": expected, "token_strs": None}
        chat = http.post("/tokenize", json={"model": model, "messages": messages}).json()
        templated = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert chat["tokens"] == tok.encode(templated, add_special_tokens=False) and chat["count"] > len(expected)
        back = http.post("/detokenize", json={"model": model, "tokens": chat["tokens"]})
        assert back.status_code == 200
        assert back.json() == {"prompt": tok.decode(chat["tokens"])} == {"prompt": templated}


def test_smollm2_knobs_through_the_openai_client(smol):
    """Issue 29 end to end: logit_bias forces a token, min_tokens holds off the EOS it would force, echo scores the
    prompt (lm-eval's loglikelihood request), skip_special_tokens=False keeps the special tokens in the text."""
    from kvgate.engine.loader import resolve_model

    model = smol.models.list().data[0].id
    tokenizer = resolve_model("smollm2-135m").tokenizer
    paris, eos = tokenizer.encode(" Paris")[0], tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = smol.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=3,
                                  logit_bias={str(paris): 100})
    assert out.choices[0].text == " Paris" * 3
    out = smol.completions.create(model=model, prompt="Hi", temperature=0, max_tokens=8, logit_bias={str(eos): 100},
                                  extra_body={"min_tokens": 4, "skip_special_tokens": False})
    assert out.usage.completion_tokens == 5 and out.choices[0].text.endswith("<|im_end|>")
    prompt = "The capital of France is Paris"
    out = smol.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=0, logprobs=1, echo=True)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == prompt and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and all(v < 0 for v in lp.token_logprobs[1:])
    assert lp.top_logprobs[-1][" Paris"] == max(lp.top_logprobs[-1].values())  # the model is sure of its capital
    thinking = smol.chat.completions.create(model=model, temperature=0, max_tokens=2, messages=[
        {"role": "user", "content": "Hi"}], extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert thinking.usage.completion_tokens == 2
