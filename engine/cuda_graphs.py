"""CUDA graphs for decode-only steps: the eager forward of a small model is mostly Python launching kernels.

One set of static inputs, sized to the largest captured batch and to max_model_len's blocks, is shared by one
graph per batch-size bucket (1, 2, 4, 8, then every 16 up to max_num_seqs). They are views of one packed device
buffer (engine/graph_inputs.py) that a step fills with one host-to-device copy, written on the host by
DecodeInputs.build: a step of n sequences replays the smallest bucket >= n, its first n rows hold the step's
inputs and the rest are padding rows the kernels skip (slot -1: nothing stored; context 0: attention returns
zeros). No copy, fill or cast of the inputs runs on the device outside the graph. Prefill and mixed steps run
eagerly.

A row whose input token is still on the device (overlap, engine/overlap.py) takes it inside the graph from the
tokens the step before wrote (`prev`), and each replay writes its argmax into that same token buffer, where the
next step launched ahead finds it; a sampled step's sampler writes its tokens there instead (its `out`).

Each graph computes, after the hidden states, the logits in the model's dtype and their argmax (`logits_and_argmax`):
a batch whose every row is plain greedy (SamplingBatch.plain_greedy) takes the tokens and never casts the [B, vocab]
logits to float32; any other batch hands the graph's logits to the sampler as they are, as the eager path does, and
the sampler widens only the rows that need float32 (SamplingBatch.float32_rows). One graph per bucket serves both:
a second graph per bucket without the argmax would double capture time and graph memory to save a non-greedy batch
one read of its bf16 logits. The argmax of bf16 logits
is the argmax of their float32 cast (it widens exactly; both take the first maximum on ties), so greedy tokens are
the eager path's bit for bit.

On a CPU the same plan runs with `replay` re-running the model eagerly over the static buffers, so tests check the
buckets, the padding and the buffer reuse with the torch twins; only `capture` on CUDA records a real graph."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from kvgate.engine.decode_inputs import DecodeBatch
from kvgate.engine.graph_inputs import StaticInputs
from kvgate.engine.models import AttentionMetadata, LlamaForCausalLM
from kvgate.engine.sampler import argmax_rows


class DecodeOutput(NamedTuple):
    """A decode step's outputs [n, ...]: views of a graph's static buffers, valid until its next replay."""
    input_ids: torch.Tensor  # what the graph fed the model, tokens still on the device taken in
    hidden: torch.Tensor
    logits: torch.Tensor  # in the model's dtype
    tokens: torch.Tensor  # each row's argmax of `logits` (int64)


def logits_and_argmax(model: LlamaForCausalLM, hidden: torch.Tensor, out: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """What a decode graph computes after the model: logits in the model's dtype and each row's first maximum
    (into `out` when given)."""
    logits = model.logits(hidden)
    return logits, argmax_rows(logits, out)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, max_num_seqs: int, max_blocks_per_seq: int, tokens: torch.Tensor,
                 device: torch.device) -> None:
        """`tokens`: where each step's tokens are kept on the device in its row order (DecodeInputs.tokens)."""
        self.model, self.device, self.tokens = model, device, tokens
        self.sizes = capture_sizes(max_num_seqs)
        self.inputs = StaticInputs(self.sizes[-1], max_blocks_per_seq, device)
        self.replays: dict[int, Callable[[], DecodeOutput]] = {}
        self.replayed: dict[int, int] = {size: 0 for size in self.sizes}  # steps per bucket, for stats and tests
        self._pool = None

    def bucket(self, n: int) -> int | None:
        """The captured bucket a step of n sequences replays; None: none fits, the step runs eagerly."""
        size = next((s for s in self.sizes if s >= n), None)
        return size if size in self.replays else None

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, so the smaller graphs reuse its memory pool."""
        for size in reversed(self.sizes):
            self.replays[size] = self._capture(size)

    def _capture(self, size: int) -> Callable[[], DecodeOutput]:
        v = self.inputs.views
        prev, host_ids, positions = v.prev[:size], v.input_ids[:size], v.positions[:size]
        meta = AttentionMetadata(v.slot_mapping[:size], v.block_tables[:size], self.inputs.cu_seqlens_q[:size + 1],
                                 v.context_lens[:size])
        tokens = self.tokens[:size]

        def step() -> DecodeOutput:
            ids = torch.where(prev < 0, host_ids, self.tokens[prev])  # before this step's tokens overwrite them
            hidden = self.model(ids, positions, meta)
            return DecodeOutput(ids, hidden, *logits_and_argmax(self.model, hidden, out=tokens))

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

    def run(self, batch: DecodeBatch) -> DecodeOutput:
        """A decode-only step's outputs: its inputs are already in the static buffers (DecodeInputs.build wrote
        them for `batch.bucket`); one replay of that bucket computes them."""
        self.replayed[batch.bucket] += 1
        n = batch.input_ids.shape[0]
        return DecodeOutput(*(t[:n] for t in self.replays[batch.bucket]()))
