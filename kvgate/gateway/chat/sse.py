"""Server-sent events in OpenAI's framing: `data: {chunk}\n\n` per chunk, `data: [DONE]\n\n` at the end.

The n choices of a request stream side by side, each chunk naming its choice index. A job that fails
mid-stream becomes one `data: {"error": {...}}` event (the openai client raises it), then [DONE]. A job that
restarts mid-stream goes on where the client is when it repeats itself (replay.py), else fails so.

The request timeout bounds the wait for each next event of a job (the first token, then the silence between
tokens), not the whole stream: a long answer whose tokens keep coming is never cut; a job that goes quiet for that
long is cancelled and the stream ends with a 504-shaped timeout error.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, NamedTuple

import msgspec

from kvgate.producer import AsyncJobHandle, KvgateError, Result
from kvgate.producer.protocol import TokenLogprob

from ..errors import ApiError, failure, from_sdk
from .bodies import Reply, ToolReader, finish
from .replay import Replay

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must pass each event at once


class StreamText(NamedTuple):
    """New text of a job's stream, as its pump hands it on: the tokens' logprobs (when asked), the tool-call parser
    its worker names (a job with tools of choice auto), and the choice's (prompt, completion) tokens so far."""

    text: str
    logprobs: list[TokenLogprob] | None
    parser: str | None
    usage: tuple[int, int]


def frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def events(reply: Reply, handles: list[AsyncJobHandle], timeout: float,
                 abandon: Callable[[list[AsyncJobHandle]], None]) -> AsyncIterator[bytes]:
    """The whole event stream of one request; jobs still running when it stops early (a client gone) are
    handed to `abandon`, which cancels them."""
    if reply.plan.kind == "chat":  # the role comes first, before any token: clients see the stream is live
        for i in range(len(handles)):
            yield frame(reply.chunk(i, first=True))
    inbox: asyncio.Queue = asyncio.Queue()
    pumps = [asyncio.create_task(pump(i, h, timeout, inbox)) for i, h in enumerate(handles)]
    results: list[Result | None] = [None] * len(handles)
    tools = [None if reply.plan.tools is None else ToolReader(reply.plan.tools, h.job_id) for h in handles]
    try:
        for _ in range(len(handles)):
            while True:
                i, item = await inbox.get()
                if isinstance(item, StreamText):
                    if tools[i] is None:
                        yield frame(reply.chunk(i, item.text, None, False, item.logprobs, item.usage))
                    else:
                        for chunk in tools[i].chunks(reply, i, item.text, item.logprobs, item.parser):
                            yield frame(chunk)
                    continue
                error = _error_of(item, timeout)
                if error is not None:
                    yield frame(error.body())
                    yield DONE
                    return
                results[i] = item
                reason = finish(item)
                if tools[i] is not None:
                    for chunk in tools[i].close(reply, i):
                        yield frame(chunk)
                    reason = "tool_calls" if tools[i].called and reason == "stop" else reason
                usage = (item.usage.prompt_tokens, item.usage.completion_tokens)
                yield frame(reply.chunk(i, finish_reason=reason, usage=usage))
                break
        if reply.plan.include_usage:
            yield frame(reply.usage_chunk(results))
        yield DONE
    finally:
        for task in pumps:
            task.cancel()
        unfinished = [h for h in handles if not h.done()]
        if unfinished:
            abandon(unfinished)


async def pump(i: int, handle: AsyncJobHandle, timeout: float, inbox: asyncio.Queue) -> None:
    replay, prompt_tokens = Replay(), 0
    items = handle.stream(None)
    try:
        while True:
            try:  # the timeout starts again with every item: it bounds silence, not the stream's length
                item = await asyncio.wait_for(anext(items), timeout)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise ApiError(504, f"job {handle.job_id} sent nothing for {timeout:g} s (--request-timeout bounds "
                                    "the wait for the first token and between tokens); the job was cancelled, "
                                    "retry later or raise --request-timeout", type="timeout_error",
                               code="timeout") from None
            # a token that ends mid-character has no text yet (the next delta carries it), but has its logprob
            prompt_tokens = getattr(item, "prompt_tokens", 0) or prompt_tokens  # an attempt's first delta has it
            if (new := replay.take(item)) is not None:
                inbox.put_nowait((i, StreamText(new[0], new[1], item.tool_parser, (prompt_tokens, replay.sent_tokens))))
        inbox.put_nowait((i, await handle.result(0)))
    except (KvgateError, ApiError) as e:
        inbox.put_nowait((i, e))
    finally:
        await items.aclose()


def _error_of(item: Result | Exception, timeout: float) -> ApiError | None:
    if isinstance(item, Result):
        return failure(item)
    if isinstance(item, ApiError):
        return item
    return from_sdk(item, {}, 1)
