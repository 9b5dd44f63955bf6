"""The decode-graph plan: buckets, padding rows and static buffers reused step after step. On a CPU the replay is
the eager twin over the same static buffers, so the plan is checked here; the real capture is checked on a GPU."""
from __future__ import annotations

import pytest
import torch

from kvgate.engine import LLMEngine, SamplingParams
from kvgate.engine.cuda_graphs import capture_sizes, logits_and_argmax
from kvgate.engine.sampler import Sampler
from kvgate.engine.sampling_rows import SamplingBatch
from kvgate.engine.sequence import Sequence
from tests.engine.helpers import random_prompts, tiny_source


@pytest.mark.parametrize("max_num_seqs, sizes", [
    (1, [1]), (5, [1, 2, 4, 5]), (20, [1, 2, 4, 8, 16, 20]), (64, [1, 2, 4, 8, 16, 32, 48, 64]),
])
def test_capture_sizes_cover_every_batch_up_to_max_num_seqs(max_num_seqs, sizes):
    assert capture_sizes(max_num_seqs) == sizes


def generate(engine: LLMEngine, prompts: list[list[int]], lengths: list[int], **params) -> dict[str, list[int]]:
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **params))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_graph_plan_gives_the_eager_tokens_and_reuses_its_buffers():
    source, _ = tiny_source("llama", seed=6)
    prompts = random_prompts(7, 3, 30, seed=6)
    lengths = [5, 9, 14, 20, 26, 31, 40]  # the batch shrinks through 7..1: odd sizes land in padded buckets
    eager = generate(LLMEngine(source, kv_cache_memory=1 << 20, max_num_seqs=7), prompts, lengths)
    engine = LLMEngine(source, kv_cache_memory=1 << 20, max_num_seqs=7)
    assert engine.runner.graphs is None  # a CPU engine captures nothing by itself
    engine.runner.capture_graphs()
    graphs = engine.runner.graphs
    v = graphs.inputs.views
    buffers = [t.data_ptr() for t in (v.input_ids, v.slot_mapping, v.block_tables)]
    run, padded = graphs.run, []

    def checking_padding(batch):
        n, size = batch.input_ids.shape[0], batch.bucket
        assert size == graphs.bucket(n) and (v.slot_mapping[n:size] == -1).all() and (v.context_lens[n:size] == 0).all()
        assert (v.block_tables[n:size] == -1).all() and (v.prev[n:size] == -1).all()
        assert batch.context_lens.data_ptr() == v.context_lens.data_ptr()  # the step's inputs are the static ones
        padded.append(size - n)
        return run(batch)

    graphs.run = checking_padding
    assert generate(engine, prompts, lengths) == eager
    assert [t.data_ptr() for t in (v.input_ids, v.slot_mapping, v.block_tables)] == buffers
    assert graphs.sizes == [1, 2, 4, 7] and all(graphs.replayed[s] > 0 for s in graphs.sizes)
    assert max(padded) > 0  # some steps ran padded (a batch of 3 in the bucket of 4, 6 or 5 in 7)
    assert v.block_tables.shape[1] == -(-engine.max_model_len // engine.block_size)


def test_padding_rows_leave_the_kv_cache_as_eager_leaves_it():
    source, _ = tiny_source("llama", seed=7)
    prompts, lengths = random_prompts(3, 4, 12, seed=7), [6, 6, 6]
    eager = LLMEngine(source, kv_cache_memory=1 << 20, max_num_seqs=4)
    graphed = LLMEngine(source, kv_cache_memory=1 << 20, max_num_seqs=4)
    graphed.runner.capture_graphs()
    assert generate(eager, prompts, lengths) == generate(graphed, prompts, lengths)
    assert graphed.runner.graphs.replayed[4] > 0  # 3 sequences padded to the bucket of 4
    assert torch.equal(eager.runner.kv_cache, graphed.runner.kv_cache)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_replay_gives_the_eager_token_ids(dtype):
    source, _ = tiny_source("qwen3", seed=8)
    prompts = random_prompts(13, 2, 90, seed=8)
    lengths = [3 + 5 * i for i in range(13)]
    kwargs = dict(device="cuda", dtype=dtype, kv_cache_memory=1 << 24, max_num_seqs=13)
    eager = generate(LLMEngine(source, enforce_eager=True, **kwargs), prompts, lengths)
    engine = LLMEngine(source, **kwargs)
    assert engine.runner.graphs is not None
    greedy, decode = [], engine.runner.decode  # every decode step takes the graph's argmax, in bf16 without a cast
    engine.runner.decode = lambda *a, **k: greedy.append((out := decode(*a, **k))[1] is not None) or out
    assert generate(engine, prompts, lengths) == eager
    assert sum(engine.runner.graphs.replayed.values()) == len(greedy) > 0 and all(greedy)


@pytest.mark.parametrize("params, plain", [
    ({}, True), ({"temperature": 1e-6}, True), ({"temperature": 0.7}, False), ({"logprobs": 0}, False),
    ({"repetition_penalty": 1.2}, False), ({"presence_penalty": 0.5}, False), ({"logit_bias": {3: 1.0}}, False),
    ({"min_tokens": 2}, False),
])
def test_plain_greedy_is_greedy_with_nothing_that_reads_or_changes_the_logits(params, plain):
    seqs = [Sequence(str(i), [1, 2, 3], SamplingParams(**{"temperature": 0, **({} if i else params)}), 16)
            for i in range(3)]
    assert SamplingBatch.of(seqs).plain_greedy is plain  # one such row makes the whole batch not plain
    assert SamplingBatch.of(seqs[1:]).plain_greedy


class Logits:
    """A model whose logits are given: what logits_and_argmax reads of a model."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = lambda hidden: logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_graphs_argmax_of_model_dtype_logits_is_the_samplers_greedy_token_ties_included(dtype):
    """The sampler's greedy token is the argmax of the float32 cast of the model's logits; the graph's is the argmax
    of the logits themselves. The cast widens exactly, so they are the same; on ties both take the first maximum."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 300, generator=gen) * 4).to(dtype)
    logits[1, [7, 250]] = logits[2, [0, 299]] = logits[3, [5, 6, 9]] = 50.0  # exact ties: the first one wins
    logits[4, 10], logits[4, 20] = 40.0, 40.0 + 2 ** -10  # distinct in float32; one value once rounded to bf16
    logits[5] = 0.0
    tokens = logits_and_argmax(Logits(logits), None)[1]
    greedy = SamplingBatch.of([Sequence("r", [1], SamplingParams(temperature=0), 16)] * 64)
    assert torch.equal(tokens, Sampler().sample(logits.float(), [], greedy))
    assert tokens[1:4].tolist() == [7, 0, 5] and tokens[5] == 0
    assert tokens[4] == (10 if dtype == torch.bfloat16 else 20)


def test_a_plain_greedy_decode_batch_takes_the_graphs_tokens_and_any_other_the_sampler():
    """On a CPU the graph's twin: a greedy decode step takes the graph's tokens, plain or launched ahead (overlap);
    one with a logprobs row gets the graph's logits in the model's dtype (float32 here) and its argmax for the
    sampler, which widens only the rows that need it (test_sampler_precision.py); the tokens are the eager ones."""
    source, _ = tiny_source("llama", seed=6)
    prompts, lengths = random_prompts(5, 3, 20, seed=6), [4, 7, 9, 12, 15]
    for overlap, params in [("off", {}), ("on", {}), ("off", {"logprobs": 1})]:
        kwargs = dict(kv_cache_memory=1 << 20, max_num_seqs=5, overlap=overlap)
        eager = generate(LLMEngine(source, **kwargs), prompts, lengths, **params)
        engine = LLMEngine(source, **kwargs)
        engine.runner.capture_graphs()
        steps, decode = [], engine.runner.decode
        engine.runner.decode = lambda *a, **k: steps.append(out := decode(*a, **k)) or out
        assert generate(engine, prompts, lengths, **params) == eager
        assert len(steps) == sum(engine.runner.graphs.replayed.values()) > 0
        if params:
            assert all(logits.dtype == torch.float32 and tokens.dtype == torch.long for logits, tokens in steps)
        else:
            assert all(logits is None and tokens.dtype == torch.long for logits, tokens in steps)
        assert (engine.overlap is not None and engine.overlap.launched > 0) is (overlap == "on")
