"""One request's state inside the engine: its tokens, its KV blocks, how much of it is computed, its text."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from kvgate.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_seq_ids = itertools.count()


@dataclass(slots=True, eq=False)  # identity equality: sequences are keys of per-step dicts
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt then output
    params: SamplingParams
    max_tokens: int  # params.max_tokens clipped so the sequence fits max_model_len
    arrival_time: float = 0.0
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prefix-cache hit tokens at the first admission
    num_prefilled_tokens: int = 0  # prompt tokens counted as computed; recomputation after preemption is not
    admitted: bool = False  # has been scheduled at least once
    stepped_aside: int = 0  # times preempted on purpose to start another request first (make_room)
    ahead: bool = False  # made room for (make_room): joins the waiting queue at its head
    block_table: list[int] = field(default_factory=list)
    table_version: int = 0  # bumped whenever block_table is freed, so copies of it know they are stale
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks, filled lazily
    num_committed_blocks: int = 0  # leading blocks already registered in (or taken from) the prefix cache
    finish_reason: str | None = None
    stop_ids: frozenset[int] = frozenset()  # set by the engine: stop_token_ids, and EOS unless ignore_eos
    sample_seed: int | None = None  # the sampler's seed for this request: its own, or one drawn at first sample
    logprobs: list[dict[int, float]] | None = None
    # params.prompt_logprobs: one per prompt token (None for the first), written by the prefill; such a sequence
    # takes no prefix-cache hit, so every prompt position is computed (block_manager.match_prefix)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    matcher: Any = None  # structured output: the grammar's matcher, advanced with each accepted token
    # an embedding request (engine/pooling_params.py): no output; finished once its prompt is computed
    pooling: Any = None  # its PoolingParams, resolved against the model's own pooling
    pooled: Any = None  # the pooled value so far, while its prompt is computed in chunks (engine/pooler.py)
    embedding: bytes | None = None  # the finished vector, float32 little-endian
    # incremental detokenization (see engine.llm_engine.detokenize_increment)
    stream_text: bool = True
    detokenize: bool = True  # False: the caller turns the ids into text (engine.detokenizer)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""
    emitted: int = 0  # characters of `text` already handed out
    first_token_time: float | None = None
    # LoRA (engine/lora_slots.py): the adapter's name (None: the base model), its prefix-cache seed, its device slot
    lora: str | None = None
    lora_seed: int | None = None  # starts the chain of block hashes, so adapters never share a KV block
    lora_slot: int = -1  # set while running with an adapter

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        self.prefix_offset = self.read_offset = self.num_prompt_tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_prefilling(self) -> bool:
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def remaining_tokens(self) -> int:
        """Output tokens this sequence may still produce."""
        return self.max_tokens - self.num_output_tokens

    def stop_reason(self, token: int) -> str | None:
        """Why the sequence ends with `token`, just appended, or None; its grammar aside (engine/structured_state.py:
        a complete grammar ends it too)."""
        if token in self.stop_ids:
            return "stop"
        return "length" if self.num_output_tokens >= self.max_tokens else None

    def prefilled(self, n: int) -> int:
        """Of the `n` tokens about to be computed, the prompt tokens never counted before: each prompt token counts
        once, as prefix-cache hits are never computed and recomputation after a preemption is not new prompt work."""
        end = min(self.num_computed_tokens + n, self.num_prompt_tokens)
        start = max(self.num_computed_tokens, self.num_prefilled_tokens)
        if end <= start:
            return 0
        self.num_prefilled_tokens = end
        return end - start
