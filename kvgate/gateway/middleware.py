"""What wraps every route: CORS for browser pages (only with --cors-origin), then the request body size limits; and
what the process does once the app has started."""
from __future__ import annotations

import gc

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .request_body import BodyLimit, SizeLimit
from .settings import GatewaySettings
from .tracing import TracingMiddleware, request_tracer

UPLOAD_FRAMING = 64 * 1024  # room for an upload's multipart boundaries and part headers around the file
CORS_METHODS = ["GET", "POST", "DELETE"]
# what a page's script may read of an answer beyond the CORS-safelisted headers
CORS_EXPOSED = ["x-request-id", "retry-after"]


def middleware(s: GatewaySettings) -> list[Middleware]:
    """Outermost first: CORS wraps the size limit, so a page also reads the 413 that answers its oversized body."""
    bodies = SizeLimit(s.max_body_bytes, "--max-body-size, KVGATE_MAX_BODY_BYTES")
    uploads = SizeLimit(s.max_file_bytes + UPLOAD_FRAMING, "--max-file-size, KVGATE_MAX_FILE_BYTES")
    stack = [Middleware(BodyLimit, default=bodies, limits={"/v1/files": uploads}), Middleware(FreezeAtStartup)]
    if (tracer := request_tracer(s.otel_endpoint)) is not None:  # inside CORS: a preflight is no request of anyone's
        stack.insert(0, Middleware(TracingMiddleware, tracer=tracer))
    if s.cors_origins:
        # any request header: the openai JavaScript client sends its own (x-stainless-*); no credentials mode, as
        # an API key travels in Authorization, which a page sets itself
        stack.insert(0, Middleware(CORSMiddleware, allow_origins=s.cors_origins, allow_methods=CORS_METHODS,
                                   allow_headers=["*"], expose_headers=CORS_EXPOSED, max_age=600))
    return stack


class FreezeAtStartup:
    """Once the app has started, the objects the process holds (modules, schemas, clients: 220,000 in a test process)
    are moved out of the garbage collector's reach with gc.freeze(): they live as long as the process, and a full
    collection walked all of them on the event loop's thread, 360-420 ms on a loaded machine, set off by whichever
    request happened to allocate at the time (a large body's, mostly)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def started(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                gc.freeze()
            await send(message)

        await self.app(scope, receive, started)
