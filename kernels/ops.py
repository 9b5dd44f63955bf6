"""The kernel entry points the engine calls: Triton on CUDA tensors, the torch reference twins elsewhere.

| op              | Triton kernel (file)                                             | twin (reference.py) |
|-----------------|------------------------------------------------------------------|---------------------|
| store_kvcache   | store_kvcache.py: one program per token, -1 slots skipped        | store_kvcache       |
| paged_attention | decode_attention.py when every sequence has one new query:       | paged_attention     |
|                 |   <= 512-token context chunks + merge, a GQA group per program   |                     |
|                 | prefill_attention.py otherwise: causal over cached prefix+chunk  |                     |
| rms_norm        | rmsnorm.py: fused residual add, fp32 statistics                  | rms_norm            |
| rotary          | rotary.py: neox style, q and k in one launch                     | rotary              |
| qkv_rope_store  | qkv_rope_store.py: from the fused qkv output, q/k norm (Qwen3),  | qkv_rope_store      |
|                 |   rotary and the k/v store in one launch (what the model calls)  |                     |
| silu_and_mul    | activation.py                                                    | silu_and_mul        |
| lora_apply      | lora.py: BGMV shrink + expand, a row's own adapter slot per program | lora_apply:      |
|                 |   (rows grouped by slot once a step: lora_rows.py)               | runs in place +  |
|                 |                                                                  | segmented bmm    |
Not dispatched here: on CPU in float32 the model's projections and lm_head are swapped at load for
cpu_linear.py's oneDNN-prepacked GEMMs (kvgate/bench/cpu_linear.py times them against F.linear).
Shared: paged_kv.py (KV gather through block tables, online softmax), config.py (tiles, warps,
stages per GPU generation and dtype; steps down if shared memory runs out), bench.py (timings).

Verified on CPU (`pytest tests/kernels`, TRITON_INTERPRET=1, ~20 s): every kernel against its twin
in float32 (norm/activation/store also fp16) on small shapes: GQA groups 1/3/7, ragged and
page-boundary lengths, -1 slots and block-table padding, 1..8 decode splits with empty splits,
lengths across 512-token decode chunk edges, more chunks than splits (strided),
zero-context padding rows, cached prefixes, chunks beside decode rows, head size 24, strided
per-layer cache views; qkv_rope_store in fp32 and bf16 (within the interpreter's truncating bf16
casts) for the Qwen2.5/Qwen3/Llama head layouts with -1 slots, and a decode layer through it equal
to the twins' layer; this dispatch; the config fallback; `python -m kvgate.bench.kernels --tiny`.
Owed on a GPU: tests/kernels/test_kernel_gpu.py (compiled; bf16, fp16, fp32; Qwen2.5/Qwen3/Llama
head layouts, pages 16/256, contexts to 4096, CUDA-graph replay), qkv_rope_store's bf16 bit-level
test, and `python -m kvgate.bench.kernels` (time vs the twin, GB/s vs a same-run copy).

Dispatch: KVGATE_KERNELS=triton forces the kernels (with TRITON_INTERPRET=1 they run on CPU),
KVGATE_KERNELS=reference forces the twins; unset, CUDA tensors take Triton when it imports.
The decode choice needs no host sync: each scheduled sequence has at least one new query, so
"one query each" is exactly "as many query rows as sequences".
"""
from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

import torch

from kvgate.kernels import reference
from kvgate.kernels.lora_rows import LoraRows

__all__ = ["store_kvcache", "paged_attention", "rms_norm", "rotary", "qkv_rope_store", "silu_and_mul", "lora_apply"]


@lru_cache(maxsize=1)
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    forced = os.environ.get("KVGATE_KERNELS", "")
    if forced == "reference":
        return False
    if forced == "triton":
        return True
    return t.is_cuda and _triton_importable()


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    if not use_triton(key):
        return reference.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    from kvgate.kernels.store_kvcache import store_kvcache as kernel
    kernel(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    if not use_triton(q):
        return reference.paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)
    if q.shape[0] == cu_seqlens_q.numel() - 1:
        from kvgate.kernels.decode_attention import decode_attention as kernel
    else:
        from kvgate.kernels.prefill_attention import prefill_attention as kernel
    return kernel(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not use_triton(x):
        return reference.rms_norm(x, weight, eps, residual)
    from kvgate.kernels.rmsnorm import rms_norm as kernel
    return kernel(x, weight, eps, residual)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(q):
        return reference.rotary(q, k, cos, sin)
    from kvgate.kernels.rotary import rotary as kernel
    return kernel(q, k, cos, sin)


def qkv_rope_store(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 0.0
                   ) -> torch.Tensor:
    if not use_triton(qkv):
        return reference.qkv_rope_store(qkv, num_heads, num_kv_heads, head_dim, cos, sin, k_cache, v_cache,
                                        slot_mapping, q_norm, k_norm, eps)
    from kvgate.kernels.qkv_rope_store import qkv_rope_store as kernel
    return kernel(qkv, num_heads, num_kv_heads, head_dim, cos, sin, k_cache, v_cache, slot_mapping, q_norm, k_norm, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if not use_triton(x):
        return reference.silu_and_mul(x)
    from kvgate.kernels.activation import silu_and_mul as kernel
    return kernel(x)


def lora_apply(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor], offsets: list[int],
               rows: LoraRows) -> torch.Tensor:
    if not use_triton(x):
        return reference.lora_apply(y, x, a, bs, offsets, rows)
    from kvgate.kernels.lora import lora_apply as kernel
    return kernel(y, x, a, bs, offsets, rows)
