"""Request bodies: their size limit, enforced before a route sees them, and their JSON, parsed so that no body holds
the event loop (issue 26.3)."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvgate.producer.bounded_json import SMALL, BadJson, parse_json

from .errors import ApiError, invalid

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SizeLimit:
    """The most bytes a body may have, and the setting that says so (named in the 413)."""

    bytes: int
    setting: str  # the flag and variable, for the message


class BodyTooLarge(ApiError):
    def __init__(self, size: int, path: str, limit: SizeLimit):
        super().__init__(413, f"the request body to {path} has {size} bytes or more, over this gateway's limit of "
                              f"{limit.bytes} bytes ({limit.setting}); send less", param="body",
                         code="request_too_large")


class BodyLimit:
    """ASGI middleware: a body over its path's limit is refused with a 413 in OpenAI's shape as soon as that is
    known, from its Content-Length before any of it is read, else (chunked transfer) once the bytes read so far
    pass the limit; the route then stops reading it. `limits` maps exact paths to their limit, others get `default`.

    An answer sent while the body is still unread (that 413, or any other answer a route gives before reading its
    body) closes the connection: on a kept-alive one the server would read the rest only to drop it, so a client
    could make the gateway drain a 64 MiB upload, or gigabytes, after its refusal."""

    def __init__(self, app: ASGIApp, default: SizeLimit, limits: dict[str, SizeLimit] | None = None):
        self.app, self.default, self.limits = app, default, limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        limit = self.limits.get(path, self.default)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        unread = declared.strip(b"0") != b"" or b"transfer-encoding" in headers  # a body is coming
        read = 0

        async def limited() -> Message:
            nonlocal read, unread
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > limit.bytes:
                    raise BodyTooLarge(read, path, limit)  # rendered by the app's ApiError handler
                unread = message.get("more_body", False)
            return message

        async def answer(message: Message) -> None:
            if message["type"] == "http.response.start" and unread:
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        if declared.isdigit() and int(declared) > limit.bytes:
            return await _send_error(scope, receive, answer, BodyTooLarge(int(declared), path, limit))
        await self.app(scope, limited, answer)


async def _send_error(scope: Scope, receive: Receive, send: Send, error: ApiError) -> None:
    await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)


# One thread for the work on large bodies, so they wait for each other: C code (msgspec, pydantic) holds the GIL
# for its whole call, and the event loop waits for every thread ahead of it in the GIL's queue, so several such
# threads at once added their holds up (a 548 ms loop lag with eight hostile bodies in flight; one at a time: the
# longest single call's).
_LARGE_BODIES = ThreadPoolExecutor(1, thread_name_prefix="kvgate-large-body")


async def off_loop(work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` in the large-body thread."""
    return await asyncio.get_running_loop().run_in_executor(_LARGE_BODIES, work, *args)


async def read_json(request: Request) -> Any:
    body = await request.body()
    try:
        return parse_json(body) if len(body) <= SMALL else await off_loop(parse_json, body)
    except BadJson as e:
        raise invalid("body", f"the request body is not JSON: {e}", code="invalid_json") from None


async def sized(request: Request, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` on the loop for a small body, in the large-body thread for a large one: checks that walk a
    large body's every value (a prompt of 512,000 token ids) must not hold the loop."""
    if len(await request.body()) <= SMALL:
        return work(*args)
    return await off_loop(work, *args)
