"""The compiled CPU sampler against its numpy twins and a whole-vocabulary float64 CDF, and the Sampler using it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvgate.engine.sampler import Sampler, inverse_cdf, uniform_for
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.sequence import Sequence

cpu_sample = pytest.importorskip("kvgate.kernels.cpu_sample", reason="numba is not importable here")


def whole_vocabulary_cdf(weights: np.ndarray, u: np.ndarray) -> list[int]:
    cdf = np.cumsum(weights.astype(np.float64), 1)
    return [int(np.searchsorted(row, t * row[-1], side="right")) for row, t in zip(cdf, u)]


def masked_weights(rows: int, vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 3
    logits[rng.random((rows, vocab)) < 0.3] = -np.inf  # masked tokens (top-k/top-p) weigh 0
    logits[np.arange(rows), rng.integers(0, vocab, rows)] = 0.0  # at least one survivor per row
    return np.exp(logits - logits.max(1, keepdims=True))


def test_uniform_numbers_are_the_twins_bit_for_bit():
    rng = np.random.default_rng(1)
    seeds = np.concatenate([rng.integers(0, 2**62, 500, dtype=np.uint64), np.array([0, 1, 2**62 - 1], np.uint64)])
    positions = np.concatenate([rng.integers(0, 10_000, 500), [0, 4095, 4096]])  # past the twin's first table
    got = cpu_sample.uniforms(seeds, positions)
    assert got.tolist() == uniform_for(seeds, positions).tolist()
    assert ((got > 0) & (got < 1)).all()


@pytest.mark.parametrize("vocab", [1, 6, 16, 17, 255, 256, 257, 1024, 4099])
def test_inverse_cdf_picks_the_token_a_whole_vocabulary_cdf_picks(vocab):
    weights = masked_weights(300, vocab, vocab)
    u = np.random.default_rng(vocab + 1).random(300)
    got = cpu_sample.inverse_cdf(weights, u).tolist()
    assert got == whole_vocabulary_cdf(weights, u)
    assert got == inverse_cdf(weights, u).tolist()  # and so the twin's


def test_inverse_cdf_never_picks_a_zero_weight_token_even_at_the_ends_of_the_range():
    weights = np.zeros((4, 700), dtype=np.float32)
    weights[:, [3, 40, 41, 600]] = [1.0, 1e-30, 0.5, 0.0]
    weights[3, 699] = 0.25  # the last token of the last chunk
    u = np.array([1 - 2.0 ** -48, 0.999999, 0.0, 1 - 2.0 ** -48])
    assert cpu_sample.inverse_cdf(weights, u).tolist() == [41, 41, 3, 699]


def test_a_row_of_one_hot_weights_always_gives_that_token():
    weights = np.zeros((5, 1024), dtype=np.float32)
    hot = [0, 255, 256, 700, 1023]
    weights[np.arange(5), hot] = 1.0
    for u in (1e-12, 0.5, 1 - 2.0 ** -48):
        assert cpu_sample.inverse_cdf(weights, np.full(5, u)).tolist() == hot


def test_sampled_frequencies_follow_the_weights():
    weights = np.array([[1.0, 3.0, 0.0, 6.0]] * 40_000, dtype=np.float32)
    u = np.random.default_rng(7).random(40_000)
    counts = np.bincount(cpu_sample.inverse_cdf(weights, u), minlength=4) / 40_000
    assert counts[2] == 0
    assert np.allclose(counts, [0.1, 0.3, 0.0, 0.6], atol=0.01)


def seq_at(params: SamplingParams, n_out: int) -> Sequence:
    seq = Sequence("r", list(range(1, 9)), params, params.max_tokens)
    seq.token_ids += list(range(100, 100 + n_out))
    return seq


def test_the_sampler_draws_the_same_tokens_with_the_kernel_as_with_its_twins():
    torch.manual_seed(0)
    logits = torch.randn(64, 1024) * 4
    params = [SamplingParams(temperature=t, seed=s) for t, s in zip([0.6, 1.0, 0.0, 1.7] * 16, range(64))]
    fast, twin = Sampler(), Sampler()
    twin.cpu_rows = None
    assert fast.cpu_rows is not None
    for step in range(5):
        got = fast(logits, [seq_at(p, step) for p in params])[0]
        assert got == twin(logits, [seq_at(p, step) for p in params])[0]
        assert got[2::4] == logits[2::4].argmax(-1).tolist()  # the greedy rows
        logits = logits.roll(1, -1)


def test_arguments_of_other_types_are_refused_rather_than_compiled_again_mid_step():
    weights = masked_weights(4, 64, 0)
    with pytest.raises(TypeError):
        cpu_sample.sample_rows(weights.astype(np.float64), np.zeros(4, np.uint64), np.zeros(4, np.int64))
    with pytest.raises(TypeError):
        cpu_sample.sample_rows(weights, np.zeros(4, np.int64), np.zeros(4, np.int64))
