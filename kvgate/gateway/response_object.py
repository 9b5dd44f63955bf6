"""Results as the Responses API's objects: the Response body (status, one output message, usage) and the typed stream
events, numbered, that `client.responses.create(stream=True)` and `client.responses.stream(...)` parse.

A kvgate response is one job: its id is `resp_<job id>`, its message `msg_<job id>`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvgate.producer import Result, TokenLogprob
from kvgate.openai.shapes import chat_logprobs

from .errors import ApiError
from .responses import failure

ID = re.compile(r"resp_([0-9a-f]{32})")
FINAL = ("completed", "incomplete", "failed", "cancelled")


def response_id(job_id: str) -> str:
    return f"resp_{job_id}"


def job_of(response_id: str) -> str | None:
    """The job a response id names; None for a string that is no kvgate response id."""
    match = ID.fullmatch(response_id)
    return match.group(1) if match else None


def output_logprobs(tokens: list[TokenLogprob] | None) -> list[dict[str, Any]]:
    """Responses put chat's logprobs entries on the output_text part (and its deltas)."""
    return (chat_logprobs(tokens) or {}).get("content") or []


@dataclass(slots=True)
class ResponseView:
    """What every body and event of one response shares."""

    id: str
    created_at: float
    model: str
    echo: dict[str, Any]  # the request's fields a Response repeats (responses_body.Asked.echo)

    @property
    def item_id(self) -> str:
        return "msg_" + self.id.removeprefix("resp_")

    def body(self, status: str, output: list[dict[str, Any]] | None = None, usage: dict[str, Any] | None = None,
             error: dict[str, Any] | None = None, reason: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": error, "incomplete_details": {"reason": reason} if reason else None, "model": self.model,
                "output": output or [], "usage": usage, "tools": [], "truncation": "disabled",
                "reasoning": {"effort": None, "summary": None}, "service_tier": "default", **self.echo}

    def message(self, text: str, status: str, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": [self.part(text, logprobs)]}

    def part(self, text: str, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": output_logprobs(logprobs)}

    def finished(self, r: Result) -> dict[str, Any]:
        """The Response of a final result: completed, incomplete (max_output_tokens cut it), cancelled or failed."""
        self.model = r.model or self.model
        if r.status == "cancelled":
            return self.body("cancelled", usage=usage(r))
        error = failure(r)
        if error is not None:
            return self.failed(error)
        cut = r.finish_reason == "length"
        output = [self.message(r.text, "incomplete" if cut else "completed", r.logprobs)]
        return self.body("incomplete" if cut else "completed", output, usage(r),
                         reason="max_output_tokens" if cut else None)

    def failed(self, error: ApiError) -> dict[str, Any]:
        return self.body("failed", error=error_of(error))


def usage(r: Result) -> dict[str, Any]:
    u = r.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def error_of(error: ApiError) -> dict[str, Any]:
    """A Response's `error`: OpenAI's codes are few; a client's fault is `invalid_prompt`, the rest `server_error`,
    and the message says which of kvgate's (its code in brackets)."""
    code = "invalid_prompt" if error.status == 400 else "server_error"
    return {"code": code, "message": f"{error.message} [{error.code}]" if error.code else error.message}


@dataclass(slots=True)
class ResponseEvents:
    """The typed events of one streamed response, each with its sequence_number: created and in_progress, the
    message item and its text part opened, text deltas, then the part, the item and the response closed."""

    view: ResponseView
    seq: int = 0
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    def opening(self, status: str = "in_progress") -> list[dict[str, Any]]:
        where = {"item_id": self.view.item_id, "output_index": 0, "content_index": 0}
        head = [self.event("response.created", response=self.view.body(status))]
        if status == "queued":
            head.append(self.event("response.queued", response=self.view.body("queued")))
        return head + [self.event("response.in_progress", response=self.view.body("in_progress")),
                       self.event("response.output_item.added", output_index=0,
                                  item=self.view.message("", "in_progress") | {"content": []}),
                       self.event("response.content_part.added", part=self.view.part(""), **where)]

    def delta(self, text: str, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        self.text += text
        self.logprobs += logprobs or []
        return self.event("response.output_text.delta", item_id=self.view.item_id, output_index=0, content_index=0,
                          delta=text, logprobs=output_logprobs(logprobs))

    def closing(self, r: Result) -> list[dict[str, Any]]:
        """The events after the last delta; the response's whole text is the streamed text (what the client has)."""
        body = self.view.finished(r)
        if body["status"] not in ("completed", "incomplete"):
            return [self.event("response.failed" if body["status"] == "failed" else "response.incomplete",
                               response=body)]
        logprobs = self.logprobs if r.logprobs is not None else None
        item = self.view.message(self.text, body["output"][0]["status"], logprobs)
        body["output"] = [item]
        where = {"item_id": self.view.item_id, "output_index": 0, "content_index": 0}
        return [self.event("response.output_text.done", text=self.text, logprobs=output_logprobs(logprobs), **where),
                self.event("response.content_part.done", part=item["content"][0], **where),
                self.event("response.output_item.done", output_index=0, item=item),
                self.event(f"response.{body['status']}", response=body)]

    def failing(self, error: ApiError) -> list[dict[str, Any]]:
        return [self.event("response.failed", response=self.view.failed(error))]

    def detached(self, error: ApiError) -> list[dict[str, Any]]:
        """A background response's stream that ends while its job runs on: an `error` event, not response.failed."""
        return [self.event("error", code=error.code, message=error.message, param=None)]
