"""q/k norm + rotary + KV store in one kernel against reference.qkv_rope_store, for the benchmarks' head layouts."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_testing import DEVICE, HAS_CUDA, assert_close
from tests.kernels.test_kernel_rotary import cos_sin
from kvgate.kernels import reference
from kvgate.kernels.qkv_rope_store import qkv_rope_store

# (q heads, kv heads, head dim, q/k norm): qwen2.5-0.5b, qwen3-0.6b, llama-3.2-1b
LAYOUTS = {"qwen2.5-0.5b": (14, 2, 64, False), "qwen3-0.6b": (16, 8, 128, True), "llama-3.2-1b": (32, 8, 64, False)}
# bf16 rounds q/k at three points (norm, weight, rotation); the interpreter truncates each (an ulp apart)
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}


def case(layout: str, dtype: torch.dtype, slots: list[int], page_size: int = 16, num_blocks: int = 4, seed: int = 0):
    """A fused projection output inside a wider buffer (its row stride is not its width), per-layer views of one
    [k/v, layer, block, page, head, dim] cache, positions and slots; -1 slots are padding."""
    num_heads, num_kv_heads, head_dim, norm = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(len(slots), width + 8, generator=gen) * 3).to(dtype).to(DEVICE)[:, :width]
    weights = [(torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(DEVICE) for _ in range(2)] if norm else [None] * 2
    cache = torch.full((2, 2, num_blocks, page_size, num_kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)
    positions = torch.randint(0, 4096, (len(slots),), generator=gen).to(DEVICE)
    cos, sin = cos_sin(positions, head_dim)
    args = (qkv, num_heads, num_kv_heads, head_dim, cos, sin)
    return args, cache, torch.tensor(slots, dtype=torch.int64, device=DEVICE), (*weights, 1e-6)


def run_both(layout: str, dtype: torch.dtype, slots: list[int]):
    args, cache, slot_mapping, norm = case(layout, dtype, slots)
    expected_cache = cache.clone()
    q = qkv_rope_store(*args, cache[0, 1], cache[1, 1], slot_mapping, *norm)
    q_expected = reference.qkv_rope_store(*args, expected_cache[0, 1], expected_cache[1, 1], slot_mapping, *norm)
    return q, q_expected, cache, expected_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_qkv_rope_store_equals_the_twin_with_padding_slots(layout, dtype):
    slots = [0, 17, -1, 16, 63, -1, 5]  # odd count, two padding tokens, a page edge (15 | 16)
    q, q_expected, cache, expected_cache = run_both(layout, dtype, slots)
    assert q.shape == q_expected.shape and q.dtype == dtype and q.is_contiguous()
    assert_close(q, q_expected, **TOLERANCE[dtype])
    assert_close(cache[0], expected_cache[0], **TOLERANCE[dtype])  # rotated (and normed) k
    assert torch.equal(cache[1], expected_cache[1])  # v is copied, never rounded twice
    stored = torch.tensor([s for s in slots if s >= 0])
    untouched = torch.ones(cache[0, 1].shape[0] * cache[0, 1].shape[1], dtype=torch.bool)
    untouched[stored] = False
    assert (cache[:, 1].flatten(1, 2)[:, untouched.to(DEVICE)] == 7.0).all()  # padding and other slots
    assert (cache[:, 0] == 7.0).all()  # the other layer's view


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="Triton 3.9's interpreter truncates fp32 -> bf16 casts (half of them differ "
                    "from torch's round-to-nearest by an ulp, in every kernel): bit-level agreement needs a GPU")
def test_fused_qkv_rope_store_in_bf16_mostly_matches_the_twin_bit_for_bit():
    q, q_expected, cache, expected_cache = run_both("qwen3-0.6b", torch.bfloat16, [3, 9, -1, 40, 2])
    assert (q == q_expected).float().mean() > 0.99
    assert (cache[0] == expected_cache[0]).float().mean() > 0.99


def test_fused_qkv_rope_store_of_no_tokens_returns_an_empty_q_and_stores_nothing():
    q, q_expected, cache, expected_cache = run_both("llama-3.2-1b", torch.float32, [])
    assert q.shape == q_expected.shape == (0, 32, 64)
    assert torch.equal(cache, expected_cache)


def test_fused_qkv_rope_store_refuses_a_norm_weight_without_its_pair():
    args, cache, slot_mapping, (q_norm, _, eps) = case("qwen3-0.6b", torch.float32, [1])
    with pytest.raises(AssertionError, match="pair"):
        qkv_rope_store(*args, cache[0, 0], cache[1, 0], slot_mapping, q_norm, None, eps)


COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvgate.kernels.qkv_rope_store import _qkv_rope_store_kernel as fn

POINTERS = dict(qkv_ptr="*bf16", q_norm_ptr="*bf16", k_norm_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32",
                q_out_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", slot_mapping_ptr="*i64")
done = []
for heads, kv_heads, half, norm in json.loads(sys.argv[1]):
    consts = dict(HAS_NORM=norm, PAGE_SIZE=16, BLOCK_HQ=heads, BLOCK_HK=kv_heads, BLOCK_HALF=half)
    signature = {a: POINTERS.get(a, "constexpr" if a in consts else "fp32" if a == "eps" else "i32")
                 for a in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    done.append(sorted(triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm))
print(json.dumps(done))
"""


def test_the_fused_kernel_compiles_for_hopper_in_each_layout_without_a_gpu():
    """The interpreter runs Python that the compiler refuses (a variable given another shape inside an `if`): so
    compile to a Hopper cubin (H100/H200), which needs no GPU, in a process without TRITON_INTERPRET."""
    import json
    import os
    import subprocess
    import sys

    from tests.support import ROOT

    blocks = [[16, 2, 32, False], [16, 8, 64, True], [32, 8, 32, False]]  # LAYOUTS' heads and halves, padded
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(blocks)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all("cubin" in stages for stages in json.loads(done.stdout.splitlines()[-1]))
