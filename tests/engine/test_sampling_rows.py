"""Sampling parameters kept per decode row: a decode step samples exactly what reading them from the sequences
samples (seeds drawn for unseeded requests included), through row reuse and preemptions; a batch whose rows all
sample alike gathers one temperature and nothing a row does not use."""
from __future__ import annotations

import numpy as np
import torch

from kvgate.engine import LLMEngine, SamplingParams
from kvgate.engine.sampler import Sampler
from kvgate.engine.sampling_rows import SamplingBatch, SamplingRows
from kvgate.engine.sequence import Sequence
from tests.engine.helpers import BLOCK_BYTES, random_prompts, tiny_source

MIXED = [
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0.7, max_tokens=40, ignore_eos=True),  # unseeded: seeded from the engine's stream
    SamplingParams(temperature=1.3, max_tokens=25, seed=4, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=5, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.7, max_tokens=35, seed=9, ignore_eos=True),
    SamplingParams(temperature=0.6, repetition_penalty=1.4, frequency_penalty=0.5, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0, logprobs=2, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.5, logprobs=0, presence_penalty=1.0, max_tokens=28, ignore_eos=True),
]


def generate(params: list[SamplingParams], from_sequences: bool, prompts: list[list[int]] | None = None,
             first: int = 0) -> tuple[dict, int, int]:
    """Each request's ids and logprobs, the steps that sampled from rows, the preemptions; the `first` requests
    are added and stepped once before the others."""
    source, _ = tiny_source("llama", seed=12)
    # 10 blocks for 6 running sequences of up to 64 tokens (4 blocks each): preemptions happen
    engine = LLMEngine(source, kv_cache_memory=10 * BLOCK_BYTES, max_num_seqs=6, seed=3)
    gathered = []
    sampler = engine.runner.sampler

    def sample(logits, seqs, batch=None, consume=False, argmax=None):
        gathered.append(batch is not None)
        return sampler(logits, seqs, None if from_sequences else batch, consume, argmax)

    engine.runner.sampler = sample
    out: dict[str, list] = {}

    def step() -> None:
        for o in engine.step():
            ids, lps = out.setdefault(o.request_id, ([], []))
            ids += o.new_token_ids
            lps.append(o.logprobs)

    for i, prompt in enumerate(prompts or random_prompts(len(params), 4, 24, seed=12)):
        engine.add_request(str(i), prompt, params[i])
        if i + 1 == first:
            step()
    while engine.has_unfinished():
        step()
    return out, sum(gathered), engine.scheduler.num_preemptions


def test_decode_steps_sample_from_the_rows_exactly_what_the_sequences_give():
    params = MIXED * 3  # 24 requests through 6 slots: rows are freed and claimed again
    from_rows, gathered, preemptions = generate(params, from_sequences=False)
    from_sequences, _, _ = generate(params, from_sequences=True)
    assert gathered > 50 and preemptions > 0
    assert from_rows == from_sequences
    assert all(len(from_rows[str(i)][0]) == p.max_tokens for i, p in enumerate(params))


def test_unseeded_requests_draw_their_seeds_in_the_same_order_from_rows_as_from_sequences():
    # after the first request, every prompt but its last token is a prefix-cache hit: each request starts in a
    # decode step, without a seed, beside others (greedy ones too) that have one or not
    head = random_prompts(1, 16, 16, seed=13)[0]
    prompts = [head + [i] for i in range(12)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    params = [sampled, greedy, sampled, sampled, greedy, sampled, greedy, greedy, sampled, sampled, sampled, sampled]
    from_rows, gathered, _ = generate(params, False, prompts, first=1)
    assert gathered > 20
    assert from_rows == generate(params, True, prompts, first=1)[0]


def seq_of(params: SamplingParams, prompt_len: int = 5, outputs: int = 3, seed: int | None = 7) -> Sequence:
    seq = Sequence("r", list(range(prompt_len)), params, params.max_tokens)
    seq.token_ids += [1] * outputs
    seq.sample_seed = seed
    return seq


def as_rows(values, n: int) -> np.ndarray:
    return np.full(n, values) if isinstance(values, float) else values


def test_gathered_rows_equal_the_batch_built_from_the_sequences():
    seqs = [seq_of(p, prompt_len=3 + i, outputs=i, seed=100 + i) for i, p in enumerate(MIXED)]
    table = SamplingRows(16)
    rows = np.array([11, 2, 7, 0, 15, 3, 9, 4])
    for row, seq in zip(rows.tolist(), seqs):
        table.write(row, seq)
    positions = np.array([len(s.token_ids) - 1 for s in seqs])  # each sequence's last token's position
    got, want = table.gather(rows, positions, seqs), SamplingBatch.of(seqs)
    assert not got.all_greedy and got.unseeded == want.unseeded == []
    for name in ("greedy", "top_k", "top_p", "seeds", "positions"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    assert np.array_equal(as_rows(got.inv_temperature, 8), as_rows(want.inv_temperature, 8))
    for name in ("penalized", "logprob_rows", "logprob_tops"):
        assert getattr(got, name) == getattr(want, name), name


def test_a_batch_at_one_temperature_gathers_one_value_and_nothing_unused():
    table = SamplingRows(8)
    seqs = [seq_of(SamplingParams(temperature=0.6)) for _ in range(3)]
    odd = seq_of(SamplingParams(temperature=0.9, top_k=3, logprobs=1))
    for row, seq in enumerate(seqs + [odd]):
        table.write(row, seq)
    positions = np.array([7, 7, 7])
    mixed = table.gather(np.array([0, 1, 2]), positions, seqs)  # the odd row is held, not in the batch
    assert np.array_equal(mixed.inv_temperature, np.full(3, 1 / 0.6)) and mixed.top_k is None
    assert mixed.logprob_rows == []
    table.clear(3)
    alike = table.gather(np.array([0, 1, 2]), positions, seqs)
    assert alike.inv_temperature == 1 / 0.6 and alike.greedy is None and alike.top_k is None
    assert alike.positions.tolist() == [3, 3, 3]  # prompt of 5, outputs 0-2 drawn: output position 3 next


def test_a_greedy_batch_gathers_no_seeds_and_draws_none():
    table = SamplingRows(4)
    seqs = [seq_of(SamplingParams(temperature=0), seed=None) for _ in range(2)]
    for row, seq in enumerate(seqs):
        table.write(row, seq)
    batch = table.gather(np.array([0, 1]), np.array([7, 7]), seqs)
    assert batch.all_greedy and batch.seeds.size == 0
    sampler = Sampler(seed=1)
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(0))
    assert sampler(logits, seqs, batch)[0] == logits.argmax(-1).tolist()
    assert all(s.sample_seed is None for s in seqs)  # the stream is left for the first temperature row
