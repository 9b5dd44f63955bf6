"""What computes the engine's scheduled batches: the torch ModelRunner for a real model, a CostModelRunner for the
simulated fleet. A runner that can also launch a decode-only batch (scheduler.AllDecode) without waiting for its
tokens has `launch(batch)`, returning an engine.overlap.Launched (ModelRunner does). Torch-free: the protocol only."""
from __future__ import annotations

from typing import Any, Protocol

from kvgate.engine.scheduler import ScheduledBatch
from kvgate.engine.sequence import Sequence


class Runner(Protocol):
    """What computes a scheduled batch, and the facts about its model the engine needs."""
    model_name: str
    tokenizer: Any  # None: the engine takes token ids only
    vocab_size: int
    max_model_len: int
    eos_token_ids: set[int]
    num_blocks: int  # KV cache blocks of the engine's block_size
    embedding_size: int  # the length of an embedding request's vector before `dimensions` cuts it
    pooling: str  # the model's own pooling (last, mean, cls): what an embedding request's `model` pooling means
    lora: Any  # the model's LoRA adapter layers (engine/lora_layers.py); None: it serves no adapters
    launch_device: str | None  # where `launch` computes a decode step ahead ("cuda", "cpu"); None: it cannot

    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list[dict[int, float] | None]]:
        """Compute each (sequence, n) chunk; a next token (and logprobs) for each sequence now fully computed."""
        ...
