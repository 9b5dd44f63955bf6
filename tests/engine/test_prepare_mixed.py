"""A prefill or mixed step's flat inputs, computed as tensors (issue 41), equal the token-by-token construction they
replaced: chunks that start mid-page and cross pages, cached prefixes, decode rows beside prefill chunks, an embedding
request (pooled, never sampled), ragged block tables padded with -1."""
from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from kvgate.engine.model_runner import ModelRunner


def token_by_token(batch, bs: int):
    """The construction _prepare_mixed had before: one Python list entry per token."""
    ids, pos, slots, cu, ctx, rows, tables = [], [], [], [0], [], [], []
    width = max(len(seq.block_table) for seq, _ in batch)
    for seq, n in batch:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        ids += seq.token_ids[start:end]
        pos += range(start, end)
        slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]
        cu.append(cu[-1] + n)
        ctx.append(end)
        tables.append(seq.block_table + [-1] * (width - len(seq.block_table)))
        if end == seq.num_tokens and seq.pooling is None:
            rows.append(cu[-1] - 1)
    return ids, pos, slots, cu, ctx, tables, rows


def sequence(rng: random.Random, bs: int, computed: int, n: int, total: int, pooling=None):
    blocks = rng.sample(range(1000), -(-(computed + n) // bs) + rng.randint(0, 2))  # a table may run ahead
    return SimpleNamespace(token_ids=[rng.randrange(50000) for _ in range(total)], num_computed_tokens=computed,
                           num_tokens=total, block_table=blocks, pooling=pooling)


def test_mixed_inputs_equal_the_token_by_token_construction():
    rng, bs = random.Random(0), 16
    runner = SimpleNamespace(block_size=bs, device=torch.device("cpu"))
    batch = [(sequence(rng, bs, 0, 37, 37), 37),  # a whole prompt, sampled
             (sequence(rng, bs, 5, 11, 40), 11),  # a chunk from mid-page, more to come: not sampled
             (sequence(rng, bs, 64, 1, 65), 1),  # a decode row beside them
             (sequence(rng, bs, 30, 20, 50), 20),  # the last chunk after a cached prefix, crossing a page
             (sequence(rng, bs, 0, 9, 9, pooling="mean"), 9)]  # an embedding: pooled, not sampled
    ids, positions, meta, rows = ModelRunner._prepare_mixed(runner, batch)
    ref_ids, ref_pos, ref_slots, ref_cu, ref_ctx, ref_tables, ref_rows = token_by_token(batch, bs)
    assert ids.tolist() == ref_ids and ids.dtype == torch.long
    assert positions.tolist() == ref_pos and positions.dtype == torch.long
    assert meta.slot_mapping.tolist() == ref_slots and meta.slot_mapping.dtype == torch.long
    assert meta.cu_seqlens_q.tolist() == ref_cu and meta.cu_seqlens_q.dtype == torch.int32
    assert meta.context_lens.tolist() == ref_ctx and meta.context_lens.dtype == torch.int32
    assert meta.block_tables.tolist() == ref_tables and meta.block_tables.dtype == torch.int32
    assert rows == ref_rows == [36, 48, 68]
