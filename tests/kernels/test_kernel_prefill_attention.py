"""Paged prefill / extend attention against reference.paged_attention."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_testing import DEVICE, assert_close, context_lens_tensor, cu_seqlens, make_paged_kv
from kvgate.kernels import reference
from kvgate.kernels.prefill_attention import prefill_attention


def run_prefill(q_lens: list[int], context: list[int], num_heads: int = 4, num_kv_heads: int = 2,
                head_dim: int = 16, page_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache, v_cache, block_tables = make_paged_kv([max(c, 1) for c in context], num_kv_heads, head_dim, page_size,
                                                   device=DEVICE)
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=DEVICE)
    cu, ctx = cu_seqlens(q_lens, DEVICE), context_lens_tensor(context, DEVICE)
    scale = head_dim ** -0.5
    out = prefill_attention(q, k_cache, v_cache, block_tables, cu, ctx, scale)
    return out, reference.paged_attention(q, k_cache, v_cache, block_tables, cu, ctx, scale)


def test_prefill_of_whole_prompts_is_causal_across_ragged_and_page_boundary_lengths():
    lens = [1, 8, 9, 16, 33]
    out, expected = run_prefill(lens, lens)
    assert_close(out, expected)


def test_extend_attends_to_a_cached_prefix_aligned_or_not_with_pages():
    out, expected = run_prefill([5, 12, 17], [13, 20, 40])
    assert_close(out, expected)


def test_a_chunked_prefill_batched_with_decode_rows_matches_reference():
    out, expected = run_prefill([7, 1, 20, 1], [30, 9, 20, 41])
    assert_close(out, expected)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (14, 2)])
def test_prefill_serves_every_query_head_of_a_gqa_group(num_heads, num_kv_heads):
    out, expected = run_prefill([9, 18], [9, 30], num_heads, num_kv_heads, page_size=4)
    assert_close(out, expected)


def test_prefill_masks_a_head_size_that_is_not_a_power_of_two():
    out, expected = run_prefill([6, 11], [6, 19], num_heads=2, num_kv_heads=1, head_dim=24)
    assert_close(out, expected)


def test_a_sequence_without_new_queries_does_not_disturb_the_others():
    out, expected = run_prefill([4, 0, 3], [4, 10, 12])
    assert_close(out, expected)


def test_one_long_prompt_spreads_over_several_query_tiles():
    out, expected = run_prefill([45], [60], page_size=16)
    assert_close(out, expected)


def test_a_batch_of_many_short_rows_beside_one_long_chunk():
    q_lens = [1] * 9 + [37]
    out, expected = run_prefill(q_lens, [3, 9, 1, 8, 17, 2, 5, 16, 4, 50])
    assert_close(out, expected)


def test_attention_reads_strided_per_layer_views_of_the_cache():
    k_cache, v_cache, block_tables = make_paged_kv([20, 9], 2, 16, 8, device=DEVICE)
    interleaved = torch.stack([k_cache, v_cache], dim=1)  # [blocks, k/v, page, heads, dim]
    k_view, v_view = interleaved[:, 0], interleaved[:, 1]
    q = torch.randn(6, 4, 16, device=DEVICE)
    cu, ctx = cu_seqlens([5, 1], DEVICE), context_lens_tensor([20, 9], DEVICE)
    out = prefill_attention(q, k_view, v_view, block_tables, cu, ctx, 0.25)
    assert_close(out, reference.paged_attention(q, k_cache, v_cache, block_tables, cu, ctx, 0.25))
