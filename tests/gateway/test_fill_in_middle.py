"""`suffix` on /v1/completions (fill-in-the-middle): rendered with the FIM tokens of a model that has them, refused
naming suffix and the model for one that has none. The FIM model is a tiny random Llama in an HF folder built here,
with SmolLM2's tokenizer plus StarCoder's three FIM tokens: no downloads."""
from __future__ import annotations

import os

import openai
import pytest

pytest.importorskip("torch", reason="a real model needs the worker's torch (make test-pythons runs without it)")

from kvgate.producer import Client  # noqa: E402

from .conftest import running_worker, start_gateway  # noqa: E402

FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
PROMPT, SUFFIX = "def add(a, b):\n    return", "\n\nprint(add(1, 2))\n"


def tiny_fim_folder(root):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvgate.engine.loader import resolve_model
    try:
        smollm2 = resolve_model("smollm2-135m").path
    except Exception as e:  # the bundled model package is optional
        pytest.skip(f"bundled SmolLM2 tokenizer unavailable: {e}")
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    tokenizer.add_special_tokens({"additional_special_tokens": list(FIM_TOKENS)})
    folder = root / "tiny-fim"
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(config).save_pretrained(folder)  # safetensors
    return folder, tokenizer


@pytest.fixture(scope="module")
def fim(shared_redis, tmp_path_factory):
    """A worker serving the tiny FIM model as `tiny-fim`, a gateway before it and the official client; with
    `.kvgate` = (redis url, namespace) and `.tokenizer`."""
    folder, tokenizer = tiny_fim_folder(tmp_path_factory.mktemp("fim"))
    with running_worker(shared_redis.url, f"gwfim{os.getpid()}", "--model", str(folder), "--served-model-name",
                        "tiny-fim", "--max-model-len", "256", "--max-num-seqs", "4", worker_id="gw-fim",
                        timeout=300) as (url, ns):
        gw = start_gateway(url, ns)
        client = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=240)
        client.kvgate, client.tokenizer = (url, ns), tokenizer
        try:
            yield client
        finally:
            client.close()
            gw.stop()


def test_a_fim_model_reads_prefix_token_prompt_suffix_token_suffix_middle_token(fim):
    tok = fim.tokenizer
    prefix, suffix, middle = tok.convert_tokens_to_ids(list(FIM_TOKENS))
    expected = [prefix, *tok.encode(PROMPT, add_special_tokens=False), suffix,
                *tok.encode(SUFFIX, add_special_tokens=False), middle]
    out = fim.completions.create(model="tiny-fim", prompt=PROMPT, suffix=SUFFIX, max_tokens=4, temperature=0)
    assert out.usage.prompt_tokens == len(expected) and out.usage.completion_tokens == 4
    streamed = fim.completions.create(model="tiny-fim", prompt=PROMPT, suffix=SUFFIX, max_tokens=4, temperature=0,
                                      stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text
    # the worker's side: the prompt tokens the engine scored are exactly the FIM rendering
    url, ns = fim.kvgate
    with Client(url, namespace=ns) as sdk:
        r = sdk.submit(PROMPT, suffix=SUFFIX, model="tiny-fim", max_tokens=1, prompt_logprobs=0).result(timeout=120)
    assert r.status == "done", r.error
    assert [t.id for t in r.prompt_logprobs] == expected
    plain = fim.completions.create(model="tiny-fim", prompt=PROMPT, max_tokens=1, temperature=0)
    assert plain.usage.prompt_tokens == len(tok.encode(PROMPT))  # no suffix: the prompt alone, as before


def test_suffix_on_a_model_without_fim_tokens_is_a_400_naming_suffix_and_the_model_before_queueing(smol):
    model = smol.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        smol.completions.create(model=model, prompt=PROMPT, suffix=SUFFIX, max_tokens=4)
    error = e.value.body
    assert error["param"] == "suffix" and error["code"] == "fill_in_the_middle_unsupported", error
    assert f"model {model!r} has no fill-in-the-middle tokens" in error["message"]


def test_a_worker_whose_model_has_no_fim_tokens_answers_a_suffix_job_with_an_error_naming_both(smol):
    """A job that reaches the worker anyway (an SDK submit, a gateway whose snapshot had no live worker): an error
    result, and the worker goes on serving."""
    model = smol.models.list().data[0].id
    url, ns = smol.kvgate
    with Client(url, namespace=ns) as sdk:
        r = sdk.submit(PROMPT, suffix=SUFFIX, model=model, max_tokens=4).result(timeout=120)
        assert r.status == "error" and "suffix" in r.error and repr(model) in r.error, r.error
        assert "fill-in-the-middle" in r.error
        assert sdk.submit("Hello", model=model, max_tokens=2).result(timeout=120).status == "done"
