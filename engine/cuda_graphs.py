"""CUDA graphs for decode-only steps: the eager forward of a small model is mostly Python launching kernels.

One set of static input buffers, sized to the largest captured batch and to max_model_len's blocks, is shared by
one graph per batch-size bucket (1, 2, 4, 8, then every 16 up to max_num_seqs). A step of n sequences replays
the smallest bucket >= n: its first n rows hold the step's inputs, the rest are padding rows the kernels skip
(slot -1: nothing stored; context 0: attention returns zeros). Prefill and mixed steps run eagerly.

On a CPU the same plan runs with `replay` re-running the model eagerly over the static buffers, so tests check the
buckets, the padding and the buffer reuse with the torch twins; only `capture` on CUDA records a real graph."""
from __future__ import annotations

from collections.abc import Callable

import torch

from kvgate.engine.models import AttentionMetadata, LlamaForCausalLM


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
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
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

    def _capture(self, size: int) -> Callable[[], torch.Tensor]:
        ids, positions = self.input_ids[:size], self.positions[:size]
        meta = AttentionMetadata(self.slot_mapping[:size], self.block_tables[:size], self.cu_seqlens_q[:size + 1],
                                 self.context_lens[:size])
        if self.device.type != "cuda":
            return lambda: self.model(ids, positions, meta)
        self.model(ids, positions, meta)  # warm-up: Triton compiles and the allocator settles outside the graph
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.model(ids, positions, meta)
        self._pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return replay

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states of a decode-only step [n, hidden] by replaying its bucket; None when no bucket fits."""
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
        return self.replays[size]()[:n]
