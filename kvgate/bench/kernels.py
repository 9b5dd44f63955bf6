"""Kernel micro-benchmark: each Triton kernel against its reference twin on model-sized shapes, with
achieved memory bandwidth next to a device-to-device copy measured in the same run.

    python -m kvgate.bench.kernels [--models qwen2.5-0.5b,qwen3-0.6b,llama-3.2-1b] [--dtype bf16] [--json PATH]
    python -m kvgate.bench.kernels --tiny   # no GPU: tiny shapes in the Triton interpreter, checks the script only

Bytes are the minimum a kernel must move (inputs read once, outputs written once), so GB/s is a lower
bound on what the kernel achieves and comparable with the copy's figure.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

MODELS = {  # heads, kv heads, head dim, hidden, intermediate (the W-GPU configs)
    "qwen2.5-0.5b": (14, 2, 64, 896, 4864),
    "qwen3-0.6b": (16, 8, 128, 1024, 3072),
    "llama-3.2-1b": (32, 8, 64, 2048, 8192),
}
TINY = (4, 2, 16, 64, 96)


@dataclass(slots=True)
class Result:
    model: str
    kernel: str
    shape: str
    triton_ms: float
    reference_ms: float
    speedup: float
    triton_gbps: float
    max_abs_diff: float
    launch: str = ""  # decode: its split count x chunk (context tokens per program), the figures issue 41 tunes


def timer(cuda: bool) -> Callable[[Callable[[], object]], float]:
    if cuda:
        import triton.testing
        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50)

    def cpu_time(fn: Callable[[], object]) -> float:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return cpu_time


def diff(a, b) -> float:
    if isinstance(a, tuple):
        return max(diff(x, y) for x, y in zip(a, b) if x is not None)
    return (a.float() - b.float()).abs().max().item()


def attention_inputs(torch, q_lens, context, heads, page_size, dtype, device, table_tokens=0):
    """table_tokens: pad the block table to this many tokens' pages, as the engine's graphs pad to max_model_len."""
    num_heads, num_kv_heads, head_dim = heads
    blocks = [(c + page_size - 1) // page_size for c in context]
    k_cache = torch.randn(sum(blocks), page_size, num_kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(sum(blocks)).tolist()
    width = max(*blocks, (table_tokens + page_size - 1) // page_size)
    table = torch.full((len(context), width), -1, dtype=torch.int32)
    for i, n in enumerate(blocks):
        table[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=device, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    ctx = torch.tensor(context, dtype=torch.int32, device=device)
    return (q, k_cache, v_cache, table.to(device), cu, ctx, head_dim ** -0.5)


def cases(torch, dims, tiny: bool, dtype, device):
    """(kernel, shape label, triton fn, reference fn, bytes moved, launch note) for one model's dimensions."""
    from kvgate.kernels import reference
    from kvgate.kernels.activation import silu_and_mul
    from kvgate.kernels.decode_attention import decode_attention, decode_splits
    from kvgate.kernels.prefill_attention import prefill_attention
    from kvgate.kernels.rmsnorm import rms_norm
    from kvgate.kernels.rotary import rotary
    from kvgate.kernels.store_kvcache import store_kvcache

    num_heads, num_kv_heads, head_dim, hidden, inner = dims
    heads = (num_heads, num_kv_heads, head_dim)
    size = torch.tensor([], dtype=dtype).element_size()
    rng = random.Random(0)
    page = 8 if tiny else 256
    n = 16 if tiny else 4096
    kv_token_bytes = 2 * num_kv_heads * head_dim * size

    key = torch.randn(n, num_kv_heads, head_dim, device=device, dtype=dtype)
    k_cache = torch.zeros(n // page + 1, page, num_kv_heads, head_dim, device=device, dtype=dtype)
    v_cache, slots = torch.zeros_like(k_cache), torch.randperm(n, device=device)
    yield ("store_kvcache", f"N={n}", lambda: store_kvcache(key, key, k_cache, v_cache, slots),
           lambda: reference.store_kvcache(key, key, k_cache, v_cache, slots), 2 * n * kv_token_bytes, "")

    # the last row's table is as wide as a 32k max_model_len engine's captured graphs make it: more splits, most empty
    decode_shapes = ([(4, 40, 0), (2, 120, 0), (4, 40, 1100)] if tiny else
                     [(256, (100, 2048), 0), (8, (8192, 8192), 0), (256, (100, 2048), 32768)])
    for batch, span, table in decode_shapes:
        lo, hi = span if isinstance(span, tuple) else (1, span)
        context = [rng.randint(lo, hi) for _ in range(batch)]
        args = attention_inputs(torch, [1] * batch, context, heads, page, dtype, device, table)
        splits = decode_splits(args[0], args[1], args[3])
        label = f"B={batch} ctx={lo}..{hi}" + (f" table={table}" if table else "")
        yield ("decode_attention", label, lambda a=args: decode_attention(*a),
               lambda a=args: reference.paged_attention(*a), sum(context) * kv_token_bytes,
               f"{splits.num_splits}x{splits.chunk}")

    prefill_shapes = [([8, 8], [8, 20])] if tiny else [([1024] * 4, [1024] * 4), ([512] + [1] * 64, [2048] + [1024] * 64)]
    for q_lens, context in prefill_shapes:
        args = attention_inputs(torch, q_lens, context, heads, page, dtype, device)
        label = f"q={q_lens[0]}x{q_lens.count(q_lens[0])}+{len(q_lens) - q_lens.count(q_lens[0])} ctx<= {max(context)}"
        yield ("prefill_attention", label, lambda a=args: prefill_attention(*a),
               lambda a=args: reference.paged_attention(*a),
               sum(context) * kv_token_bytes + 2 * sum(q_lens) * num_heads * head_dim * size, "")

    x, r = torch.randn(n, hidden, device=device, dtype=dtype), torch.randn(n, hidden, device=device, dtype=dtype)
    w = torch.ones(hidden, device=device, dtype=dtype)
    yield ("rms_norm+residual", f"N={n} hidden={hidden}", lambda: rms_norm(x, w, 1e-6, r),
           lambda: reference.rms_norm(x, w, 1e-6, r), 4 * n * hidden * size, "")

    q = torch.randn(n, num_heads, head_dim, device=device, dtype=dtype)
    cos, sin = torch.rand(n, head_dim // 2, device=device), torch.rand(n, head_dim // 2, device=device)
    yield ("rotary", f"N={n} H={num_heads}/{num_kv_heads} D={head_dim}", lambda: rotary(q, key, cos, sin),
           lambda: reference.rotary(q, key, cos, sin),
           2 * n * (num_heads + num_kv_heads) * head_dim * size + n * head_dim * 4, "")

    # decode-sized: what one layer's step runs between the qkv GEMM and attention, Qwen3's q/k norm included
    from kvgate.kernels.qkv_rope_store import qkv_rope_store
    b = 4 if tiny else 256
    qkv = torch.randn(b, (num_heads + 2 * num_kv_heads) * head_dim, device=device, dtype=dtype)
    norm = (torch.ones(head_dim, device=device, dtype=dtype),) * 2 + (1e-6,)
    fused = (qkv, num_heads, num_kv_heads, head_dim, cos[:b], sin[:b], k_cache, v_cache, slots[:b], *norm)
    yield ("qkv_rope_store", f"B={b} H={num_heads}/{num_kv_heads} D={head_dim}", lambda: qkv_rope_store(*fused),
           lambda: reference.qkv_rope_store(*fused), b * (2 * qkv.shape[1] + 2 * num_kv_heads * head_dim) * size, "")

    gate_up = torch.randn(n, 2 * inner, device=device, dtype=dtype)
    yield ("silu_and_mul", f"N={n} I={inner}", lambda: silu_and_mul(gate_up),
           lambda: reference.silu_and_mul(gate_up), 3 * n * inner * size, "")


def copy_bandwidth(torch, device, tiny: bool, measure) -> float:
    src = torch.empty((1 << 16) if tiny else (1 << 29), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / measure(lambda: dst.copy_(src)) / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes; on CPU in the Triton interpreter")
    args = parser.parse_args(argv)
    if args.tiny and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import triton

    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        parser.error("no CUDA GPU: run with --tiny to check the script in the interpreter")
    device = "cuda" if cuda else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if not cuda:
        from kvgate.bench.triton_interpreter import squeeze_scalar_index

        squeeze_scalar_index()  # Triton 3.6's interpreter with numpy >= 2.5: see there
        dtype = torch.float32 if dtype == torch.bfloat16 else dtype  # the interpreter has no bf16 rounding
    measure = timer(cuda)
    machine = torch.cuda.get_device_name() if cuda else f"{platform.processor() or platform.machine()} (interpreter)"
    copy_gbps = copy_bandwidth(torch, device, args.tiny, measure)
    print(f"# {machine}  torch {torch.__version__}  triton {triton.__version__}  dtype {dtype}  "
          f"copy {copy_gbps:.0f} GB/s" + ("" if cuda else "  (CPU interpreter: times are meaningless)"))
    print(f"{'model':14} {'kernel':18} {'shape':34} {'triton ms':>10} {'ref ms':>10} {'speedup':>8} "
          f"{'GB/s':>8} {'%copy':>6} {'maxdiff':>8} {'splitsxchunk':>12}")
    results = []
    for model in args.models.split(","):
        dims = TINY if args.tiny else MODELS[model]
        for kernel, shape, fast, slow, nbytes, launch in cases(torch, dims, args.tiny, dtype, device):
            triton_ms, ref_ms = measure(fast), measure(slow)
            r = Result(model, kernel, shape, triton_ms, ref_ms, ref_ms / triton_ms, nbytes / triton_ms / 1e6,
                       diff(fast(), slow()) if kernel != "store_kvcache" else 0.0, launch)
            results.append(r)
            print(f"{model:14} {kernel:18} {shape:34} {triton_ms:10.4f} {ref_ms:10.4f} {r.speedup:8.1f} "
                  f"{r.triton_gbps:8.0f} {100 * r.triton_gbps / copy_gbps:6.1f} {r.max_abs_diff:8.2g} {launch:>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "torch": torch.__version__, "triton": triton.__version__,
                       "dtype": str(dtype), "copy_gbps": copy_gbps, "interpreter": not cuda,
                       "results": [asdict(r) for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
