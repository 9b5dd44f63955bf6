"""Results as the Responses API's objects: the Response body (status, its output items, usage) and the typed stream
events, numbered, that `client.responses.create(stream=True)` and `client.responses.stream(...)` parse.

A kvgate response is one job: its id is `resp_<job id>`, its message `msg_<job id>`, its i-th function call
`fc_<job id>_<i>` (whose call_id is the chat answer's, tool_calls.call_id). The output is one message, or, where the
request has tools and the answer calls them, its text outside the calls as a message (if any) and a function_call
item per call.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvgate.producer import Result, TokenLogprob
from kvgate.openai.shapes import chat_logprobs
from kvgate.producer.constraints import Tools
from kvgate.producer.protocol import ToolCall
from kvgate.producer.tool_calls import Content, Parser, Piece, call_id, parser_for

from ..errors import ApiError, failure

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
    def job_id(self) -> str:
        return self.id.removeprefix("resp_")

    @property
    def item_id(self) -> str:
        return "msg_" + self.job_id

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

    def call(self, index: int, name: str, arguments: str, status: str) -> dict[str, Any]:
        """The function_call item of the answer's call `index`."""
        return {"type": "function_call", "id": f"fc_{self.job_id}_{index}", "call_id": call_id(self.job_id, index),
                "name": name, "arguments": arguments, "status": status}

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
        if r.tool_calls:
            output = self.calls(r.tool_calls, r.content, cut)
        return self.body("incomplete" if cut else "completed", output, usage(r),
                         reason="max_output_tokens" if cut else None)

    def calls(self, calls: list[ToolCall], content: str | None, cut: bool) -> list[dict[str, Any]]:
        """An answer that calls: its text outside the calls as a message (if it has any: logprobs are the whole
        text's, so none), then each call; where max_output_tokens cut it, its last item is incomplete."""
        out = [self.message(content, "completed")] if content else []
        out += [self.call(i, c.name, c.arguments, "completed") for i, c in enumerate(calls)]
        if cut:
            out[-1]["status"] = "incomplete"
        return out

    def failed(self, error: ApiError) -> dict[str, Any]:
        return self.body("failed", error=error_of(error))


def usage(r: Result) -> dict[str, Any]:
    u = r.usage
    # cache_write_tokens: no prompt cache write is billed apart (the openai client 3.x's ResponseUsage requires it)
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
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
    message item and its text part opened, text deltas, then the part, the item and the response closed.

    With tools, the text is read for calls as it comes (the parser a whole answer is read with, tool_calls.py): each
    call is a function_call item (added with its name, its arguments as `function_call_arguments.delta`s), the text
    outside calls a message item opened at its first non-blank text; every item closes at the end, in output order."""

    view: ResponseView
    tools: Tools | None = None  # the request's tools (translate.Plan.tools): its answer may call them
    seq: int = 0
    text: str = ""  # the message's text
    logprobs: list[TokenLogprob] = field(default_factory=list)
    parser: Parser | None = None
    items: list[dict[str, Any]] = field(default_factory=list)  # with tools: the output items opened, in order
    held: str = ""  # with tools: blank text before the message opens (text between calls opens none)
    message_at: int = -1  # with tools: the message item's output index, once opened
    calls: dict[int, int] = field(default_factory=dict)  # with tools: a call's index -> its item's output index

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    def opening(self, status: str = "in_progress") -> list[dict[str, Any]]:
        head = [self.event("response.created", response=self.view.body(status))]
        if status == "queued":
            head.append(self.event("response.queued", response=self.view.body("queued")))
        head.append(self.event("response.in_progress", response=self.view.body("in_progress")))
        return head if self.tools is not None else head + self._open_message(0)

    def _open_message(self, index: int) -> list[dict[str, Any]]:
        where = {"item_id": self.view.item_id, "output_index": index, "content_index": 0}
        return [self.event("response.output_item.added", output_index=index,
                           item=self.view.message("", "in_progress") | {"content": []}),
                self.event("response.content_part.added", part=self.view.part(""), **where)]

    def delta(self, text: str, logprobs: list[TokenLogprob] | None, parser: str | None = None) -> list[dict[str, Any]]:
        """The events of new text; `parser`: the format the serving worker reads `auto` calls in."""
        if self.tools is None:
            return [self._text(0, text, logprobs)]
        if self.parser is None:
            t = self.tools
            self.parser = parser_for(t.choice, t.function, [f.name for f in t.functions], parser or "hermes",
                                     t.parallel)
        return self._pieces(self.parser.feed(text))

    def _text(self, index: int, text: str, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        self.text += text
        self.logprobs += logprobs or []
        return self.event("response.output_text.delta", item_id=self.view.item_id, output_index=index,
                          content_index=0, delta=text, logprobs=output_logprobs(logprobs))

    def _pieces(self, pieces: list[Piece]) -> list[dict[str, Any]]:
        out = []
        for p in pieces:
            if isinstance(p, Content):
                out += self._content(p.text)
                continue
            if p.name is not None:  # a call's first piece: its item
                self.calls[p.index] = len(self.items)
                self.items.append(self.view.call(p.index, p.name, "", "in_progress"))
                out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                      item=dict(self.items[-1])))
            at = self.calls[p.index]
            item = self.items[at]
            if p.arguments:
                item["arguments"] += p.arguments
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                                      delta=p.arguments))
        return out

    def _content(self, text: str, force: bool = False) -> list[dict[str, Any]]:
        out = []
        if self.message_at < 0:
            self.held += text
            if not self.held.strip() and not force:
                return []
            self.message_at, text, self.held = len(self.items), self.held, ""
            self.items.append(self.view.message("", "in_progress"))
            out += self._open_message(self.message_at)
        if text:
            out.append(self._text(self.message_at, text, None))
        return out

    def closing(self, r: Result) -> list[dict[str, Any]]:
        """The events after the last delta; the response's whole text is the streamed text (what the client has)."""
        body = self.view.finished(r)
        if body["status"] not in ("completed", "incomplete"):
            return [self.event("response.failed" if body["status"] == "failed" else "response.incomplete",
                               response=body)]
        if self.tools is not None:
            return self._closing_items(body)
        logprobs = self.logprobs if r.logprobs is not None else None
        item = self.view.message(self.text, body["output"][0]["status"], logprobs)
        body["output"] = [item]
        return self._message_done(0, item) + [self.event(f"response.{body['status']}", response=body)]

    def _message_done(self, index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
        where = {"item_id": self.view.item_id, "output_index": index, "content_index": 0}
        part = item["content"][0]
        return [self.event("response.output_text.done", text=part["text"], logprobs=part["logprobs"], **where),
                self.event("response.content_part.done", part=part, **where),
                self.event("response.output_item.done", output_index=index, item=item)]

    def _closing_items(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """With tools: the parser's last pieces, a message for an answer with no call (its text, blank or not), then
        every item closed in output order; where max_output_tokens cut the answer, its last item is incomplete."""
        out = self._pieces(self.parser.close()) if self.parser is not None else []
        if not self.items:
            out += self._content("", force=True)
        done = []
        for i, item in enumerate(self.items):
            status = "incomplete" if body["status"] == "incomplete" and i == len(self.items) - 1 else "completed"
            if item["type"] == "message":
                item = self.view.message(self.text, status)
                out += self._message_done(i, item)
            else:
                item = item | {"status": status}
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                      name=item["name"], arguments=item["arguments"]))
                out.append(self.event("response.output_item.done", output_index=i, item=item))
            done.append(item)
        body["output"] = done
        return out + [self.event(f"response.{body['status']}", response=body)]

    def failing(self, error: ApiError) -> list[dict[str, Any]]:
        return [self.event("response.failed", response=self.view.failed(error))]

    def detached(self, error: ApiError) -> list[dict[str, Any]]:
        """A background response's stream that ends while its job runs on: an `error` event, not response.failed."""
        return [self.event("error", code=error.code, message=error.message, param=None)]
