"""The sampler on logits in the model's dtype (issue 41): only the rows whose transforms need float32 (sampling,
penalties, logit_bias/min_tokens) get a float32 copy, and logprob rows a float32 log-softmax of their own; greedy
rows take the argmax of the bf16 logits themselves. A bf16 -> float32 cast widens exactly, so each row's token and
logprobs are those of the sampler over the whole batch cast to float32, which is what the runner used to hand it
(`old_way`). Before, a batch with one sampling row at 256 x 151,936 cast all of it: ~155 MB written and read."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvgate.engine import LLMEngine, SamplingParams
from kvgate.engine.sampler import Sampler
from kvgate.engine.sampling_rows import SamplingBatch
from kvgate.engine.sequence import Sequence
from tests.engine.helpers import random_prompts, tiny_source

VOCAB = 300


class Float32Rows(TorchDispatchMode):
    """Every float32 tensor with `width` columns that an operation makes: how many rows each had."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.rows = width, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 2 and t.shape[1] == self.width:
                self.rows.append(t.shape[0])
        return out


def seq_with(params: SamplingParams, outputs: tuple = (5, 6, 7)) -> Sequence:
    seq = Sequence("r", [1, 2, 3, 4], params, params.max_tokens)
    seq.token_ids += list(outputs)
    seq.stop_ids = frozenset({0})
    return seq


# greedy rows (plain, with logprobs, with ties) among rows that need float32: sampled (seeded and not, top-k/top-p,
# min_p), a penalized greedy row, a logit_bias one and a min_tokens one
MIXED = [dict(temperature=0), dict(temperature=0.7, seed=11), dict(temperature=0, logprobs=2),
         dict(temperature=1.3), dict(temperature=0, repetition_penalty=1.4), dict(temperature=0.9, top_k=20, seed=3),
         dict(temperature=0), dict(temperature=0, logit_bias={9: 0.3, 0: 40.0}),
         dict(temperature=0.5, top_p=0.8, seed=4),
         dict(temperature=1.0, min_p=0.1, seed=8, frequency_penalty=0.5), dict(temperature=0, min_tokens=5),
         dict(temperature=0.8, seed=5, logprobs=1)]
WIDE = [1, 3, 4, 5, 7, 8, 9, 10, 11]  # MIXED's rows that need float32


def bf16_logits(rows: int, seed: int = 0) -> torch.Tensor:
    logits = (torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3).bfloat16()
    logits[0, [17, 40]] = logits[rows // 2, [3, 299]] = 30.0  # exact ties: the first maximum wins in either dtype
    return logits


def old_way(logits: torch.Tensor, params: list[dict], seed: int = 0):
    """What the runner used to do: every row cast to float32, then the sampler."""
    return Sampler(seed)(logits.float(), [seq_with(SamplingParams(**p)) for p in params], consume=True)


@pytest.mark.parametrize("params", [MIXED, MIXED[::-1], [MIXED[1], MIXED[3]], [MIXED[0], MIXED[2], MIXED[6]]],
                         ids=["mixed", "reversed", "all-sampled", "all-greedy"])
def test_each_rows_token_and_logprobs_are_those_of_the_whole_batch_cast_to_float32(params):
    logits = bf16_logits(len(params))
    expected = old_way(logits, params)
    assert Sampler()(logits.clone(), [seq_with(SamplingParams(**p)) for p in params], consume=True) == expected
    kept = logits.clone()  # not consumed: the caller's logits are left as they were
    assert Sampler()(kept, [seq_with(SamplingParams(**p)) for p in params]) == expected
    assert torch.equal(kept, logits)


def test_the_mixed_batch_draws_the_tokens_it_drew_before_the_change():
    """Pinned against the sampler as it was (ba7b1c4, the whole batch in float32): a change to the float32 path
    itself, which the comparison above would share, fails here."""
    tokens, lps = Sampler()(bf16_logits(len(MIXED)), [seq_with(SamplingParams(**p)) for p in MIXED], consume=True)
    assert tokens == [17, 93, 264, 14, 272, 48, 3, 0, 105, 287, 141, 13]
    assert lps[2] == {264: -0.8991438150405884, 5: -2.649143695831299}
    assert lps[11] == {13: -2.8698019981384277, 121: -1.4635521173477173} and lps.count(None) == 10


def test_only_the_rows_that_need_float32_are_cast():
    logits = bf16_logits(len(MIXED))
    seqs = [seq_with(SamplingParams(**p)) for p in MIXED]
    with Float32Rows(VOCAB) as made:
        Sampler()(logits, seqs, consume=True)
    assert made.rows and max(made.rows) == len(WIDE) < len(MIXED)
    assert SamplingBatch.of(seqs).float32_rows() == WIDE


@pytest.mark.parametrize("params, most", [
    ([dict(temperature=0)] * 6, None),  # plain greedy: no float32 at all
    ([dict(temperature=0)] * 5 + [dict(temperature=0, logprobs=3)], 1),  # the logprob row's log-softmax alone
    ([dict(temperature=0)] * 5 + [dict(temperature=0.6, seed=1)], 1),  # one sampling row: one row cast
])
def test_a_mostly_greedy_batch_casts_no_greedy_row(params, most):
    seqs, logits = [seq_with(SamplingParams(**p)) for p in params], bf16_logits(len(params))
    with Float32Rows(VOCAB) as made:
        Sampler()(logits, seqs, consume=True)
    assert (max(made.rows) if made.rows else None) == most


def test_a_sampling_row_draws_its_token_whatever_the_greedy_rows_beside_it():
    """Seeded sampling is per row: the float32 part holding only the sampling rows changes none of their draws."""
    g = torch.Generator().manual_seed(9)
    row = (torch.randn(1, VOCAB, generator=g) * 2).bfloat16()
    draws = []
    for greedy in (0, 2, 5):
        logits = torch.cat([(torch.randn(greedy, VOCAB, generator=g) * 2).bfloat16(), row])
        seqs = [seq_with(SamplingParams(temperature=0)) for _ in range(greedy)]
        seqs.append(seq_with(SamplingParams(temperature=0.9, seed=42)))
        draws.append(Sampler()(logits, seqs, consume=True)[0][-1])
    assert draws[0] == draws[1] == draws[2]


def test_unseeded_rows_draw_their_seeds_in_batch_order_greedy_rows_included():
    """A request without a seed takes one from the engine's stream at its first sampled step, greedy rows of that
    step too (as before): the split must not skip their draws, or every later unseeded request samples otherwise."""
    params = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0), dict(temperature=0.7)]
    logits = bf16_logits(len(params), seed=3)
    old = [seq_with(SamplingParams(**p)) for p in params]
    new = [seq_with(SamplingParams(**p)) for p in params]
    assert Sampler(seed=5)(logits.float(), old, consume=True) == Sampler(seed=5)(logits, new, consume=True)
    assert [s.sample_seed for s in new] == [s.sample_seed for s in old] and None not in [s.sample_seed for s in new]


ENGINE_PARAMS = [dict(temperature=0), dict(temperature=0.8, seed=1), dict(temperature=0, logprobs=2),
                 dict(temperature=1.1, top_k=30, seed=2), dict(temperature=0, repetition_penalty=1.3),
                 dict(temperature=0), dict(temperature=0, logit_bias={5: 1.0})]


def run_engine(engine: LLMEngine, params: list[dict]) -> dict:
    for i, (prompt, p) in enumerate(zip(random_prompts(len(params), 3, 12, seed=8), params)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=9, ignore_eos=True, **p))
    out: dict = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens, lps = out.setdefault(o.request_id, ([], []))
            tokens.extend(o.new_token_ids)
            lps.append(o.logprobs)
    return out


def widened_and_narrow(seed: int, graphs: bool, **engine_kwargs) -> tuple[LLMEngine, LLMEngine]:
    """Two bf16 engines of one tiny model: the reference, whose model's logits are all widened to float32 (as
    compute_logits did for the sampler), and the engine as it runs; with `graphs`, both capture their decode graphs."""
    source, _ = tiny_source("llama", seed=seed)
    kwargs = dict(kv_cache_memory=1 << 20, max_num_seqs=8, dtype="bfloat16", **engine_kwargs)
    reference = LLMEngine(source, **kwargs)
    narrow = reference.runner.model.logits
    reference.runner.model.logits = lambda hidden: narrow(hidden).float()
    engine = LLMEngine(source, **kwargs)
    if graphs:
        reference.runner.capture_graphs()
        engine.runner.capture_graphs()
    return reference, engine


@pytest.mark.parametrize("graphs", [False, True])
def test_a_bf16_engine_casts_only_the_rows_that_need_it_and_writes_the_tokens_of_a_whole_cast(graphs):
    """bf16 on the CPU, eager and through the decode graphs' twin: the tokens and logprobs are those of a runner
    whose logits are all float32 (the model's `logits` widened, as compute_logits did for the sampler), and no step
    makes a float32 [rows, vocab] tensor of more rows than its rows that sample, are penalized or adjusted."""
    reference, engine = widened_and_narrow(8, graphs)
    expected = run_engine(reference, ENGINE_PARAMS)
    with Float32Rows(engine.runner.vocab_size) as made:
        assert run_engine(engine, ENGINE_PARAMS) == expected
    assert made.rows and max(made.rows) == 4  # rows 1, 3, 4 and 6; the logprob row's log-softmax is 1 row
    assert not graphs or sum(engine.runner.graphs.replayed.values()) > 0


@pytest.mark.parametrize("graphs", [False, True])
def test_a_bf16_engine_launching_ahead_samples_into_the_token_buffer_what_a_whole_cast_samples(graphs):
    """Overlap on: the launched step's sampler writes the greedy rows' argmax and the sampled rows' draws into the
    token buffer the next step reads on the device (`out`), the float32 part holding the 3 rows that need it."""
    params = [dict(temperature=0), dict(temperature=0.8, seed=1), dict(temperature=0), dict(temperature=1.2),
              dict(temperature=0, logit_bias={5: 1.0}), dict(temperature=0)]
    reference, engine = widened_and_narrow(9, graphs, overlap="on")
    expected = run_engine(reference, params)
    with Float32Rows(engine.runner.vocab_size) as made:
        assert run_engine(engine, params) == expected
    assert engine.overlap.launched > 0 and max(made.rows) == 3


def test_a_bf16_engine_of_greedy_rows_makes_no_float32_logits():
    source, _ = tiny_source("llama", seed=8)
    engine = LLMEngine(source, kv_cache_memory=1 << 20, max_num_seqs=8, dtype="bfloat16")
    with Float32Rows(engine.runner.vocab_size) as made:
        run_engine(engine, [dict(temperature=0)] * 5)
    assert made.rows == []


def test_float32_rows_is_every_row_that_samples_or_whose_transform_rounds():
    seqs = [seq_with(SamplingParams(**p)) for p in MIXED]
    assert SamplingBatch.of(seqs).float32_rows() == WIDE
    assert SamplingBatch.of(seqs[1:2] + seqs[3:4]).float32_rows() is None  # every row
    assert SamplingBatch.of([seqs[0], seqs[4], seqs[2]]).float32_rows() == [1]
    assert SamplingBatch.of([seqs[0], seqs[2]]).float32_rows() == []


def test_select_renumbers_the_rows_and_keeps_the_paths_the_whole_batch_takes():
    seqs = [seq_with(SamplingParams(**p)) for p in MIXED]
    batch = SamplingBatch.of(seqs)
    part = batch.select(WIDE)
    assert not part.all_greedy and part.greedy.tolist() == [not (MIXED[i].get("temperature")) for i in WIDE]
    assert part.penalized == [WIDE.index(4), WIDE.index(9)] and part.adjusted == [WIDE.index(7), WIDE.index(10)]
    assert part.logprob_rows == [WIDE.index(11)] and part.logprob_tops == [1]
    assert np.array_equal(part.positions, batch.positions[WIDE]) and np.array_equal(part.top_k, batch.top_k[WIDE])
    assert np.array_equal(part.inv_temperature, batch.inv_temperature[WIDE])


class BanTopTokens:
    """TokenMasks' part the sampler calls, as a grammar that forbids each row's 5 likeliest tokens would."""

    def mask(self, logits: torch.Tensor, rows: list[int], matchers: list) -> None:
        for row in rows:
            logits[row, logits[row].float().topk(5).indices] = float("-inf")


def test_structured_rows_are_masked_in_bf16_and_draw_what_the_float32_batch_drew():
    """A grammar's -inf is exact in bf16: a constrained greedy row takes its masked argmax without a float32 copy,
    and a constrained sampling row is masked before its widening, as the float32 batch masked it."""
    params = [dict(temperature=0), dict(temperature=0), dict(temperature=0.9, seed=2), dict(temperature=0, logprobs=1),
              dict(temperature=0.6, seed=6)]
    logits = bf16_logits(len(params), seed=4)

    def run(logits, rows):
        seqs = [seq_with(SamplingParams(**p)) for p in params]
        for i in (1, 2, 3):
            seqs[i].matcher = object()  # constrained: the sampler masks it (BanTopTokens) before anything else
        sampler = Sampler()
        sampler.masks = BanTopTokens()
        with Float32Rows(VOCAB) as made:
            out = sampler(logits, seqs, consume=True)
        rows.extend(made.rows)
        return out

    old_rows, new_rows = [], []
    expected = run(logits.float(), old_rows)
    assert run(logits, new_rows) == expected
    assert expected[0][1] != logits[1].float().argmax().item()  # the mask moved the greedy row's token
    assert max(new_rows) == 2 and max(old_rows) == len(params)  # rows 2 and 4; the logprob row's log-softmax: 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_cpus_argmax_of_half_logits_is_torchs_first_maximum_nans_and_signed_zeros_included(dtype):
    """argmax_rows on 16-bit logits on the CPU (a greedy row's token there) orders their bits as the floats are
    ordered, vectorized; the rows where bits and floats disagree (+0 against -0, NaN) fall back to torch."""
    from kvgate.engine.sampler import argmax_rows

    inf, nan = float("inf"), float("nan")
    logits = (torch.randn(40, 700, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    logits[0, [17, 400]] = logits[1, [0, 699]] = 30.0  # ties: the first
    logits[2] = -0.0
    logits[2, 9] = 0.0  # -0 == +0: index 0
    logits[3] = -5.0
    logits[3, 4], logits[3, 8] = 0.0, -0.0
    logits[4] = -inf
    logits[5, 50], logits[5, 60] = -nan, nan  # the first NaN, whatever its sign
    logits[6, 70] = nan
    logits[7, 5], logits[7, 6] = inf, -inf
    logits[8] = torch.finfo(dtype).tiny / 4  # subnormals
    logits[8, 3] = -logits[8, 3]
    logits[9] = -0.0
    expected = torch.argmax(logits, -1)
    assert torch.equal(argmax_rows(logits), expected)
    out = torch.empty(40, dtype=torch.long)
    assert argmax_rows(logits, out) is out and torch.equal(out, expected)
    assert expected[:10].tolist() == [17, 0, 0, 4, 0, 50, 70, 5, 0, 0]


def test_greedy_rows_take_the_argmax_the_decode_graph_computed_unless_a_mask_changed_the_logits():
    """A replayed graph has each row's argmax of its bf16 logits already (logits_and_argmax): the sampler takes the
    greedy rows' tokens from it, reading no logits for them. A stand-in argmax shows which tokens were taken."""
    params = [dict(temperature=0), dict(temperature=0.7, seed=1), dict(temperature=0, logprobs=1),
              dict(temperature=0, repetition_penalty=1.5)]
    logits = bf16_logits(len(params), seed=2)
    stand_in = torch.tensor([7, 8, 9, 10])
    tokens, _ = Sampler()(logits, [seq_with(SamplingParams(**p)) for p in params], consume=True, argmax=stand_in)
    expected, _ = old_way(logits, params)
    assert tokens == [7, expected[1], 9, expected[3]]  # greedy rows: the graph's; sampled and penalized: drawn
    out = torch.empty(4, dtype=torch.long)
    batch = SamplingBatch.of([seq_with(SamplingParams(**p)) for p in params])
    assert Sampler().sample(logits, [seq_with(SamplingParams(**p)) for p in params], batch, True, out,
                            argmax=stand_in) is out and out.tolist() == tokens
    greedy = [dict(temperature=0), dict(temperature=0, logprobs=2)]  # every row greedy, one with logprobs
    assert Sampler()(logits[:2], [seq_with(SamplingParams(**p)) for p in greedy], argmax=stand_in[:2])[0] == [7, 8]
    seqs = [seq_with(SamplingParams(**p)) for p in params]
    seqs[0].matcher = object()  # a grammar masks row 0: the graph's argmax is of the logits before the mask
    sampler = Sampler()
    sampler.masks = BanTopTokens()
    tokens, _ = sampler(logits, seqs, consume=True, argmax=stand_in)
    assert tokens[0] not in (7, logits[0].float().argmax().item()) and tokens[2] != 9


@pytest.mark.gpu
def test_on_cuda_a_bf16_batch_samples_what_its_float32_cast_samples_and_widens_only_its_float32_rows():
    """The device half: the sampled rows' inverse CDF is torch's cumsum and searchsorted there, the mask a Triton
    kernel, the rows gathered and copied back on the device; at a Qwen-sized vocabulary."""
    params = (MIXED * 22)[:256]
    logits = (torch.randn(256, 151_936, generator=torch.Generator().manual_seed(3)) * 3).bfloat16().cuda()
    expected = Sampler(device="cuda")(logits.float(), [seq_with(SamplingParams(**p)) for p in params], consume=True)
    with Float32Rows(151_936) as made:
        got = Sampler(device="cuda")(logits, [seq_with(SamplingParams(**p)) for p in params], consume=True)
    assert got == expected
    wide = SamplingBatch.of([seq_with(SamplingParams(**p)) for p in params]).float32_rows()
    assert max(made.rows) == len(wide) < 256
