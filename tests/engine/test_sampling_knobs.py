"""OpenAI's logit_bias, vLLM's min_p and min_tokens: each changes tokens exactly as specified, on the batched path
(several rows, mixed knobs) and through the engine's decode steps (SamplingRows)."""
from __future__ import annotations

import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.outputs import RequestRejected
from kvgate.engine.sampler import Sampler, apply_adjustments
from kvgate.engine.sequence import Sequence
from tests.engine.helpers import random_prompts, tiny_source


@pytest.fixture(scope="module")
def llm():
    source, _ = tiny_source("llama", seed=5)
    return LLM(source, kv_cache_memory=1 << 20)


PROMPTS = random_prompts(3, 4, 12, seed=5)


def seq_with(params: SamplingParams, outputs: tuple = (), stop_ids=frozenset()) -> Sequence:
    seq = Sequence("r", [1, 2, 3], params, params.max_tokens)
    seq.token_ids += list(outputs)
    seq.stop_ids = frozenset(stop_ids)
    return seq


def test_logit_bias_moves_a_greedy_rows_argmax_and_leaves_other_rows_and_logprobs_alone():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0]])
    seqs = [seq_with(SamplingParams(temperature=0, logit_bias={2: 2.5}, logprobs=0)),  # 1 + 2.5 beats 3
            seq_with(SamplingParams(temperature=0)),
            seq_with(SamplingParams(temperature=0, logit_bias={1: -100.0}))]  # the top banned: next best is 3
    tokens, lps = Sampler()(logits, seqs, consume=True)
    assert tokens == [2, 1, 3]
    assert lps[0] == {2: logits[0].log_softmax(-1)[2].item()}  # the model's own distribution, before the bias


def test_min_tokens_masks_stop_tokens_until_reached_and_then_lets_them_through():
    logits = torch.tensor([[0.0, 1.0, 9.0], [0.0, 1.0, 9.0], [0.0, 1.0, 9.0]])  # 2 is the model's favourite
    params = SamplingParams(temperature=0, min_tokens=2)
    seqs = [seq_with(params, outputs=(), stop_ids={2}), seq_with(params, outputs=(1,), stop_ids={2}),
            seq_with(params, outputs=(1, 1), stop_ids={2})]
    assert Sampler()(logits, seqs)[0] == [1, 1, 2]
    structured = seq_with(params, stop_ids={2})
    structured.matcher = object()  # a grammar's row: apply_adjustments leaves its stop tokens to the grammar
    logits = logits[:1].clone()
    apply_adjustments(logits, [structured], [0])
    assert logits[0].tolist() == [0.0, 1.0, 9.0]


def test_min_p_keeps_only_tokens_at_least_min_p_times_as_likely_as_the_top():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    drawn = set()
    for seed in range(200):
        seqs = [seq_with(SamplingParams(temperature=1.0, min_p=0.5, seed=seed))]
        drawn |= set(Sampler()(probs.log(), seqs)[0])
    assert drawn == {0, 1}  # 0.3 >= 0.5 * 0.5; 0.15 is not
    seqs = [seq_with(SamplingParams(temperature=1.0, min_p=0.5, top_k=3, seed=s)) for s in range(200)]
    assert set(Sampler()(probs.log().expand(200, 4).contiguous(), seqs)[0]) == {0, 1}


def test_a_large_logit_bias_forces_every_generated_token(llm):
    forced = 11
    out = llm.generate(PROMPTS, [SamplingParams(temperature=t, max_tokens=6, ignore_eos=True, seed=1,
                                                logit_bias={forced: 100.0}) for t in (0, 0.8, 1.5)],
                       use_tqdm=False)
    assert [o.token_ids for o in out] == [[forced] * 6] * 3


def test_a_banned_token_never_appears_where_greedy_would_pick_it(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    free = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].token_ids
    banned = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                       logit_bias={free[0]: -100.0}), use_tqdm=False)[0].token_ids
    assert free[0] not in banned and banned[0] != free[0]


def test_min_tokens_holds_off_an_eos_the_bias_forces_until_that_many_tokens(llm):
    eos = next(iter(llm.engine.eos_token_ids))
    forced_eos = {eos: 100.0}
    out = llm.generate(PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=20, logit_bias=forced_eos),
                                     SamplingParams(temperature=0, max_tokens=20, logit_bias=forced_eos, min_tokens=5)],
                       use_tqdm=False)
    assert out[0].token_ids == [eos] and out[0].finish_reason == "stop"
    assert len(out[1].token_ids) == 6 and eos not in out[1].token_ids[:5] and out[1].token_ids[5] == eos
    assert out[1].finish_reason == "stop"


def test_a_logit_bias_token_outside_the_vocabulary_is_rejected_naming_it(llm):
    with pytest.raises(RequestRejected, match="logit_bias token id 100000 is outside the vocabulary"):
        llm.engine.add_request("oob", PROMPTS[0], SamplingParams(logit_bias={100_000: 1.0}))


@pytest.mark.parametrize("kwargs, word", [(dict(min_p=1.5), "min_p"), (dict(min_tokens=-1), "min_tokens"),
                                          (dict(logit_bias={3: 101}), "logit_bias"),
                                          (dict(prompt_logprobs=21), "prompt_logprobs")])
def test_invalid_new_knobs_raise_naming_the_field(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)
