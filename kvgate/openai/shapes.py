"""A result's choice in OpenAI's two response shapes, logprobs included; shared by `kvgate serve` and
`kvgate batch` so both answer alike.

Chat (choices[i].logprobs):  {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}],
                              "refusal": None}
Completions (legacy):        {"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}
"""
from __future__ import annotations

from typing import Any

from kvgate.producer.protocol import MAX_LOGPROBS, TokenLogprob, TopLogprob

# JSON has no -inf; a token the model rules out entirely is reported at this floor, as vLLM does
LOGPROB_FLOOR = -9999.0


class BadLogprobs(ValueError):
    def __init__(self, param: str, message: str):
        self.param = param
        super().__init__(message)


def requested_logprobs(chat: bool, body: dict[str, Any]) -> int | None:
    """How many alternatives per token a request body asks for; None: no logprobs. Chat asks with
    `logprobs: true` and `top_logprobs: N`, the legacy completions API with `logprobs: N` (0: the chosen
    token only)."""
    wanted = body.get("logprobs")
    if not chat:
        return None if wanted is None else _count("logprobs", wanted)
    top = body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise BadLogprobs("logprobs", f"logprobs={wanted!r} must be true or false (top_logprobs sets how many "
                                      "alternatives)")
    if top is not None:
        _count("top_logprobs", top)
        if top and not wanted:
            raise BadLogprobs("top_logprobs", f"top_logprobs={top!r} needs logprobs=true")
    return (top or 0) if wanted else None


def _count(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS:
        raise BadLogprobs(name, f"{name}={value!r} must be an integer from 0 to {MAX_LOGPROBS}")
    return value


def _finite(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN to the floor


def _chat_token(t: TokenLogprob | TopLogprob) -> dict[str, Any]:
    return {"token": t.text, "logprob": _finite(t.logprob), "bytes": list(t.utf8)}


def chat_logprobs(tokens: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if tokens is None:
        return None
    return {"content": [_chat_token(t) | {"top_logprobs": [_chat_token(a) for a in t.top]} for t in tokens],
            "refusal": None}


def completion_logprobs(tokens: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
    """`offset`: where the first token's text starts in the completion (a stream chunk continues the text).
    As OpenAI documents for the legacy API, each top_logprobs entry also holds the sampled token."""
    if tokens is None:
        return None
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
    return {"tokens": [t.text for t in tokens], "token_logprobs": [_finite(t.logprob) for t in tokens],
            "top_logprobs": [{a.text: _finite(a.logprob) for a in t.top} | {t.text: _finite(t.logprob)}
                             for t in tokens],
            "text_offset": offsets}


def text_length(tokens: list[TokenLogprob] | None) -> int:
    """How far a stream chunk's tokens move the text offset of the next."""
    return sum(len(t.text) for t in tokens or [])


def choice(chat: bool, index: int, text: str, finish_reason: str | None,
           logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
    """One choice of a whole (not streamed) chat.completion or text_completion body."""
    if chat:
        message = {"role": "assistant", "content": text, "refusal": None}
        return {"index": index, "message": message, "logprobs": chat_logprobs(logprobs), "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": completion_logprobs(logprobs), "finish_reason": finish_reason}
