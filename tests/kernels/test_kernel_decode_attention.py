"""Split-K paged decode attention against reference.paged_attention (one query per sequence)."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_testing import DEVICE, HAS_CUDA, assert_close, context_lens_tensor, cu_seqlens, make_paged_kv
from kvgate.kernels import reference
from kvgate.kernels.decode_attention import (CHUNK, MAX_SPLITS, MIN_CHUNK, Splits, choose_splits, decode_attention,
                                             decode_splits)


def run_decode(context: list[int], num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
               num_splits: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache, v_cache, block_tables = make_paged_kv(context, num_kv_heads, head_dim, page_size, device=DEVICE)
    q = torch.randn(len(context), num_heads, head_dim, device=DEVICE)
    cu, ctx = cu_seqlens([1] * len(context), DEVICE), context_lens_tensor(context, DEVICE)
    scale = head_dim ** -0.5
    out = decode_attention(q, k_cache, v_cache, block_tables, cu, ctx, scale, num_splits=num_splits)
    return out, reference.paged_attention(q, k_cache, v_cache, block_tables, cu, ctx, scale)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_decode_matches_reference_at_page_boundaries_for_any_split_count(num_splits):
    out, expected = run_decode([1, 8, 9, 16, 17, 47], num_heads=4, num_kv_heads=2, head_dim=16, page_size=8,
                               num_splits=num_splits)
    assert_close(out, expected)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (14, 2)])
def test_decode_serves_every_query_head_of_a_gqa_group(num_heads, num_kv_heads):
    out, expected = run_decode([5, 33], num_heads, num_kv_heads, head_dim=16, page_size=4, num_splits=3)
    assert_close(out, expected)


def test_decode_masks_a_head_size_that_is_not_a_power_of_two():
    out, expected = run_decode([3, 20], num_heads=2, num_kv_heads=1, head_dim=24, page_size=8, num_splits=2)
    assert_close(out, expected)


def test_decode_with_more_splits_than_context_tiles_leaves_empty_splits_out_of_the_merge():
    out, expected = run_decode([1, 2, 70], num_heads=2, num_kv_heads=1, head_dim=16, page_size=16, num_splits=8)
    assert not out.isnan().any()
    assert_close(out, expected)


def test_decode_default_split_count_comes_from_the_table_width_and_is_correct():
    out, expected = run_decode([300, 7], num_heads=2, num_kv_heads=1, head_dim=16, page_size=32, num_splits=None)
    assert_close(out, expected)


def test_b256_with_two_kv_heads_gets_a_full_wave_of_programs_of_at_most_512_tokens():
    """Issue 41: the old occupancy rule gave this shape 1 split, so each program walked up to 2048 tokens."""
    splits = choose_splits(batch=256, num_kv_heads=2, max_context=2048, granule=256, sms=132)
    assert 256 * 2 * splits.num_splits >= 132
    assert splits.chunk <= 512
    assert splits.num_splits * splits.chunk >= 2048


@pytest.mark.parametrize("batch,num_kv_heads", [(1, 2), (7, 8), (16, 2), (64, 8), (256, 2), (256, 8)])
@pytest.mark.parametrize("max_context", [16, 300, 2048, 4096, 16384])
@pytest.mark.parametrize("granule", [16, 64, 256])
def test_chunks_are_granule_multiples_of_at_most_512_one_split_each_up_to_max_splits(batch, num_kv_heads,
                                                                                      max_context, granule):
    splits = choose_splits(batch, num_kv_heads, max_context, granule, sms=132)
    assert splits.chunk % granule == 0 and splits.chunk <= CHUNK
    assert splits.num_splits == min(-(-max_context // splits.chunk), MAX_SPLITS)
    wave = -(-132 // (batch * num_kv_heads))  # splits per (sequence, KV head) for one program per SM
    if wave <= MAX_SPLITS and max_context >= wave * max(MIN_CHUNK, granule):
        assert batch * num_kv_heads * splits.num_splits >= 132


def test_a_small_batch_takes_smaller_chunks_down_to_the_minimum_to_fill_the_sms():
    assert choose_splits(8, 2, 2048, 64, sms=132) == Splits(num_splits=11, chunk=192)  # 176 programs
    assert choose_splits(1, 2, 2048, 64, sms=132) == Splits(num_splits=16, chunk=128)  # MIN_CHUNK: 32 programs only


def test_past_max_splits_chunks_of_512_the_chunk_stays_and_the_split_count_stays_capped():
    assert choose_splits(256, 2, 32768, 256, sms=132) == Splits(num_splits=MAX_SPLITS, chunk=512)
    assert choose_splits(1, 2, 131072, 256, sms=132) == Splits(num_splits=MAX_SPLITS, chunk=512)


MIXED = [1, 100, 511, 512, 513, 2048, 0]  # across the 512-token chunk edges; the last is a CUDA-graph padding row


@pytest.mark.parametrize("num_kv_heads", [2, 8])
@pytest.mark.parametrize("group", [1, 2, 7])
def test_fixed_chunks_match_the_reference_on_mixed_contexts_and_a_padding_row_gives_zeros(num_kv_heads, group,
                                                                                           monkeypatch):
    k_cache, v_cache, block_tables = make_paged_kv([max(n, 1) for n in MIXED], num_kv_heads, 16, 16, device=DEVICE)
    block_tables[-1] = -1
    q = torch.randn(len(MIXED), num_kv_heads * group, 16, device=DEVICE)
    cu, ctx = cu_seqlens([1] * len(MIXED), DEVICE), context_lens_tensor(MIXED, DEVICE)
    if not HAS_CUDA:  # the CPU's 4 "SMs" are one wave already: the chunk is the full 512
        assert decode_splits(q, k_cache, block_tables) == Splits(num_splits=5, chunk=512)
    empty = torch.empty
    with monkeypatch.context() as poisoned:  # a partial the reduce should not read is NaN, not a lucky zero
        poisoned.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
        out = decode_attention(q, k_cache, v_cache, block_tables, cu, ctx, 0.25)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    expected = reference.paged_attention(q[:-1], k_cache, v_cache, block_tables[:-1], cu[:-1], ctx[:-1], 0.25)
    assert_close(out[:-1], expected)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_a_padding_row_without_context_yields_zeros_and_leaves_the_others_exact(num_splits):
    context = [9, 0, 30]
    k_cache, v_cache, block_tables = make_paged_kv([9, 1, 30], 1, 16, 8, device=DEVICE)
    block_tables[1] = -1
    q = torch.randn(3, 2, 16, device=DEVICE)
    cu, ctx = cu_seqlens([1, 1, 1], DEVICE), context_lens_tensor(context, DEVICE)
    out = decode_attention(q, k_cache, v_cache, block_tables, cu, ctx, 0.25, num_splits=num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    keep = [0, 2]
    expected = reference.paged_attention(q[keep], k_cache, v_cache, block_tables[keep], cu[:3],
                                         ctx[keep], 0.25)
    assert_close(out[keep], expected)


@pytest.mark.parametrize("group", [1, 7])
def test_a_program_takes_every_num_splits_th_chunk_when_chunks_outnumber_splits(group):
    """What a table wider than MAX_SPLITS chunks gets, at a size the interpreter runs: 2048 tokens in 16 chunks of
    128 over 3 programs, the others across a chunk edge or within the first chunk."""
    context = [1, 100, 127, 128, 129, 385, 2048, 0]
    k_cache, v_cache, block_tables = make_paged_kv([max(n, 1) for n in context], 2, 16, 16, device=DEVICE)
    block_tables[-1] = -1
    q = torch.randn(len(context), 2 * group, 16, device=DEVICE)
    cu, ctx = cu_seqlens([1] * len(context), DEVICE), context_lens_tensor(context, DEVICE)
    out = decode_attention(q, k_cache, v_cache, block_tables, cu, ctx, 0.25, num_splits=3, chunk=128)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    expected = reference.paged_attention(q[:-1], k_cache, v_cache, block_tables[:-1], cu[:-1], ctx[:-1], 0.25)
    assert_close(out[:-1], expected)
