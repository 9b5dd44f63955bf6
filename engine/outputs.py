"""What the engine hands back: per-step deltas for the worker, whole results for `LLM.generate`, and the
admission/stats snapshots. Torch-free so the worker and a simulated engine can import it cheaply."""
from __future__ import annotations

from dataclasses import dataclass, field


class RequestRejected(ValueError):
    """A request that can never be served as given (empty, too long, bad token ids, duplicate id...)."""


Logprobs = list[dict[int, float]]  # one dict per output token: chosen token and top alternatives
PromptLogprobs = list[dict[int, float] | None]  # one per prompt token, None for the first (nothing before it)


@dataclass(slots=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    token_ids: list[int] | None = None  # all output ids, only on finish
    text: str | None = None  # full output text, only on finish
    logprobs: Logprobs | None = None  # for new_token_ids, only when asked
    error: str | None = None  # finish_reason "error": why (its constraint did not compile, or its grammar engine
    # stopped in error while it generated: engine/constraints.py's matcher_error)
    prompt_logprobs: PromptLogprobs | None = None  # only on finish, when asked
    embedding: bytes | None = None  # an embedding request's vector, float32 little-endian (engine/pooler.py)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: Logprobs | None = None
    cached_tokens: int = 0
    error: str | None = None  # finish_reason "error": why it could not run
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """`LLM.embed`'s result for one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]


@dataclass(slots=True)
class Admission:
    free_seqs: int
    admissible_tokens: int
    block_size: int


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 16
    kv_usage: float = 0.0
    preemptions: int = 0
    stepped_aside: int = 0  # sequences preempted on purpose to start a newcomer (make_room), not counted above
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0  # prompt tokens of every admitted request
    prompt_tokens: int = 0  # prompt tokens actually computed (prefix-cache hits excluded)
    generation_tokens: int = 0
    extra: dict = field(default_factory=dict)
