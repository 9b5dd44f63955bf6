"""/v1/files: upload a batch input file, read files' metadata and content, list and delete them."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvgate.producer.bounded_json import BadJson, parse_json
from kvgate.producer.quoting import shown

from ..auth import ApiKeys, Caller
from ..errors import ApiError, invalid
from ..json_answer import json_response
from ..paging import limit_of, page_body
from ..request_body import off_loop
from ..settings import GatewaySettings
from .expires_after import expired, expiry_seconds
from .file_store import FileObject, FileStore

PURPOSES = ("batch",)  # what uploads may be for; the gateway itself writes files with purpose batch_output
READ_CHUNK = 1 << 20


@dataclass(slots=True)
class FilesApi:
    settings: GatewaySettings
    store: FileStore
    keys: ApiKeys
    clock: Callable[[], Awaitable[int]] | None = None  # the Redis server's clock (BatchStore.now), set at start

    def routes(self) -> list[Route]:
        return [Route("/v1/files", self.upload, methods=["POST"]),
                Route("/v1/files", self.list, methods=["GET"]),
                Route("/v1/files/{file_id}", self.retrieve, methods=["GET"]),
                Route("/v1/files/{file_id}", self.delete, methods=["DELETE"]),
                Route("/v1/files/{file_id}/content", self.content, methods=["GET"])]

    async def upload(self, request: Request) -> Response:
        caller = self.keys.caller(request)
        limit = self.settings.max_file_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit + 64 * 1024:  # room for the multipart framing
            raise _too_large(int(declared), limit)
        async with request.form(max_files=1, max_fields=8) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose not in PURPOSES:
                raise invalid("purpose", f"purpose={shown(purpose)} is not supported; this gateway stores files for "
                                         f"purpose 'batch' only", code="invalid_purpose")
            if not isinstance(upload, UploadFile):
                raise invalid("file", "no file in the upload: send it as the multipart field `file`")
            policy = {k[len("expires_after["):-1]: v for k, v in form.items() if k.startswith("expires_after[")}
            seconds = expiry_seconds(policy or form.get("expires_after"), "expires_after",
                                     self.settings.file_min_expiry_s)
            data = await _read(upload, limit)
            filename = upload.filename or "upload.jsonl"
        await off_loop(check_jsonl, data)  # every line parsed: up to --max-file-size, off the event loop
        now = await self.clock()
        obj = await asyncio.to_thread(self.store.put, data, filename, purpose, tenant=caller.tenant, created_at=now,
                                      expires_at=None if seconds is None else now + seconds)
        return json_response(obj.body())

    async def list(self, request: Request) -> Response:
        caller = self.keys.caller(request)
        limit, after = limit_of(request, 10_000, 10_000), request.query_params.get("after")
        purpose, order = request.query_params.get("purpose"), request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid("order", f"order={shown(order)} must be asc or desc")
        files = [f for f in await self._live(await asyncio.to_thread(self.store.list))
                 if caller.sees(f.tenant) and (purpose is None or f.purpose == purpose)]
        files = files if order == "desc" else files[::-1]
        if after is not None:
            ids = [f.id for f in files]
            files = files[ids.index(after) + 1:] if after in ids else []
        return json_response(page_body([f.body() for f in files[:limit]], len(files) > limit))

    async def retrieve(self, request: Request) -> Response:
        caller = self.keys.caller(request)
        return json_response((await self.found(request.path_params["file_id"], caller)).body())

    async def delete(self, request: Request) -> Response:
        caller = self.keys.caller(request)
        file_id = (await self.found(request.path_params["file_id"], caller)).id
        deleted = await asyncio.to_thread(self.store.delete, file_id)
        return json_response({"id": file_id, "object": "file", "deleted": deleted})

    async def content(self, request: Request) -> Response:
        caller = self.keys.caller(request)
        obj = await self.found(request.path_params["file_id"], caller)
        f = await asyncio.to_thread(self.store.open, obj.id)
        if f is None:
            raise not_found(obj.id)

        async def chunks():
            try:
                while chunk := await asyncio.to_thread(f.read, READ_CHUNK):
                    yield chunk
            finally:
                f.close()

        return StreamingResponse(chunks(), media_type="application/octet-stream",
                                 headers={"content-length": str(obj.bytes)})

    async def found(self, file_id: str, caller: Caller, param: str | None = None) -> FileObject:
        """The file, if `caller` may see it; another tenant's file is answered as one that does not exist."""
        obj = await asyncio.to_thread(self.store.get, file_id)
        if obj is None or not caller.sees(obj.tenant) or not await self._live([obj]):
            raise not_found(file_id, param)
        return obj

    async def _live(self, files: list[FileObject]) -> list[FileObject]:
        """The files not past their expires_at on the Redis server's clock; the others are deleted now."""
        if all(f.expires_at is None for f in files):
            return files
        now = await self.clock()
        for f in files:
            if expired(f.expires_at, now):
                await asyncio.to_thread(self.store.delete, f.id)
        return [f for f in files if not expired(f.expires_at, now)]


def not_found(file_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"no file with id {shown(file_id)}", param=param, code="file_not_found")


def check_jsonl(data: bytes) -> None:
    """A batch input file is UTF-8 JSONL: each non-blank line one JSON object. The message names the first bad line."""
    if not data.strip():
        raise invalid("file", "the file is empty; a batch input file has one JSON request per line",
                      code="invalid_file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid("file", f"the file is not UTF-8 (byte {e.start}): save it as UTF-8 JSONL",
                      code="invalid_file") from None
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            ok = isinstance(parse_json(line), dict)
        except BadJson as e:
            raise invalid("file", f"line {line_no} is not JSON ({e}); a batch input file has one JSON request per "
                                  "line", code="invalid_file") from None
        if not ok:
            raise invalid("file", f"line {line_no} is not a JSON object", code="invalid_file")


async def _read(upload: UploadFile, limit: int) -> bytes:
    parts, size = [], 0
    while chunk := await upload.read(READ_CHUNK):
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        parts.append(chunk)
    return b"".join(parts)


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the upload has {size} bytes or more, over this gateway's limit of {limit} bytes "
                         "(--max-file-size); split the file", param="file", code="file_too_large")
