"""Results as OpenAI response bodies: chat.completion / text_completion, their stream chunks, usage."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvgate.producer import Result, TokenLogprob
from kvgate.openai.shapes import (chat_logprobs, choice, completion_logprobs, finish_reason, prompt_text,
                                  text_length)
from kvgate.producer.constraints import Tools
from kvgate.producer.tool_calls import Content, Parser, Piece, call_id, parser_for

from .plan import Plan


@dataclass(slots=True)
class Reply:
    """What every body and chunk of one request shares."""

    plan: Plan
    id: str
    served: str | None = None  # the canonical name of the model that answers (Final.model; before it, the fleet's)
    created: int = field(default_factory=lambda: int(time.time()))
    offsets: dict[int, int] = field(default_factory=dict)  # choice -> text streamed so far, for text_offset

    @property
    def object(self) -> str:
        return "chat.completion" if self.plan.kind == "chat" else "text_completion"

    def head(self, chunk: bool = False) -> dict[str, Any]:
        kind = self.object + (".chunk" if chunk and self.plan.kind == "chat" else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.served or self.plan.model,
                "system_fingerprint": None}

    # -- whole answers ----------------------------------------------------------------------------
    def body(self, results: list[Result]) -> dict[str, Any]:
        self.served = next((r.model for r in results if r.model), self.served)
        choices = [self.choice(i, r, at) for i, (at, r) in enumerate(self.plan.picked(results))]
        return self.head() | {"choices": choices, "usage": self.usage(results)}

    def choice(self, index: int, r: Result, at: int | None = None) -> dict[str, Any]:
        """Choice `index`, answered by result `r` of submit `at` (its index unless best_of picked among more)."""
        p = self.plan
        text, logprobs, reason = r.text, r.logprobs if p.show_logprobs else None, finish(r)
        if p.prompt_only:  # echo with max_tokens 0: the one token generated is not part of the answer
            text, logprobs, reason = "", [] if logprobs is not None else None, "length"
        if not p.echo:
            return choice(p.kind == "chat", index, text, reason, logprobs, r.tool_calls, r.content)
        prompt = p.submits[index if at is None else at].get("prompt")
        text = (prompt if prompt is not None else prompt_text(r.prompt_logprobs or [])) + text
        return {"index": index, "text": text, "logprobs": completion_logprobs(logprobs, prompt=r.prompt_logprobs),
                "finish_reason": reason}

    def usage(self, results: list[Result]) -> dict[str, Any]:
        prompts: dict[int, Result] = {}
        for i, r in enumerate(results):
            prompts.setdefault(self.plan.prompt_of[i], r)  # n choices of one prompt read it once, as OpenAI counts
        prompt = sum(r.usage.prompt_tokens for r in prompts.values())
        cached = sum(r.usage.cached_tokens for r in prompts.values())
        completion = 0 if self.plan.prompt_only else sum(r.usage.completion_tokens for r in results)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # -- stream chunks ----------------------------------------------------------------------------
    def chunk(self, index: int, text: str | None = None, finish_reason: str | None = None,
              first: bool = False, logprobs: list[TokenLogprob] | None = None,
              usage: tuple[int, int] | None = None) -> dict[str, Any]:
        """One stream chunk of choice `index`; `usage`: its (prompt, completion) tokens so far, which the chunk
        carries under continuous_usage_stats."""
        if self.plan.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs),
                      "finish_reason": finish_reason}
        else:
            offset = self.offsets.get(index, 0)
            self.offsets[index] = offset + text_length(logprobs)
            choice = {"index": index, "text": text or "", "logprobs": completion_logprobs(logprobs, offset),
                      "finish_reason": finish_reason}
        out = self.head(chunk=True) | {"choices": [choice]}
        if self.plan.continuous_usage:
            prompt, completion = usage or (0, 0)
            out["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                            "total_tokens": prompt + completion}
        elif self.plan.include_usage:
            out["usage"] = None
        return out

    def tool_chunk(self, index: int, piece: Piece, job_id: str) -> dict[str, Any]:
        """A chat stream's chunk of one parsed piece: content, or a call's first piece (index, id, type, name and its
        first arguments) or a later one (index and arguments to append), as OpenAI streams calls."""
        if isinstance(piece, Content):
            return self.chunk(index, piece.text)
        call: dict[str, Any] = {"index": piece.index, "function": {"arguments": piece.arguments}}
        if piece.name is not None:
            call = {"index": piece.index, "id": call_id(job_id, piece.index), "type": "function",
                    "function": {"name": piece.name, "arguments": piece.arguments}}
        out = self.chunk(index)
        out["choices"][0]["delta"]["tool_calls"] = [call]
        return out

    def usage_chunk(self, results: list[Result]) -> dict[str, Any]:
        return self.head(chunk=True) | {"choices": [], "usage": self.usage(results)}


@dataclass(slots=True)
class ToolReader:
    """One streamed chat choice of a request with tools: its text deltas read for calls by the parser the final is read
    with (auto: the format the serving worker names on its deltas), as content and tool-call chunks."""

    tools: Tools
    job_id: str
    parser: Parser | None = None
    called: bool = False

    def chunks(self, reply: Reply, index: int, text: str, logprobs: list[TokenLogprob] | None,
               parser: str | None) -> list[dict[str, Any]]:
        if self.parser is None:
            t = self.tools
            self.parser = parser_for(t.choice, t.function, [f.name for f in t.functions], parser or "hermes",
                                     t.parallel)
        out = self._chunks(reply, index, self.parser.feed(text))
        if logprobs:  # the tokens' logprobs go with the first chunk their text made, or one of their own
            out = out or [reply.chunk(index)]
            out[0]["choices"][0]["logprobs"] = chat_logprobs(logprobs)
        return out

    def close(self, reply: Reply, index: int) -> list[dict[str, Any]]:
        return self._chunks(reply, index, self.parser.close()) if self.parser is not None else []

    def _chunks(self, reply: Reply, index: int, pieces: list[Piece]) -> list[dict[str, Any]]:
        self.called = self.called or any(not isinstance(p, Content) for p in pieces)
        return [reply.tool_chunk(index, p, self.job_id) for p in pieces if not isinstance(p, Content) or p.text]


def finish(r: Result) -> str | None:
    return finish_reason(r)
