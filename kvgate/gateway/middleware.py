"""What wraps every route: the request body size limits; and what the process does once the app has started."""
from __future__ import annotations

import gc

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .request_body import BodyLimit, SizeLimit
from .settings import GatewaySettings

UPLOAD_FRAMING = 64 * 1024  # room for an upload's multipart boundaries and part headers around the file


def middleware(s: GatewaySettings) -> list[Middleware]:
    """Outermost first."""
    bodies = SizeLimit(s.max_body_bytes, "--max-body-size, KVGATE_MAX_BODY_BYTES")
    uploads = SizeLimit(s.max_file_bytes + UPLOAD_FRAMING, "--max-file-size, KVGATE_MAX_FILE_BYTES")
    stack = [Middleware(BodyLimit, default=bodies, limits={"/v1/files": uploads}), Middleware(FreezeAtStartup)]
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
