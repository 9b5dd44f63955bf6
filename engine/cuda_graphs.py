"""CUDA graphs for decode-only steps: the eager forward of a small model is mostly Python launching kernels.

One set of static input buffers, sized to the largest captured batch and to max_model_len's blocks, is shared by
one graph per batch-size bucket (1, 2, 4, 8, then every 16 up to max_num_seqs). A step of n sequences replays
the smallest bucket >= n: its first n rows hold the step's inputs, the rest are padding rows the kernels skip
(slot -1: nothing stored; context 0: attention returns zeros). Prefill and mixed steps run eagerly.

Each graph computes, after the hidden states, the logits in the model's dtype and their argmax (`logits_and_argmax`):
a batch whose every row is plain greedy (SamplingBatch.plain_greedy) takes the tokens and never casts the [B, vocab]
logits to float32; any other batch casts the graph's logits for the sampler, as the eager path does. One graph per
bucket serves both: a second graph per bucket without the logits would double capture time and graph memory to
save a non-greedy batch one argmax, a read of bf16 logits a third of the cast's traffic. The argmax of bf16 logits
is the argmax of their float32 cast (it widens exactly; both take the first maximum on ties), so greedy tokens are
the eager path's bit for bit.

On a CPU the same plan runs with `replay` re-running the model eagerly over the static buffers, so tests check the
buckets, the padding and the buffer reuse with the torch twins; only `capture` on CUDA records a real graph."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from kvgate.engine.models import AttentionMetadata, LlamaForCausalLM
from kvgate.engine.sampler import argmax_rows


class DecodeOutput(NamedTuple):
    """A decode step's outputs [n, ...]: views of a graph's static buffers, valid until its next replay."""
    hidden: torch.Tensor
    logits: torch.Tensor  # in the model's dtype
    tokens: torch.Tensor  # each row's argmax of `logits` (int64)


def logits_and_argmax(model: LlamaForCausalLM, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a decode graph computes after the model: logits in the model's dtype and each row's first maximum."""
    logits = model.logits(hidden)
    return logits, argmax_rows(logits)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device) -> None:
        self.model, self.device = model, device
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, max_blocks_per_seq), -1, dtype=torch.int32, device=device)
        self.replays: dict[int, Callable[[], DecodeOutput]] = {}
        self.replayed: dict[int, int] = {size: 0 for size in self.sizes}  # steps per bucket, for stats and tests
        self._pool = None

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    def bucket(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, so the smaller graphs reuse its memory pool."""
        for size in reversed(self.sizes):
            self.replays[size] = self._capture(size)

    def _capture(self, size: int) -> Callable[[], DecodeOutput]:
        ids, positions = self.input_ids[:size], self.positions[:size]
        meta = AttentionMetadata(self.slot_mapping[:size], self.block_tables[:size], self.cu_seqlens_q[:size + 1],
                                 self.context_lens[:size])

        def step() -> DecodeOutput:
            hidden = self.model(ids, positions, meta)
            return DecodeOutput(hidden, *logits_and_argmax(self.model, hidden))

        if self.device.type != "cuda":
            return step
        step()  # warm-up: Triton compiles and the allocator settles outside the graph
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = step()
        self._pool = graph.pool()

        def replay() -> DecodeOutput:
            graph.replay()
            return out
        return replay

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> DecodeOutput | None:
        """A decode-only step's outputs by replaying its bucket; None when no bucket fits."""
        n = input_ids.shape[0]
        size = self.bucket(n)
        if size is None or size not in self.replays or meta.block_tables.shape[1] > self.max_blocks:
            return None
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.context_lens[:n].copy_(meta.context_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.block_tables[:n, width:] = -1
        self.slot_mapping[n:size] = -1  # padding rows: store nothing, attend to nothing
        self.context_lens[n:size] = 0
        self.replayed[size] += 1
        return DecodeOutput(*(t[:n] for t in self.replays[size]()))
