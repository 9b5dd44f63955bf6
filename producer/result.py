"""What a finished job looks like to the user."""
from __future__ import annotations

import array
import sys
from dataclasses import dataclass
from typing import Any

from .protocol import Final, FinishReason, Status, Timings, TokenLogprob, ToolCall, Usage


@dataclass(slots=True, frozen=True)
class Result:
    job_id: str
    status: Status  # done | error | expired | cancelled
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    error: str | None
    usage: Usage
    worker: str | None
    timings: Timings  # unix seconds: queued, admitted, first_token, finished
    metadata: dict[str, str] | None
    attempt: int = 1  # the delivery of the job that produced this result (2 and up after a redelivery)
    model: str | None = None  # the canonical name of the model that served it
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when submitted with logprobs=N
    max_model_len: int | None = None  # a tokenize job's: the serving worker's limit in tokens
    # submitted with prompt_logprobs=N: one per prompt token, the first with logprob NaN (nothing comes before it)
    prompt_logprobs: list[TokenLogprob] | None = None
    # submitted with response_format=<a pydantic model class>: the text validated into it (None: not done, or
    # cut off before the JSON closed: finish_reason "length"); `parse_error` says why it did not validate
    parsed: Any = None
    parse_error: str | None = None
    embedding: list[float] | None = None  # an embedding job's vector (task embed)
    # submitted with tools: the calls the answer makes (finish_reason "tool_calls" when it ended by itself), and its
    # text outside them (None: calls alone); `text` stays the whole answer
    tool_calls: list[ToolCall] | None = None
    content: str | None = None

    @classmethod
    def from_final(cls, final: Final, parse_as: Any = None) -> "Result":
        parsed = error = None
        if parse_as is not None and final.status == "done":
            try:
                parsed = parse_as.model_validate_json(final.text)
            except ValueError as e:  # pydantic's ValidationError is a ValueError
                error = (f"the answer does not validate as {parse_as.__name__} (finish_reason "
                         f"{final.finish_reason}): {e}")
        finish = "tool_calls" if final.tool_calls and final.finish_reason == "stop" else final.finish_reason
        return cls(final.job_id, final.status, final.text, list(final.token_ids), finish, final.error,
                   final.usage, final.worker, final.timings, final.metadata, final.attempt,
                   model=final.model, logprobs=final.logprobs, max_model_len=final.max_model_len, parsed=parsed,
                   parse_error=error, prompt_logprobs=final.prompt_logprobs,
                   embedding=None if final.embedding is None else floats(final.embedding),
                   tool_calls=final.tool_calls, content=final.content)

    @property
    def ok(self) -> bool:
        return self.status == "done"

    @property
    def latency_s(self) -> float | None:
        """Enqueue to final token, on the fleet's clocks; None when the job never finished on a worker."""
        t = self.timings
        if t.finished is None or not t.queued:
            return None
        return max(0.0, t.finished - t.queued)

    @property
    def queue_wait_s(self) -> float | None:
        t = self.timings
        return None if t.admitted is None or not t.queued else max(0.0, t.admitted - t.queued)

    @property
    def time_to_first_token_s(self) -> float | None:
        t = self.timings
        return None if t.first_token is None or not t.queued else max(0.0, t.first_token - t.queued)


def floats(data: bytes) -> list[float]:
    """A vector as the wire carries it (Final.embedding: float32 little-endian) as Python floats."""
    values = array.array("f", data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()
