"""Sampling: seeded reproducibility, the support top-k/top-p leave, HF's repetition penalty, OpenAI's frequency and
presence penalties, the sampled distribution, logprobs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.sampler import Sampler, apply_penalties, apply_top_k_top_p, inverse_cdf
from kvgate.engine.sequence import Sequence
from tests.engine.helpers import random_prompts, tiny_source


@pytest.fixture(scope="module")
def llm():
    source, _ = tiny_source("llama", seed=4)
    return LLM(source, kv_cache_memory=1 << 20)


PROMPTS = random_prompts(3, 4, 12, seed=4)


def test_fixed_seed_reproduces_the_same_samples_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].token_ids
    batched = llm.generate(PROMPTS, [params, SamplingParams(temperature=1.0, max_tokens=5, seed=1), params],
                           use_tqdm=False)
    assert batched[0].token_ids == alone
    assert batched[2].token_ids == llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].token_ids


def test_different_seeds_give_different_samples(llm):
    outs = [llm.generate([PROMPTS[0]], SamplingParams(temperature=1.5, max_tokens=16, seed=s, ignore_eos=True),
                         use_tqdm=False)[0].token_ids for s in (1, 2)]
    assert outs[0] != outs[1]


def kept(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> list[list[int]]:
    masked = apply_top_k_top_p(logits, torch.tensor(top_k), torch.tensor(top_p))
    return [torch.isfinite(row).nonzero().flatten().tolist() for row in masked]


def test_top_k_keeps_exactly_the_k_most_likely_tokens_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0], [5.0, 4.0, 3.0, 2.0, 1.0], [0.0, 3.0, 1.0, 2.0, -1.0]])
    assert kept(logits, [2, 1, -1], [1.0, 1.0, 1.0]) == [[1, 3], [0], [0, 1, 2, 3, 4]]


def test_top_k_and_top_p_masks_leave_finite_logits_unchanged():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([1.0]))
    assert masked[0, [1, 2, 3]].tolist() == [3.0, 1.0, 2.0]


def test_top_p_keeps_the_smallest_set_reaching_p_per_row():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5], [0.5, 0.3, 0.15, 0.05]])
    assert kept(probs.log(), [-1, -1, -1], [0.7, 0.7, 0.01]) == [[0, 1], [2, 3], [0]]  # the top always survives
    assert kept(probs.log(), [3, 3, -1], [0.9, 1.0, 0.85]) == [[0, 1, 2], [1, 2, 3], [0, 1, 2]]


def seq_with(params: SamplingParams, token_ids=(1, 2, 3), outputs: tuple = ()) -> Sequence:
    seq = Sequence("r", list(token_ids), params, params.max_tokens)
    seq.token_ids += list(outputs)
    return seq


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    seqs = [seq_with(SamplingParams(temperature=0)) for _ in range(5)]
    assert Sampler()(logits, seqs)[0] == logits.argmax(-1).tolist()


def test_greedy_rows_in_a_sampled_batch_still_take_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    seqs = [seq_with(SamplingParams(temperature=t)) for t in (0, 1.0, 0, 2.0)]
    tokens = Sampler()(logits, seqs)[0]
    assert [tokens[0], tokens[2]] == logits.argmax(-1)[[0, 2]].tolist()


def test_seeded_row_draws_the_same_token_whatever_the_batch_around_it():
    g = torch.Generator().manual_seed(2)
    row = torch.randn(1, 64, generator=g)
    draws = []
    for others in (0, 3, 7):
        logits = torch.cat([torch.randn(others, 64, generator=g), row])
        seqs = [seq_with(SamplingParams(temperature=1.0, seed=s)) for s in range(100, 100 + others)]
        seqs.append(seq_with(SamplingParams(temperature=1.0, seed=42), outputs=(5, 6)))
        draws.append(Sampler(seed=others)(logits, seqs)[0][-1])
    assert draws[0] == draws[1] == draws[2]


def test_sampled_frequencies_match_the_softmax_on_a_small_vocabulary():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    n = 6000
    logits = probs.log().repeat(n, 1)
    seqs = [seq_with(SamplingParams(temperature=1.0)) for _ in range(n)]  # unseeded: seeds from the engine's stream
    counts = torch.bincount(torch.tensor(Sampler(seed=3)(logits, seqs)[0]), minlength=6).double()
    expected = probs.double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # chi-square, 5 degrees of freedom: p = 0.001


def test_temperature_sharpens_the_sampled_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    n = 3000
    logits = probs.log().repeat(n, 1)
    counts = torch.bincount(torch.tensor(Sampler(seed=4)(logits, [seq_with(SamplingParams(temperature=0.5))
                                                                   for _ in range(n)])[0]), minlength=3)
    expected = probs ** 2 / (probs ** 2).sum()  # softmax(log p / 0.5)
    assert torch.allclose(counts.double() / n, expected.double(), atol=0.03)


def test_frequency_and_presence_penalties_follow_openai():
    logits = torch.zeros(1, 8)
    seq = seq_with(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), token_ids=(7,), outputs=(2, 2, 5))
    apply_penalties(logits, [seq], [0])
    assert logits[0].tolist() == [0, 0, -1.25, 0, 0, -0.75, 0, 0]  # the prompt token 7 is not penalized


def test_top_k_sampling_never_leaves_the_top_k():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(5)).repeat(500, 1)
    tokens = Sampler(seed=6)(logits, [seq_with(SamplingParams(temperature=5.0, top_k=3)) for _ in range(500)])[0]
    assert set(tokens) == set(logits[0].topk(3).indices.tolist())


def test_sampled_tokens_stay_inside_the_top_k_support(llm):
    source, hf = tiny_source("llama", seed=4)
    prompt = PROMPTS[1]
    with torch.no_grad():
        allowed = set(hf(torch.tensor([prompt])).logits[0, -1].topk(3).indices.tolist())
    firsts = {llm.generate([prompt], SamplingParams(temperature=2.0, top_k=3, max_tokens=1, seed=s),
                           use_tqdm=False)[0].token_ids[0] for s in range(12)}
    assert firsts <= allowed and len(firsts) > 1


def test_repetition_penalty_matches_hf_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    logits = torch.randn(2, 20)
    ids = [[3, 5, 5, 7], [1, 2, 3, 4]]
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor(ids), logits.clone())
    ours = logits.clone()
    seqs = [seq_with(SamplingParams(repetition_penalty=1.3), token_ids=i) for i in ids]
    apply_penalties(ours, seqs, [0, 1])
    assert torch.allclose(ours, expected)


def test_greedy_with_repetition_penalty_matches_hf_generate():
    source, hf = tiny_source("llama", seed=5)
    prompt = random_prompts(1, 6, 6, seed=5)[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, repetition_penalty=1.5,
                          eos_token_id=[], pad_token_id=0)[0, len(prompt):].tolist()
    out = LLM(source, kv_cache_memory=1 << 20).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.5, ignore_eos=True),
        use_tqdm=False)[0]
    assert out.token_ids == ref


def test_logprobs_hold_the_chosen_token_and_top_alternatives(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and len(lp) == 3 and lp[token] == max(lp.values())


@pytest.mark.parametrize("kwargs, word", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=0), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(stop=[""]), "stop"), (dict(seed=-3), "seed"), (dict(logprobs=50), "logprobs"),
    (dict(frequency_penalty=3), "frequency_penalty"), (dict(presence_penalty=-2.5), "presence_penalty"),
])
def test_invalid_sampling_params_raise_naming_the_field(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_logprobs_of_mixed_rows_are_the_raw_log_softmax_of_each_asking_row():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(7))
    seqs = [seq_with(SamplingParams(temperature=0, logprobs=2)), seq_with(SamplingParams(temperature=0)),
            seq_with(SamplingParams(temperature=0.7, logprobs=0, repetition_penalty=1.5))]
    tokens, lps = Sampler()(logits, seqs)
    logp = logits.log_softmax(-1)
    assert lps[1] is None
    top2 = logp[0].topk(2)
    assert lps[0] == {i: v for i, v in zip(top2.indices.tolist(), top2.values.tolist())}
    assert lps[2] == {tokens[2]: logp[2, tokens[2]].item()}


def reference_inverse_cdf(weights: np.ndarray, u: np.ndarray) -> list[int]:
    cdf = np.cumsum(weights.astype(np.float64), 1)
    return [int(np.searchsorted(row, t * row[-1], side="right")) for row, t in zip(cdf, u)]


@pytest.mark.parametrize("vocab", [1, 6, 32, 50, 1024])
def test_two_level_inverse_cdf_picks_the_token_a_whole_vocabulary_cdf_picks(vocab):
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((300, vocab)).astype(np.float32) * 3
    logits[rng.random((300, vocab)) < 0.3] = -np.inf  # masked tokens (top-k/top-p) weigh 0
    logits[np.arange(300), rng.integers(0, vocab, 300)] = 0.0  # at least one survivor per row
    weights = np.exp(logits - logits.max(1, keepdims=True))
    u = rng.random(300)
    assert inverse_cdf(weights, u).tolist() == reference_inverse_cdf(weights, u)


def test_inverse_cdf_never_picks_a_zero_weight_token_even_at_the_top_of_the_range():
    weights = np.zeros((3, 70), dtype=np.float32)
    weights[:, [3, 40, 41]] = [1.0, 1e-30, 0.5]
    u = np.array([1 - 2.0 ** -48, 0.999999, 0.0])
    assert inverse_cdf(weights, u).tolist() == [41, 41, 3]


@pytest.mark.parametrize("logprobs", [None, 3])
def test_consumed_logits_give_the_same_tokens_and_logprobs_and_unconsumed_ones_are_left_alone(logprobs):
    logits = torch.randn(32, 300, generator=torch.Generator().manual_seed(5)) * 3
    params = [SamplingParams(temperature=0.8, seed=i, logprobs=logprobs if i % 4 == 0 else None) for i in range(32)]
    kept = logits.clone()
    expected = Sampler()(kept, [seq_with(p) for p in params])
    assert torch.equal(kept, logits)  # not consumed: the caller's logits are as they were
    assert Sampler()(logits.clone(), [seq_with(p) for p in params], consume=True) == expected
