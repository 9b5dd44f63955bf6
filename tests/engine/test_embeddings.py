"""Embedding requests: the pooled final hidden states of the bundled SmolLM2 equal HF's, whole or computed in chunks,
and they leave the KV cache and the prefix cache as they found them."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvgate.engine import LLM, PoolingParams, SamplingParams
from kvgate.engine.block_manager import chain_hash
from kvgate.engine.outputs import RequestRejected

PROMPTS = ["The capital of France is Paris, a city on the Seine.", "def fibonacci(n):",
           "Embeddings map text to vectors; similar texts land close together in that space. " * 3]


@pytest.fixture(scope="module")
def hf_states():
    from kvgate.engine.loader import resolve_model
    from transformers import AutoModel
    source = resolve_model("smollm2-135m")
    hf = AutoModel.from_pretrained(source.path, dtype=torch.float32).eval()
    states = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([source.tokenizer.encode(p)])
            states.append(hf(ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0])  # after the last norm
    return states


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", max_num_batched_tokens=32, kv_cache_memory=16 << 20)


def _close(got: list[float], want: torch.Tensor) -> None:
    assert len(got) == len(want)
    torch.testing.assert_close(torch.tensor(got), want.float(), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_pooled_vectors_equal_hf_hidden_states_pooled_also_when_the_prompt_is_chunked(llm, hf_states, pooling):
    raw = llm.embed(PROMPTS, PoolingParams(pooling, normalize=False), use_tqdm=False)
    assert len(hf_states[2]) > llm.engine.config.max_num_batched_tokens  # the third prompt is computed in chunks
    for out, states in zip(raw, hf_states):
        want = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[pooling]
        _close(out.embedding, want)
    unit = llm.embed(PROMPTS, PoolingParams(pooling), use_tqdm=False)
    for out, r in zip(unit, raw):
        _close(out.embedding, F.normalize(torch.tensor(r.embedding), dim=0))


def test_dimensions_cut_the_vector_then_scale_it_to_unit_length(llm, hf_states):
    out = llm.embed(PROMPTS[0], PoolingParams("mean", dimensions=64), use_tqdm=False)[0]
    _close(out.embedding, F.normalize(hf_states[0].mean(0)[:64], dim=0))
    assert math.isclose(sum(v * v for v in out.embedding), 1.0, rel_tol=1e-5)
    with pytest.raises(RequestRejected, match="dimensions=100000 is more than model"):
        llm.embed("hi", PoolingParams(dimensions=100_000), use_tqdm=False)


def test_the_model_pooling_of_a_causal_model_is_its_last_token(llm):
    model, last = (llm.embed(PROMPTS[1], PoolingParams(p), use_tqdm=False)[0].embedding for p in ("model", "last"))
    assert model == last


def test_an_embedding_frees_its_blocks_and_leaves_the_prefix_cache_alone_beside_generation(llm):
    engine = llm.engine
    free = engine.block_manager.num_free
    engine.add_request("gen", PROMPTS[0], SamplingParams(temperature=0, max_tokens=4), stream_text=False)
    engine.add_embedding_request("emb", PROMPTS[2], PoolingParams("mean"))
    ended = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                ended[out.request_id] = out
    assert ended["emb"].embedding is not None and len(ended["emb"].embedding) == 4 * engine.embedding_size
    assert ended["emb"].output_tokens == 0 and ended["emb"].prompt_tokens == len(engine.tokenizer.encode(PROMPTS[2]))
    assert len(ended["gen"].token_ids) == 4
    assert engine.block_manager.num_free == free
    first_block = tuple(engine.tokenizer.encode(PROMPTS[2])[:engine.block_size])
    assert chain_hash(None, first_block) not in engine.block_manager.hash_to_block  # never published for reuse
    generated = engine.tokenizer.encode(PROMPTS[0]) + ended["gen"].token_ids
    assert chain_hash(None, tuple(generated[:engine.block_size])) in \
        engine.block_manager.hash_to_block  # while generation's blocks are, as always


def test_an_embedding_longer_than_the_cache_is_refused_naming_its_length():
    small = LLM("smollm2-135m", kv_cache_memory=1 << 20)  # a few blocks
    with pytest.raises(RequestRejected, match="tokens needs .* KV blocks but the whole cache has"):
        small.embed(PROMPTS[2] * 20, use_tqdm=False)


@pytest.mark.parametrize("config, pooling", [({"pooling_mode_mean_tokens": True}, "mean"),
                                             ({"pooling_mode_cls_token": True}, "cls"),
                                             ({"pooling_mode_lasttoken": True}, "last"), (None, "last")])
def test_a_sentence_transformers_folder_names_the_model_pooling(tmp_path, config, pooling):
    import json

    from kvgate.engine.loader import model_pooling
    if config is not None:
        (tmp_path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 576, **config}))
    assert model_pooling(tmp_path) == pooling


def test_embeddings_preempted_or_aborted_mid_prompt_leave_no_blocks_and_no_count_behind():
    """On a cache too small for everything at once, the newest running sequence, a chunked embedding, is preempted
    again and again by generation's growth and still finishes; aborted or finished, every one gives its blocks back
    and the all-decode shortcut is open again."""
    from kvgate.engine.cost_model_runner import CostModelRunner
    from kvgate.engine.llm_engine import LLMEngine
    from kvgate.engine.scheduler import AllDecode

    engine = LLMEngine(runner=CostModelRunner(8, sleep=False, step_overhead_s=0, per_token_s=0),
                       max_num_batched_tokens=20, block_size=16, max_num_seqs=8)
    preempted = []
    preempt = engine.scheduler.preempt
    engine.scheduler.preempt = lambda seq: (preempted.append(seq.request_id), preempt(seq))
    for i in range(2):
        engine.add_request(f"gen{i}", list(range(1, 16)), SamplingParams(max_tokens=60, ignore_eos=True))
    engine.add_embedding_request("emb", list(range(5, 100)), PoolingParams("mean"))
    engine.add_embedding_request("aborted", list(range(3, 40)), PoolingParams())
    ended, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in ended
            if out.finished:
                ended[out.request_id] = out
        steps += 1
        if steps == 2:
            assert engine.abort("aborted") is not None
    assert "emb" in preempted
    assert sorted(ended) == ["emb", "gen0", "gen1"] and ended["emb"].embedding
    assert all(len(ended[f"gen{i}"].token_ids) == 60 for i in range(2))
    assert engine.scheduler.pooling == 0 and engine.block_manager.num_free == engine.block_manager.num_blocks
    engine.add_request("after", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert isinstance(engine.scheduler.schedule(), AllDecode)  # decode steps take the shortcut again


def test_a_mean_pooled_embedding_preempted_mid_prompt_starts_over_and_still_equals_hf(hf_states):
    from kvgate.engine.llm_engine import LLMEngine

    engine = LLMEngine("smollm2-135m", max_num_batched_tokens=20, kv_cache_memory=6 * 737_280, max_num_seqs=4)
    assert engine.block_manager.num_blocks == 6
    preempted = []
    preempt = engine.scheduler.preempt
    engine.scheduler.preempt = lambda seq: (preempted.append(seq.request_id), preempt(seq))
    for i in range(2):
        engine.add_request(f"gen{i}", list(range(100, 115)), SamplingParams(temperature=0, max_tokens=40,
                                                                             ignore_eos=True), stream_text=False)
    engine.add_embedding_request("emb", PROMPTS[2], PoolingParams("mean", normalize=False))
    ended = {}
    while engine.has_unfinished():
        ended |= {out.request_id: out for out in engine.step() if out.finished}
    assert "emb" in preempted
    got = torch.frombuffer(bytearray(ended["emb"].embedding), dtype=torch.float32)
    torch.testing.assert_close(got, hf_states[2].mean(0), rtol=1e-3, atol=1e-4)


def test_a_one_token_embedding_beside_decoding_sequences_is_pooled_not_sampled(llm, hf_states):
    engine = llm.engine
    first = engine.tokenizer.encode(PROMPTS[0])[:1]
    engine.add_request("decoding", PROMPTS[1], SamplingParams(temperature=0, max_tokens=6), stream_text=False)
    engine.step()  # its prompt; from now on each step computes one token of it, as the embedding's one token
    engine.add_embedding_request("one", first, PoolingParams("last", normalize=False))
    ended = {}
    while engine.has_unfinished():
        ended |= {out.request_id: out for out in engine.step() if out.finished}
    assert ended["one"].output_tokens == 0 and len(ended["decoding"].token_ids) == 6
    got = torch.frombuffer(bytearray(ended["one"].embedding), dtype=torch.float32)
    torch.testing.assert_close(got, hf_states[0][0], rtol=1e-3, atol=1e-4)  # causal: the first token alone
