"""The kernels one decode layer launches, listed by running it: each Triton launch by its kernel's name, each torch
op that computes (a GEMM, a copy, a cast) by its aten name; views and allocations launch nothing and are left out.

    python -m kvgate.bench.decode_kernels [--models qwen2.5-0.5b,...] [--json PATH]   # on a GPU: the real path
    python -m kvgate.bench.decode_kernels --tiny   # no GPU: Triton's interpreter, the same dispatch as on a GPU

From Python: decode_layer_kernels(layer) for one layer, decode_model_kernels(runner.model) for a whole step of an
engine's model (embedding, rope rows, layers, final norm, logits). Derived from the code path, not timed: one aten
op is counted as one launch (cuBLAS may add a split-K reduce, which only torch.profiler sees), so `make gpu-profile`
prints this beside the profiler's kernels per step. On a CPU main forces KVGATE_KERNELS=triton so ops take the
branch CUDA tensors take (callers of decode_layer_kernels set it themselves).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import Counter
from types import SimpleNamespace
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvgate.bench.kernels import MODELS, TINY

ALLOCATIONS = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "_unsafe_view")
SYNCS = ("item", "_local_scalar_dense")  # .item(): a device sync inside the step, which graphs forbid


def _is_tensor(t) -> bool:
    return isinstance(t, torch.TensorType) or isinstance(t, torch.ListType) and _is_tensor(t.getElementType())


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _to_host(args, out) -> bool:
    return (isinstance(out, torch.Tensor) and out.device.type == "cpu" and bool(args)
            and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu")


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.launches: list[str] = []
        self.in_triton = 0  # the interpreter's own tensor copies inside a Triton launch are not the model's ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        out = func(*args, **(kwargs or {}))
        if self.in_triton:
            return out
        if name in SYNCS:
            self.launches.append("sync:" + name)
        elif func.is_view:  # reshape/contiguous may alias or copy (inference mode dispatches them whole)
            if isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor) and not _aliases(out, args[0]):
                self.launches.append(f"aten.{name}(copy)")
        elif _to_host(args, out):  # .tolist() or .cpu() of a device tensor: a copy and a sync
            self.launches.append("sync:" + name)
        elif any(_is_tensor(r.type) for r in func._schema.returns) and name not in ALLOCATIONS:
            self.launches.append("aten." + name)  # not promote_types (returns a dtype), not a view
        return out


@contextlib.contextmanager
def recording():
    """Yields the list every kernel launch inside the block is appended to, in order."""
    from triton.runtime.jit import KernelInterface

    recorder, launch = _Recorder(), KernelInterface.__getitem__

    def traced(kernel, grid):
        run = launch(kernel, grid)

        def call(*args, **kwargs):
            recorder.launches.append("triton." + kernel.__name__)
            recorder.in_triton += 1
            try:
                return run(*args, **kwargs)
            finally:
                recorder.in_triton -= 1
        return call

    KernelInterface.__getitem__ = traced
    try:
        with recorder:
            yield recorder.launches
    finally:
        KernelInterface.__getitem__ = launch


def layer_config(model_type: str, dims: tuple[int, int, int, int, int], bias: bool = False) -> SimpleNamespace:
    """What engine.models.llama reads from a config to build one layer, from kernels.py's MODELS dims."""
    heads, kv_heads, head_dim, hidden, inner = dims
    return SimpleNamespace(model_type=model_type, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           head_dim=head_dim, hidden_size=hidden, intermediate_size=inner, rms_norm_eps=1e-6,
                           attention_bias=bias)


MODEL_TYPES = {"qwen2.5-0.5b": "qwen2", "qwen3-0.6b": "qwen3", "llama-3.2-1b": "llama"}


def random_layer(config, dtype: torch.dtype, device: torch.device):
    from kvgate.engine.models.llama import DecoderLayer

    with torch.device(device):
        layer = DecoderLayer(config).to(dtype)
    for p in layer.parameters():
        p.data.normal_(0, 0.02)
    return layer.eval().requires_grad_(False)


def decode_step(layer, batch: int, context: int, seed: int = 0) -> tuple:
    """Inputs (x, residual, cos, sin, meta) of one decode step of `layer` over the cache bound to it: `batch`
    sequences of `context` cached tokens including the new one, sequence i in blocks [i * n, (i + 1) * n)."""
    from kvgate.engine.models.llama import AttentionMetadata

    attn, weight = layer.self_attn, layer.input_layernorm.weight
    device, dtype, hidden = weight.device, weight.dtype, weight.shape[0]
    page_size = attn.k_cache.shape[1]
    blocks = -(-context // page_size)
    if attn.k_cache.shape[0] < batch * blocks:
        raise ValueError(f"the layer's cache has {attn.k_cache.shape[0]} blocks; {batch} sequences of {context} "
                         f"tokens need {batch * blocks}: lower batch or context")
    tables = torch.arange(batch * blocks, dtype=torch.int32, device=device).view(batch, blocks)
    last = context - 1
    meta = AttentionMetadata(
        slot_mapping=tables[:, last // page_size].long() * page_size + last % page_size,
        block_tables=tables, cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=device),
        context_lens=torch.full((batch,), context, dtype=torch.int32, device=device))
    gen = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(batch, hidden, generator=gen).to(device, dtype) for _ in range(2))
    angles = torch.rand(batch, attn.head_dim // 2, generator=gen).to(device) * 100
    return x, residual, angles.cos(), angles.sin(), meta


def bind_cache(layer, num_blocks: int, page_size: int = 16) -> None:
    """A zeroed [k/v, block, page, head, dim] cache for a layer built outside an engine."""
    attn, weight = layer.self_attn, layer.input_layernorm.weight
    cache = torch.zeros(2, num_blocks, page_size, attn.num_kv_heads, attn.head_dim, dtype=weight.dtype,
                        device=weight.device)
    attn.k_cache, attn.v_cache = cache[0], cache[1]


def decode_layer_kernels(layer, batch: int = 4, context: int = 40) -> list[str]:
    """Launches of one decode step of `layer` (an engine.models.llama.DecoderLayer) after a previous layer (its
    input norm adds a residual); a layer bound to no cache gets one for the step."""
    attn = layer.self_attn
    saved = attn.k_cache, attn.v_cache
    if attn.k_cache.numel() == 0:
        bind_cache(layer, batch * -(-context // 16))
    try:
        inputs = decode_step(layer, batch, context)
        with torch.inference_mode(), recording() as launches:
            layer(*inputs)
    finally:
        attn.k_cache, attn.v_cache = saved
    return launches


def decode_model_kernels(model, batch: int = 4, context: int = 40, greedy: bool = False) -> list[str]:
    """Launches of one whole decode step of `model` (an engine.models.llama.LlamaForCausalLM with an engine's cache
    bound, e.g. ModelRunner.model): embedding, rope rows, every layer, the final norm and the logits in the model's
    dtype, as the sampler takes them (it widens only the rows that sample; sampling is not in it); `greedy`: a
    plain-greedy batch's step instead, whose graph ends in their argmax too (engine/cuda_graphs.py). Run eagerly: a
    captured CUDA graph replays the same kernels."""
    from kvgate.engine.cuda_graphs import logits_and_argmax

    first = model.model.layers[0]
    if first.self_attn.k_cache.numel() == 0:
        raise ValueError("the model has no KV cache bound: pass an engine's model (ModelRunner.allocate_kv_cache)")
    meta = decode_step(first, batch, context)[-1]
    device = first.input_layernorm.weight.device
    ids = torch.zeros(batch, dtype=torch.long, device=device)
    positions = torch.full((batch,), context - 1, dtype=torch.long, device=device)
    with torch.inference_mode(), recording() as launches:
        hidden = model(ids, positions, meta)
        logits_and_argmax(model, hidden) if greedy else model.logits(hidden)
    return launches


def summary(launches: list[str]) -> dict:
    syncs = sum(n.startswith("sync:") for n in launches)
    return {"kernels": len(launches) - syncs, "syncs": syncs, "launches": launches, "by_name": dict(Counter(launches))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--tiny", action="store_true", help="tiny hidden sizes; on CPU in the Triton interpreter")
    parser.add_argument("--batch", type=int, default=256, help="decode sequences (--tiny: 4)")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per sequence (--tiny: 40); past "
                        "one decode chunk attention is a split and a reduce kernel")
    parser.add_argument("--json", help="write the lists here")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if not cuda and not args.tiny:
        parser.error("no CUDA GPU: run with --tiny to list the same launches in the interpreter")
    if not cuda:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("no CUDA GPU and triton is imported without TRITON_INTERPRET=1: run it as its own process")
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import; ops then dispatch as on a GPU
        from kvgate.bench.triton_interpreter import squeeze_scalar_index

        squeeze_scalar_index()  # Triton 3.6's interpreter with numpy >= 2.5: see there
        dtype = torch.float32  # the interpreter's bf16 casts truncate; launches are the same in every dtype
    device = torch.device("cuda" if cuda else "cpu")
    out = {}
    # on a CPU, the dispatch CUDA tensors take unforced (in the interpreter); restored after, for a caller's process
    forced = {} if cuda else {"KVGATE_KERNELS": "triton"}
    with mock.patch.dict(os.environ, forced):
        for model in args.models.split(","):
            dims = MODELS[model]
            if args.tiny:
                dims = (*dims[:3], *TINY[3:])
            layer = random_layer(layer_config(MODEL_TYPES[model], dims), dtype, device)
            batch, context = (4, 40) if args.tiny else (args.batch, args.context)
            out[model] = summary(decode_layer_kernels(layer, batch, context))
            print(f"{model}: {out[model]['kernels']} kernels per decode layer: {' '.join(out[model]['launches'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
