"""The bound of a W-GPU run (kvgate/bench/bound.py) on synthetic runs worked out by hand: the steps are read off the
scheduled batches as the engine hands them over, a shrinking decode batch pays the weights once a step it ran (not
once per full batch it never had), and the binding term follows the device."""
from __future__ import annotations

import pytest
import torch

from kvgate.bench import bound as bench_bound
from kvgate.bench.bound import Bound, DeviceLimits, ModelCost, StepFacts, StepTrace, bound_of
from kvgate.bench.engine import median_round
from kvgate.engine import SamplingParams
from kvgate.engine.scheduler import AllDecode
from kvgate.engine.sequence import Sequence

# 100 linear parameters a layer stack, a 50-parameter head, 4 FLOPs a position of context, 1,000 weight bytes a
# step, 10 KV bytes a token; a device of 1,000 B/s and 1,000 FLOP/s
COST = ModelCost(layer_linear_params=100, head_params=50, attention_flops_per_position=4, weight_bytes=1000,
                 kv_bytes_per_token=10)
BANDWIDTH_BOUND_DEVICE = DeviceLimits(bandwidth=1000.0, peak_flops=1000.0, peak_source="test")


def sequence(prompt: int, outputs: int) -> Sequence:
    return Sequence("r", list(range(prompt)), SamplingParams(max_tokens=outputs), outputs)


def advance(batch) -> None:
    """What the engine does after a step: the chunks are computed; a fully computed sequence gets its token."""
    for seq, n in batch:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(0)


def decode(*seqs: Sequence) -> AllDecode:
    batch = AllDecode((s, 1) for s in seqs)
    batch.seqs = list(seqs)
    return batch


def shrinking_run() -> StepTrace:
    """A (prompt 3, 2 outputs) and B (prompt 2, 4 outputs): one prefill step, then decode steps of 2, 1 and 1
    sequences as A finishes first."""
    a, b = sequence(3, 2), sequence(2, 4)
    trace = StepTrace()
    for batch in ([(a, 3), (b, 2)], decode(a, b), decode(b), decode(b)):
        trace.record(batch)
        advance(batch)
    return trace


def test_the_trace_counts_each_prefill_token_and_each_decode_sequence_with_its_own_context():
    trace = shrinking_run()
    # prefill: 5 tokens attending to 1+2+3 and 1+2 positions, both prompts end and are sampled;
    # decode: A at 4 and B at 3 positions, then B at 4, then B at 5
    assert trace.steps == [StepFacts(prefill_tokens=5, prefill_context=9, prefill_sampled=2),
                           StepFacts(decode_seqs=2, decode_context=7), StepFacts(1, 4), StepFacts(1, 5)]


def test_a_mixed_step_splits_its_decode_tokens_from_a_chunked_prompt():
    a, b = sequence(3, 4), sequence(10, 4)
    advance([(a, 3)])  # A is decoding: 4 tokens, 3 computed
    b.num_computed_tokens = 4  # B's second chunk: positions 5..8 of 10, not its last, so not sampled
    trace = StepTrace()
    trace.record([(a, 1), (b, 4)])
    assert trace.steps == [StepFacts(decode_seqs=1, decode_context=4, prefill_tokens=4,
                                     prefill_context=5 + 6 + 7 + 8, prefill_sampled=0)]


def test_the_bound_of_a_shrinking_run_by_hand_is_bandwidth_bound_and_above_a_full_batch_every_step():
    bound = bound_of(shrinking_run(), COST, BANDWIDTH_BOUND_DEVICE)
    # prefill FLOPs 2*100*5 + 2*50*2 + 4*9 = 1236; decode FLOPs (200 + 100)*4 + 4*16 = 1264;
    # weights 3 decode steps * 1000 B; KV (7 + 4 + 5) * 10 B
    assert bound == Bound(prefill_s=1.236, weights_s=3.0, kv_s=0.16, decode_flop_s=1.264)
    assert bound.bound_s == pytest.approx(1.236 + 3.16) and bound.binds == "bandwidth"
    # the same 4 decode tokens as if every step carried the full batch of 2: 2 steps, the weights read once fewer
    full = StepTrace([shrinking_run().steps[0], StepFacts(2, 7), StepFacts(2, 9)])
    assert bound_of(full, COST, BANDWIDTH_BOUND_DEVICE).bound_s == pytest.approx(1.236 + 2.16)
    assert bound.bound_s > bound_of(full, COST, BANDWIDTH_BOUND_DEVICE).bound_s


def test_a_slow_enough_device_makes_the_decode_flops_bind():
    bound = bound_of(shrinking_run(), COST, DeviceLimits(bandwidth=1000.0, peak_flops=100.0, peak_source="test"))
    assert bound.binds == "decode_flops"
    assert bound.bound_s == pytest.approx(12.36 + 12.64)  # prefill then decode FLOPs, the bytes hidden under them


def test_the_bound_entry_reports_tok_s_fraction_and_binding_term():
    entry = bench_bound.bound_entry(shrinking_run(), COST, BANDWIDTH_BOUND_DEVICE, output_tokens=6, elapsed_s=8.792)
    assert entry["bound_tok_s"] == pytest.approx(6 / 4.396)
    assert entry["fraction_of_bound"] == pytest.approx(0.5) and entry["binds"] == "bandwidth"
    assert entry["bound"]["decode_steps"] == 3 and entry["bound"]["steps"] == 4


def test_the_figure_is_the_median_of_three_rounds_not_the_best():
    rounds = [{"output_tok_s": 30.0, "round": 1}, {"output_tok_s": 10.0, "round": 2},
              {"output_tok_s": 20.0, "round": 3}]
    figure = median_round(rounds)
    assert figure["output_tok_s"] == 20.0 and figure["round"] == 3
    assert figure["rounds_tok_s"] == [30.0, 10.0, 20.0]  # in the order they ran


def test_a_known_gpu_takes_its_datasheet_peak_and_anything_else_a_measured_one(monkeypatch):
    for name, peak in (("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                       ("NVIDIA A100-SXM4-80GB", 312e12)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        flops, source = bench_bound.peak_flops(torch.device("cuda"), torch.bfloat16)
        assert flops == peak and source.startswith("datasheet"), name
    flops, source = bench_bound.peak_flops(torch.device("cpu"), torch.float32)
    assert flops > 0 and source.startswith("measured")


def test_copy_bandwidth_on_the_cpu_is_measured():
    assert bench_bound.measure_copy_bandwidth(torch.device("cpu"), repeats=2) > 0
