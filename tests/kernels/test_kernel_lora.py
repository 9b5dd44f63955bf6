"""Batched LoRA (kernels/lora.py) against its twin (reference.lora_apply), and the twin against a row-by-row oracle."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_testing import DEVICE, assert_close
from kvgate.kernels import lora, ops, reference
from kvgate.kernels.lora_rows import LoraRows


def make_stack(slots: int, rank: int, in_features: int, widths: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, rank * len(widths), in_features, generator=g).to(DEVICE)
    bs = [torch.randn(slots, rank, w, generator=g).to(DEVICE) for w in widths]
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    return a, bs, offsets


def oracle(y, x, a, bs, offsets, rows):
    """One row at a time, as the math says it."""
    out = y.clone()
    for n, slot in enumerate(rows.rows.tolist()):
        if slot < 0:
            continue
        t = a[slot] @ x[n]
        for i, (b, off) in enumerate(zip(bs, offsets)):
            rank = b.shape[1]
            out[n, off:off + b.shape[2]] += t[i * rank:(i + 1) * rank] @ b[slot]
    return out


@pytest.mark.parametrize("widths,rank,in_features", [([40, 24, 24], 8, 70), ([96, 96], 4, 32), ([33], 16, 129)])
def test_kernel_and_twin_agree_with_the_oracle_over_mixed_slots_and_base_rows(widths, rank, in_features):
    a, bs, offsets = make_stack(4, rank, in_features, widths)
    rows = LoraRows.of([2, -1, 0, 0, 3, -1, 1, 2, 2], DEVICE)
    x = torch.randn(len(rows.rows), in_features, device=DEVICE)
    y = torch.randn(len(rows.rows), sum(widths), device=DEVICE)
    expected = oracle(y, x, a, bs, offsets, rows)
    assert_close(reference.lora_apply(y.clone(), x, a, bs, offsets, rows), expected, atol=1e-4, rtol=1e-4)
    got = lora.lora_apply(y.clone(), x, a, bs, offsets, rows)
    assert_close(got, expected, atol=1e-4, rtol=1e-4)
    base = (rows.rows < 0).nonzero()[:, 0]
    assert torch.equal(got[base], y[base])  # base rows are untouched, bit for bit


@pytest.mark.parametrize("run_rows", [2, 100])
@pytest.mark.parametrize("slots", [[7, 0, 7, -1, 0, 7], [1, 1, 3, 3, 3, 3, -1], [5], [-1, -1], [4, 2, 0, 6, 0]])
def test_the_twin_groups_rows_by_slot_however_the_slots_spread(slots, run_rows):
    """Contiguous slots (sliced stacks), sparse ones (gathered stacks), unused slots between, uneven segments
    (padding), one row, no adapter row at all, rows in runs or all gathered: each row gets exactly its own adapter's
    delta."""
    a, bs, offsets = make_stack(8, 4, 24, [16, 8])
    rows = LoraRows.of(slots, DEVICE, run_rows)
    x, y = torch.randn(len(slots), 24, device=DEVICE), torch.randn(len(slots), 24, device=DEVICE)
    assert_close(reference.lora_apply(y.clone(), x, a, bs, offsets, rows), oracle(y, x, a, bs, offsets, rows),
                 atol=1e-4, rtol=1e-4)


def test_a_long_run_of_one_slot_is_multiplied_where_it_lies_and_only_the_short_rows_are_gathered():
    """A prefill chunk is rows in a run: the twin multiplies x's slice and adds into y's, so only the decode-like rows
    (runs shorter than run_rows) go through the padded segments; every row still gets exactly its own delta, through
    the twin and the kernel alike, base rows untouched bit for bit."""
    slots = [1] * 10 + [0, 2, 0] + [-1] * 3 + [2] * 9 + [1, 1]
    rows = LoraRows.of(slots, DEVICE, run_rows=8)
    assert rows.runs == ((1, 0, 10), (2, 16, 25))
    assert sorted(set(rows.gather.tolist())) == [10, 11, 12, 25, 26]  # the short rows, never a run's
    a, bs, offsets = make_stack(3, 4, 24, [16, 8, 8])
    x, y = torch.randn(len(slots), 24, device=DEVICE), torch.randn(len(slots), 32, device=DEVICE)
    expected = oracle(y, x, a, bs, offsets, rows)
    for apply in (reference.lora_apply, lora.lora_apply):
        got = apply(y.clone(), x, a, bs, offsets, rows)
        assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert torch.equal(got[13:16], y[13:16])
    only_runs = LoraRows.of([0] * 8 + [-1] + [2] * 8, DEVICE, run_rows=8)
    assert only_runs.count == 0 and len(only_runs.runs) == 2  # no segment at all: nothing gathered
    x, y = torch.randn(17, 24, device=DEVICE), torch.randn(17, 32, device=DEVICE)
    assert_close(reference.lora_apply(y.clone(), x, a, bs, offsets, only_runs), oracle(y, x, a, bs, offsets, only_runs),
                 atol=1e-4, rtol=1e-4)


def test_a_run_adds_in_half_precision_like_the_segments():
    a, bs, offsets = make_stack(2, 4, 32, [48, 16])
    a, bs = a.half(), [b.half() for b in bs]
    x, y = torch.randn(10, 32, device=DEVICE).half(), torch.randn(10, 64, device=DEVICE).half()
    slots = [1] * 9 + [0]
    by_run = reference.lora_apply(y.clone(), x, a, bs, offsets, LoraRows.of(slots, DEVICE, run_rows=8))
    by_segment = reference.lora_apply(y.clone(), x, a, bs, offsets, LoraRows.of(slots, DEVICE, run_rows=100))
    assert by_run.dtype == torch.float16
    assert_close(by_run, by_segment, atol=2e-2, rtol=2e-2)


def test_the_twin_never_reads_a_base_row():
    """Segmented, not masked: a base row's input (here NaN) is multiplied by no adapter, so its output stays as the
    base projection left it and the adapter rows stay finite."""
    a, bs, offsets = make_stack(3, 4, 16, [8, 8])
    rows = LoraRows.of([2, -1, 0, -1, 2], DEVICE)
    x, y = torch.randn(5, 16, device=DEVICE), torch.randn(5, 16, device=DEVICE)
    x[1] = x[3] = float("nan")
    got = reference.lora_apply(y.clone(), x, a, bs, offsets, rows)
    assert torch.equal(got[[1, 3]], y[[1, 3]])
    assert torch.isfinite(got).all()


def test_kernel_tiles_wide_outputs_and_long_inputs(monkeypatch):
    monkeypatch.setattr(lora, "BLOCK_OUT", 16)
    monkeypatch.setattr(lora, "BLOCK_K", 16)
    a, bs, offsets = make_stack(3, 8, 50, [70, 30], seed=1)
    rows = LoraRows.of([1, 0, -1, 2], DEVICE)
    x, y = torch.randn(4, 50, device=DEVICE), torch.zeros(4, 100, device=DEVICE)
    assert_close(lora.lora_apply(y.clone(), x, a, bs, offsets, rows), reference.lora_apply(y, x, a, bs, offsets, rows),
                 atol=1e-4, rtol=1e-4)


def test_kernel_adds_in_half_precision_like_the_twin():
    a, bs, offsets = make_stack(2, 4, 32, [48])
    a, bs = a.half(), [b.half() for b in bs]
    rows = LoraRows.of([0, 1, -1], DEVICE)
    x, y = torch.randn(3, 32, device=DEVICE).half(), torch.randn(3, 48, device=DEVICE).half()
    assert_close(lora.lora_apply(y.clone(), x, a, bs, offsets, rows), reference.lora_apply(y.clone(), x, a, bs, offsets,
                 rows), atol=2e-2, rtol=2e-2)


def test_ops_takes_the_kernel_when_triton_is_forced_and_the_twin_when_the_reference_is(monkeypatch):
    a, bs, offsets = make_stack(2, 4, 16, [8, 8])
    rows = LoraRows.of([1, -1, 0], DEVICE)
    x, y = torch.randn(3, 16, device=DEVICE), torch.randn(3, 16, device=DEVICE)
    outs = {}
    for forced, module in (("triton", lora), ("reference", reference)):
        monkeypatch.setenv("KVGATE_KERNELS", forced)
        calls = []
        real = module.lora_apply
        monkeypatch.setattr(module, "lora_apply", lambda *args, real=real: calls.append(1) or real(*args))
        outs[forced] = ops.lora_apply(y.clone(), x, a, bs, offsets, rows)
        assert calls == [1], forced
    assert_close(outs["triton"], outs["reference"], atol=1e-4, rtol=1e-4)


def test_a_model_step_mixing_adapters_gives_the_same_tokens_through_the_kernels_as_through_the_twins(monkeypatch,
                                                                                                     tmp_path):
    from kvgate.engine import LLM, SamplingParams
    from tests.engine.helpers import random_prompts, tiny_source
    from tests.engine.lora_adapters import make_adapter

    source, hf = tiny_source("llama", seed=8)
    paths = {name: str(tmp_path / name) for name in ("x", "y")}
    for i, path in enumerate(paths.values()):
        make_adapter(hf, path, seed=i, r=4)
    prompts = random_prompts(3, 3, 8, seed=8)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=0)
    outs = {}
    for forced in ("reference", "triton"):
        monkeypatch.setenv("KVGATE_KERNELS", forced)
        llm = LLM(source, device=DEVICE, kv_cache_memory=1 << 20, max_loras=2, loras=paths)
        outs[forced] = llm.generate(prompts, params, use_tqdm=False, lora=["x", None, "y"])
    for ref, got in zip(outs["reference"], outs["triton"]):
        assert got.token_ids == ref.token_ids
        assert [lp[t] for lp, t in zip(got.logprobs, got.token_ids)] == pytest.approx(
            [lp[t] for lp, t in zip(ref.logprobs, ref.token_ids)], abs=1e-4)
