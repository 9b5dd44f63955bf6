"""The bound of one W-GPU run (shared/benchmarks.md): the least time any engine needs for the steps this one ran,

    T >= prefill FLOPs / peak + max((decode steps x weight bytes + KV bytes the decode steps read) / bandwidth,
                                    decode FLOPs / peak),

counted step by step from what the engine scheduled (a decode batch shrinks as its sequences finish, and each token
attends to its own context), with the copy bandwidth measured in the same run and the peak FLOP/s of the device.
A bound that assumed a full batch every step would credit steps the run never had and overstate the limit."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

# Dense (no sparsity) bf16/fp16 tensor-core peaks from NVIDIA's datasheets, which print the sparse figure: half of
# it. H100 SXM and H200: 1,979 -> 989 TFLOP/s; H100 NVL and H200 NVL: 1,671 -> 835; H100 PCIe: 1,513 -> 756;
# A100 / A800 (SXM and PCIe): 624 -> 312. First match in the device's name wins, so the specific names come first.
DENSE_BF16_PEAKS = (
    ("H200 NVL", 835e12), ("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),
    ("A100", 312e12), ("A800", 312e12),
)
TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(slots=True)
class StepFacts:
    """One engine step: its decode tokens with their summed context, its prefill (or recompute) tokens with the
    context each attends to summed, and how many of those end a prompt and are sampled (the head runs for them)."""
    decode_seqs: int = 0
    decode_context: int = 0
    prefill_tokens: int = 0
    prefill_context: int = 0
    prefill_sampled: int = 0


@dataclass(slots=True)
class StepTrace:
    """The steps a run actually ran, read off each scheduled batch as the runner receives it (before the engine
    moves the sequences on): owned by the benchmark, so the engine's hot path carries nothing for it."""
    steps: list[StepFacts] = field(default_factory=list)

    def record(self, batch) -> None:
        from kvgate.engine.scheduler import AllDecode

        if isinstance(batch, AllDecode):  # the common step: every sequence computes its last token
            seqs = batch.seqs
            self.steps.append(StepFacts(len(seqs), sum(s.num_computed_tokens for s in seqs) + len(seqs)))
            return
        facts = StepFacts()
        for seq, n in batch:
            done = seq.num_computed_tokens
            if n == 1 and done + 1 == seq.num_tokens:
                facts.decode_seqs += 1
                facts.decode_context += done + 1
            else:  # token i of the chunk attends to done + i + 1 positions
                facts.prefill_tokens += n
                facts.prefill_context += n * done + n * (n + 1) // 2
                facts.prefill_sampled += done + n == seq.num_tokens
        self.steps.append(facts)

    def wrap(self, run):
        """`run` (a runner's) recording each batch first; assign it over the runner's own."""
        def recorded(batch):
            self.record(batch)
            return run(batch)
        return recorded


@dataclass(slots=True, frozen=True)
class ModelCost:
    """What one token costs the model: FLOPs of its layers' linear weights (2 a parameter), of the head (for a
    sampled row only), of attention per position of context (4 x layers x heads x head_dim: QK^T and PV); bytes of
    the weights one step reads and of the K and V one position holds."""
    layer_linear_params: int
    head_params: int
    attention_flops_per_position: int
    weight_bytes: int
    kv_bytes_per_token: int

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> ModelCost:
        """From the checkpoint's parameters (loader.parameter_shapes: a tied head once, as the embedding) at the
        run's dtype; an untied embedding is left out of the bytes a step reads, as a step gathers only its rows."""
        from kvgate.engine.loader import parameter_shapes

        shapes = parameter_shapes(config)
        size = torch.empty((), dtype=dtype).element_size()
        numel = {name: _numel(shape) for name, shape in shapes.items()}
        embedding = next(n for name, n in numel.items() if name.endswith("embed_tokens.weight"))
        read = sum(numel.values()) - (0 if getattr(config, "tie_word_embeddings", False) else embedding)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layers = config.num_hidden_layers
        return cls(layer_linear_params=sum(n for name, n in numel.items()
                                           if ".layers." in name and len(shapes[name]) == 2),
                   head_params=config.vocab_size * config.hidden_size,
                   attention_flops_per_position=4 * layers * config.num_attention_heads * head_dim,
                   weight_bytes=read * size,
                   kv_bytes_per_token=2 * layers * config.num_key_value_heads * head_dim * size)


@dataclass(slots=True, frozen=True)
class DeviceLimits:
    bandwidth: float  # bytes/s, read plus write, of the best device-to-device copy
    peak_flops: float
    peak_source: str  # where the peak comes from: a datasheet row, or a measured matmul


@dataclass(slots=True, frozen=True)
class Bound:
    """The bound's terms in seconds; `binds` names the side of the max that sets it: "bandwidth" (weights and KV
    read) or "decode_flops"."""
    prefill_s: float
    weights_s: float
    kv_s: float
    decode_flop_s: float

    @property
    def bound_s(self) -> float:
        return self.prefill_s + max(self.weights_s + self.kv_s, self.decode_flop_s)

    @property
    def binds(self) -> str:
        return "bandwidth" if self.weights_s + self.kv_s >= self.decode_flop_s else "decode_flops"


def bound_of(trace: StepTrace, cost: ModelCost, limits: DeviceLimits) -> Bound:
    decode_steps = sum(1 for s in trace.steps if s.decode_seqs)
    decode_tokens = sum(s.decode_seqs for s in trace.steps)
    decode_context = sum(s.decode_context for s in trace.steps)
    linear = 2 * cost.layer_linear_params
    prefill_flops = sum(linear * s.prefill_tokens + 2 * cost.head_params * s.prefill_sampled
                        + cost.attention_flops_per_position * s.prefill_context for s in trace.steps)
    decode_flops = (linear + 2 * cost.head_params) * decode_tokens + cost.attention_flops_per_position * decode_context
    return Bound(prefill_s=prefill_flops / limits.peak_flops,
                 weights_s=decode_steps * cost.weight_bytes / limits.bandwidth,
                 kv_s=decode_context * cost.kv_bytes_per_token / limits.bandwidth,
                 decode_flop_s=decode_flops / limits.peak_flops)


def bound_entry(trace: StepTrace, cost: ModelCost, limits: DeviceLimits, output_tokens: int, elapsed_s: float) -> dict:
    """A round's figures beside its bound: tok/s, the bound as tok/s, the fraction reached, the binding side."""
    b = bound_of(trace, cost, limits)
    return {"bound_tok_s": output_tokens / b.bound_s, "fraction_of_bound": b.bound_s / elapsed_s, "binds": b.binds,
            "bound": {"bound_s": b.bound_s, "prefill_s": b.prefill_s, "weights_s": b.weights_s, "kv_s": b.kv_s,
                      "decode_flop_s": b.decode_flop_s, "steps": len(trace.steps),
                      "decode_steps": sum(1 for s in trace.steps if s.decode_seqs)}}


def device_limits(device: torch.device, dtype: torch.dtype) -> DeviceLimits:
    peak, source = peak_flops(device, dtype)
    return DeviceLimits(measure_copy_bandwidth(device), peak, source)


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The datasheet's dense peak for a known GPU at a tensor-core dtype; otherwise (an unknown GPU, float32, a
    CPU) the best of a few timed square matmuls, which is what the device reached, not its peak."""
    if device.type == "cuda" and dtype in TENSOR_CORE_DTYPES:
        name = torch.cuda.get_device_name(device)
        for key, flops in DENSE_BF16_PEAKS:
            if key in name:
                return flops, f"datasheet: {key} dense {dtype} tensor core"
    n = 4096 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = min(_timed(device, lambda: a @ b) for _ in range(6))
    return 2 * n**3 / best, f"measured: best of 6 {n}x{n} {dtype} matmuls"


def measure_copy_bandwidth(device: torch.device, repeats: int = 10) -> float:
    """Bytes per second of the best of `repeats` device-to-device copies, counting the read and the write, as
    decode pays both ways; each copy timed on its own (CUDA events on a GPU), so a stall in one is left out."""
    nbytes = 2**30 if device.type == "cuda" else 2**26
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # the first touch pays for the pages, not the copy
    best = min(_timed(device, lambda: dst.copy_(src)) for _ in range(repeats))
    del src, dst
    return 2 * nbytes / best


def _timed(device: torch.device, work) -> float:
    """Seconds of one call of `work` on `device`."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start_s = time.perf_counter()
    work()
    return time.perf_counter() - start_s


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
