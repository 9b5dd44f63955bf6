"""Plain-torch reference twins of the kernels: the CPU path, and the oracle the Triton kernels are tested against.

Shapes (N flattened new tokens of B sequences, H heads, D head size):
  k_cache, v_cache: [num_blocks, block_size, H_kv, D]
  slot_mapping:     [N] int64, slot = block_id * block_size + offset; -1 skips the token
  block_tables:     [B, max_blocks] int32, padded with -1
  cu_seqlens_q:     [B + 1] int32, sequence i owns rows cu[i]:cu[i+1] of q
  context_lens:     [B] int32, tokens of sequence i in the cache *including* its new ones
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvgate.kernels.lora_rows import LoraRows


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence, [length, H_kv, D]."""
    block_size = cache.shape[1]
    blocks = block_table[: (length + block_size - 1) // block_size].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole cached context (prefill, chunked
    prefill, prefix-cache extend and decode are all this one case)."""
    cu, ctx = cu_seqlens_q.tolist(), context_lens.tolist()
    decode = [i for i in range(len(ctx)) if cu[i + 1] - cu[i] == 1]
    if len(decode) == len(ctx) > 1:  # a pure decode step: no row bookkeeping
        return _decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    out = torch.empty_like(q)
    if len(decode) > 1:  # one batched call: decode steps are many tiny sequences
        rows = torch.tensor([cu[i] for i in decode], device=q.device)
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, block_tables[decode], context_lens[decode], scale)
        decode = set(decode)
    else:
        decode = set()
    for i, length in enumerate(ctx):
        start, end = cu[i], cu[i + 1]
        if end == start or i in decode:
            continue
        k = gather_kv(k_cache, block_tables[i], length).to(q.dtype)
        v = gather_kv(v_cache, block_tables[i], length).to(q.dtype)
        q_len = end - start
        if q_len == length:  # nothing cached before: plain causal
            mask, causal = None, True
        else:
            q_pos = torch.arange(length - q_len, length, device=q.device)
            mask, causal = q_pos[:, None] >= torch.arange(length, device=q.device)[None, :], False
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, is_causal=causal,
            scale=scale, enable_gqa=True,
        ).transpose(0, 1)
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence, block by block over exactly the blocks each sequence uses.

    Padding every sequence to the longest context costs what continuous batching's mixed lengths make large, so
    scores are computed per used block, the softmax is merged across a sequence's blocks (max, then sum), and
    the weighted values are summed back per sequence. A sequence without context gets zeros."""
    b, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    lens = context_lens.to(device=q.device, dtype=torch.long)
    used = torch.arange(block_tables.shape[1], device=q.device) < ((lens + block_size - 1) // block_size)[:, None]
    blocks = block_tables.to(q.device)[used].long()  # every used block, sequence after sequence
    owner = used.nonzero()[:, 0]  # whose block it is
    first_pos = (used.cumsum(1) - 1)[used] * block_size
    valid = first_pos[:, None] + torch.arange(block_size, device=q.device) < lens[owner][:, None]
    qb = (q.view(b, kv_heads, group, dim).float() * scale)[owner]  # [blocks, kv_heads, group, dim]
    k, v = k_cache.index_select(0, blocks).float(), v_cache.index_select(0, blocks).float()
    # bmm per KV head takes the strided [block_size, dim] slices as they are; a 4-d matmul would copy them
    scores = torch.stack([torch.bmm(qb[:, h], k[:, :, h].transpose(1, 2)) for h in range(kv_heads)], 1)
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    seq_max = torch.full((b, kv_heads, group), float("-inf"), device=q.device).scatter_reduce_(
        0, owner[:, None, None].expand(-1, kv_heads, group), scores.amax(-1), "amax")
    probs = torch.exp(scores - seq_max[owner][..., None])
    denom = torch.zeros(b, kv_heads, group, device=q.device).index_add_(0, owner, probs.sum(-1))
    weighted = torch.stack([torch.bmm(probs[:, h], v[:, :, h]) for h in range(kv_heads)], 1)
    out = torch.zeros(b, kv_heads, group, dim, device=q.device).index_add_(0, owner, weighted)
    return (out / denom.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).view(b, heads, dim).to(q.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm in float32 like HF; with `residual`, adds it first and returns (normed, new residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), residual


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary on [N, H, D] with cos/sin [N, D/2] gathered for each token's position."""
    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[r], t] = -inf where bit t % 32 of bitmask[r, t // 32] is clear (a structured-output
    row's disallowed tokens); tokens past the bitmask's 32 * words are never allowed."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] < vocab:
        allowed = F.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = rows.long()
    logits[index] = logits[index].masked_fill(~allowed[:, :vocab].to(logits.device), float("-inf"))


def qkv_rope_store(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 0.0
                   ) -> torch.Tensor:
    """The attention's steps between the qkv projection and attention: split the fused [N, (H + 2 H_kv) D] output
    into heads, RMSNorm q and k over the head dim when given weights (Qwen3), rotate them, store k and v at
    `slot_mapping`; returns q [N, H, D] (k and v are only read back from the cache)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps)[0], rms_norm(k, k_norm, eps)[0]
    q, k = rotary(q, k, cos, sin)
    store_kvcache(k, v.view(-1, num_kv_heads, head_dim), k_cache, v_cache, slot_mapping)
    return q


def lora_apply(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor], offsets: list[int],
               rows: LoraRows) -> torch.Tensor:
    """y [N, out] += each row's LoRA delta, in place (kernels/lora.py has the layout; a base row gets none).

    By adapter (kernels/lora_rows.py): a run of rows of one slot is shrunk by its slot's `a` and expanded by each
    slice's `b` straight from x's rows into y's (the slices tile y's columns in order: `offsets` are their running
    widths); the other adapter rows are gathered into one padded segment per slot, shrunk and expanded in one batched
    matmul per slice, and their deltas added back. A row meets no other adapter's weights and a base row is never read."""
    rank = bs[0].shape[1]
    for slot, start, end in rows.runs:
        t = torch.mm(x[start:end].float(), a[slot].float().T)  # [rows, slices x rank]
        for i, (b, offset) in enumerate(zip(bs, offsets)):
            out = y[start:end, offset:offset + b.shape[2]]
            if out.dtype == torch.float32:
                out.addmm_(t[:, i * rank:(i + 1) * rank], b[slot])
            else:
                out.add_(torch.mm(t[:, i * rank:(i + 1) * rank], b[slot].float()).to(out.dtype))
    if rows.count == 0:
        return y
    segments, in_features = rows.count, x.shape[1]
    xs = x.index_select(0, rows.gather).view(segments, rows.length, in_features).float()
    t = torch.bmm(xs, rows.by_segment(a).float().transpose(1, 2))  # [segments, length, slices x rank]
    if rows.valid is not None:
        t.mul_(rows.valid)  # padding adds exactly 0 to the row it repeats
    deltas = [torch.bmm(t[:, :, i * rank:(i + 1) * rank], rows.by_segment(b).float()) for i, b in enumerate(bs)]
    delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1)  # one add into y's full rows
    y.index_add_(0, rows.gather, delta.view(-1, y.shape[1]).to(y.dtype))
    return y
