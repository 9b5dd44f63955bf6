"""Where uploaded batch input files and the batch output and error files live, behind one small interface.

The default keeps them in a local directory, one folder per namespace (`<files dir>/<namespace>/`), so gateways of
two namespaces never see each other's files even on one files directory. Several replicas of a namespace need one
store they all see (a shared volume mounted at the same --files-dir, or an object store behind FileStore),
because the replica that drives a batch may not be the one that took its upload. Each file records its tenant;
which tenant may see which file is the routes' business (file_routes.py), not the store's.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import BinaryIO, Protocol
from urllib.parse import quote

from kvgate.producer.limits import DEFAULT_TENANT

FILE_ID = re.compile(r"^file-[A-Za-z0-9_-]{1,64}$")


def default_files_dir() -> Path:
    """$XDG_DATA_HOME/kvgate/files, else ~/.local/share/kvgate/files: per user, and kept across restarts."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "kvgate" / "files"


def namespace_dir(files_dir: str | Path, namespace: str) -> Path:
    """A namespace's own folder of the files directory. A namespace may hold any character but whitespace and
    braces: quoted, so that '/' or '..' cannot lead out of it."""
    name = quote(namespace, safe="")
    return Path(files_dir) / (name if name not in (".", "..") else name.replace(".", "%2E"))


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


@dataclass(slots=True)
class FileObject:
    """A stored file, in OpenAI's shape (openai.types.FileObject)."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str  # batch (uploads), batch_output (output and error files the gateway writes)
    object: str = "file"
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None
    tenant: str = DEFAULT_TENANT  # who owns it: the uploader's, or the batch's; files from before tenants: default

    def body(self) -> dict:
        """OpenAI's FileObject: without the tenant."""
        out = asdict(self)
        del out["tenant"]
        return out

    @classmethod
    def of(cls, stored: dict) -> "FileObject":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in stored.items() if k in known})


class FileStore(Protocol):
    """What the gateway needs from file storage; calls block, so the gateway runs them in a thread."""

    def put(self, data: bytes, filename: str, purpose: str, file_id: str | None = None,
            tenant: str = DEFAULT_TENANT, created_at: int | None = None, expires_at: int | None = None) -> FileObject:
        """Store `data` as `tenant`'s; with a file_id, replace that file (so a retried write does not leave a second
        copy). `created_at`, `expires_at`: on the Redis server's clock (unset: this machine's time, no expiry)."""

    def get(self, file_id: str) -> FileObject | None: ...

    def open(self, file_id: str) -> BinaryIO | None:
        """The content for reading; None when there is no such file."""

    def delete(self, file_id: str) -> bool: ...

    def list(self) -> list[FileObject]:
        """Every file, newest first."""


class LocalFileStore:
    """`<dir>/<id>` holds the content, `<dir>/<id>.json` the FileObject; each is written to a temporary name and
    renamed, and the metadata last, so a file is listed only once its content is whole."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)  # created by the first put: a gateway that stores nothing leaves no trace

    def put(self, data: bytes, filename: str, purpose: str, file_id: str | None = None,
            tenant: str = DEFAULT_TENANT, created_at: int | None = None, expires_at: int | None = None) -> FileObject:
        file_id = file_id or new_file_id()
        self._check(file_id)
        obj = FileObject(file_id, len(data), int(time.time()) if created_at is None else created_at, filename, purpose,
                         expires_at=expires_at, tenant=tenant)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write(self.dir / file_id, data)
        self._write(self._meta(file_id), json.dumps(asdict(obj)).encode())
        return obj

    def get(self, file_id: str) -> FileObject | None:
        if not FILE_ID.match(file_id):
            return None
        try:
            return FileObject.of(json.loads(self._meta(file_id).read_bytes()))
        except FileNotFoundError:
            return None

    def open(self, file_id: str) -> BinaryIO | None:
        if self.get(file_id) is None:
            return None
        try:
            return open(self.dir / file_id, "rb")
        except FileNotFoundError:
            return None

    def delete(self, file_id: str) -> bool:
        if self.get(file_id) is None:
            return False
        self._meta(file_id).unlink(missing_ok=True)  # first: a half-deleted file is no longer listed
        (self.dir / file_id).unlink(missing_ok=True)
        return True

    def list(self) -> list[FileObject]:
        found = [self.get(p.name.removesuffix(".json")) for p in self.dir.glob("file-*.json")]
        return sorted((f for f in found if f is not None), key=lambda f: (f.created_at, f.id), reverse=True)

    def _meta(self, file_id: str) -> Path:
        return self.dir / f"{file_id}.json"

    def _write(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @staticmethod
    def _check(file_id: str) -> None:
        if not FILE_ID.match(file_id):
            raise ValueError(f"file id {file_id!r} must look like file-<letters, digits, _ or ->")
