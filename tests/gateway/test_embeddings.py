"""POST /v1/embeddings through the official `openai` client, LangChain's OpenAIEmbeddings and the SDK's embed, against
the bundled SmolLM2 in a `kvgate worker` subprocess (the shared `smol` fixture): the vectors are HF's pooled hidden
states, float and base64 alike."""
from __future__ import annotations

import asyncio
import math

import pytest

torch = pytest.importorskip("torch", reason="a real model needs the worker's torch (make test-pythons runs without it)")

TEXTS = ["The capital of France is Paris.", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def hf_last():
    """HF's final hidden state of each text's last token, scaled to unit length: the model's own pooling (a causal
    model's: last) with the default normalization."""
    from transformers import AutoModel

    from kvgate.engine.loader import resolve_model
    source = resolve_model("smollm2-135m")
    hf = AutoModel.from_pretrained(source.path, dtype=torch.float32).eval()
    with torch.no_grad():
        states = [hf(torch.tensor([source.tokenizer.encode(t)])).last_hidden_state[0, -1] for t in TEXTS]
    return [torch.nn.functional.normalize(s, dim=0).tolist() for s in states], source.tokenizer


def _near(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3


def test_embeddings_float_and_base64_through_the_openai_client_equal_hf(smol, hf_last):
    want, tokenizer = hf_last
    model = smol.models.list().data[0].id
    floats = smol.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    based = smol.embeddings.create(model=model, input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in floats.data] == [0, 1] and floats.object == "list" and floats.model == model
    for f, b, w in zip(floats.data, based.data, want):
        _near(f.embedding, w)
        assert b.embedding == pytest.approx(f.embedding, abs=1e-7)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    ids = smol.embeddings.create(model=model, input=[tokenizer.encode(t) for t in TEXTS], encoding_format="float")
    for by_ids, by_text in zip(ids.data, floats.data):
        assert by_ids.embedding == pytest.approx(by_text.embedding, abs=1e-6)
    cut = smol.embeddings.create(model=model, input=TEXTS[0], dimensions=32, encoding_format="float").data[0]
    assert len(cut.embedding) == 32 and math.isclose(sum(v * v for v in cut.embedding), 1.0, rel_tol=1e-5)


def test_embeddings_refuse_what_they_cannot_honour_with_a_400_naming_it(smol):
    import openai

    model = smol.models.list().data[0].id
    for kwargs, named in [({"input": ""}, "input"), ({"input": []}, "input"),
                          ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
                          ({"input": "hi", "extra_body": {"pooling_type": "mean"}}, "pooling_type")]:
        with pytest.raises(openai.BadRequestError) as e:
            smol.embeddings.create(model=model, **kwargs)
        assert e.value.body["param"] == named
    with pytest.raises(openai.BadRequestError, match="dimensions=4096 is more than model"):
        smol.embeddings.create(model=model, input="hi", dimensions=4096)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        smol.embeddings.create(model=model, input=[[10**9]])


def test_langchain_openai_embeddings_through_the_gateway(smol, hf_last):
    langchain_openai = pytest.importorskip("langchain_openai")
    want, _ = hf_last
    model = smol.models.list().data[0].id
    # check_embedding_ctx_length=False: send the texts; LangChain would otherwise send tiktoken's ids, which are
    # another tokenizer's ids for this model
    embeddings = langchain_openai.OpenAIEmbeddings(model=model, base_url=str(smol.base_url), api_key="unused",
                                                   check_embedding_ctx_length=False)
    docs = embeddings.embed_documents(TEXTS)
    for got, w in zip(docs, want):
        _near(got, w)
    _near(embeddings.embed_query(TEXTS[1]), want[1])


def test_the_sdk_embeds_with_client_and_async_client(smol, hf_last):
    from kvgate.producer import AsyncClient, Client, JobFailed

    want, tokenizer = hf_last
    url, ns = smol.kvgate
    model = smol.models.list().data[0].id
    with Client(url, ns) as client:
        vectors = client.embed(TEXTS, model=model, timeout=120)
        for got, w in zip(vectors, want):
            _near(got, w)
        mean = client.embed(tokenizer.encode(TEXTS[0]), model=model, pooling="mean", normalize=False, timeout=120)
        assert len(mean) == 1 and len(mean[0]) == 576 and abs(sum(v * v for v in mean[0]) - 1.0) > 1e-3
        with pytest.raises(JobFailed, match="dimensions=4096 is more than model"):
            client.embed("hi", model=model, dimensions=4096, timeout=120)

    async def run():
        async with AsyncClient(url, ns) as client:
            return await client.embed(TEXTS[1], model=model, dimensions=16, timeout=120)

    (short,) = asyncio.run(run())
    assert len(short) == 16 and math.isclose(sum(v * v for v in short), 1.0, rel_tol=1e-5)
