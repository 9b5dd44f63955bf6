"""Who calls: `Authorization: Bearer <key>` names an API key, and the key names its tenant.

Keys come from --api-key (`KEY` or `KEY=TENANT`, repeatable), --api-keys-file (the same, one a line) and
--admin-key (a key that sees every tenant's files and batches). With no key at all the gateway is open and every
caller is the tenant `default`. A key is kept only as its SHA-256 digest, looked up in a dict: the time a lookup
takes does not tell how much of a key matched, and no message or log line can show one.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from starlette.requests import Request

from kvgate.producer.limits import DEFAULT_TENANT
from kvgate.producer.protocol import ProtocolError, check_tenant_name

from .errors import ApiError

ADMIN_TENANT = "admin"  # the tenant of what an admin key itself uploads or submits; no other key may take it


@dataclass(frozen=True, slots=True)
class Caller:
    """The tenant a request acts for; an admin sees every tenant's files and batches."""

    tenant: str
    admin: bool = False

    def sees(self, tenant: str) -> bool:
        return self.admin or tenant == self.tenant


OPEN = Caller(DEFAULT_TENANT)


@dataclass(slots=True)
class ApiKeys:
    """The gateway's keys: digest -> tenant, and the admin keys' digests."""

    tenants: dict[bytes, str] = field(default_factory=dict)
    admins: set[bytes] = field(default_factory=set)

    @classmethod
    def of(cls, api_keys: list[str], keys_file: str | None, admin_keys: list[str]) -> "ApiKeys":
        """Read every entry; a bad one raises ValueError naming where it was (never the key)."""
        keys = cls()
        entries = [(f"--api-key entry {n}", e) for n, e in enumerate(api_keys, start=1)]
        if keys_file is not None:
            entries += [(f"line {n} of --api-keys-file {keys_file}", line) for n, line in _lines(keys_file)]
        for where, entry in entries:
            key, tenant = parse_entry(entry, where)
            digest = _digest(key)
            if keys.tenants.setdefault(digest, tenant) != tenant:
                raise ValueError(f"{where}: this API key is also given for another tenant ({keys.tenants[digest]!r}), "
                                 f"so it would belong to two tenants; give each key one tenant")
        for n, key in enumerate(admin_keys, start=1):
            _check_key(key, f"--admin-key entry {n}")
            if _digest(key) in keys.tenants:
                raise ValueError(f"--admin-key entry {n}: this key is also a tenant's API key; an admin key must be a "
                                 "key of its own")
            keys.admins.add(_digest(key))
        return keys

    @property
    def open(self) -> bool:
        return not self.tenants and not self.admins

    def tenant_count(self) -> int:
        return len(set(self.tenants.values()))

    def caller(self, request: Request) -> Caller:
        """The caller a request's key names; 401 in OpenAI's shape when it names none."""
        if self.open:
            return OPEN
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "missing API key: send it as `Authorization: Bearer <key>`", code="invalid_api_key")
        digest = _digest(token.strip())
        if digest in self.admins:
            return Caller(ADMIN_TENANT, admin=True)
        tenant = self.tenants.get(digest)
        if tenant is None:
            raise ApiError(401, "the API key sent is not one this gateway accepts; check it against the keys the "
                                "gateway was started with (--api-key, --api-keys-file, --admin-key)",
                           code="invalid_api_key")
        return Caller(tenant)


def parse_entry(entry: str, where: str) -> tuple[str, str]:
    """`KEY=TENANT`, or a bare `KEY` (tenant `default`). The tenant is what follows the last `=`; a key that ends in
    `=` (base64 padding) is a bare key."""
    key, eq, tenant = entry.strip().rpartition("=")
    if not eq or not tenant.strip():
        key, tenant = entry.strip(), DEFAULT_TENANT
    key, tenant = key.strip(), tenant.strip()
    _check_key(key, where)
    try:
        check_tenant_name(tenant)
    except ProtocolError as e:
        raise ValueError(f"{where}: {e}") from None
    if tenant == ADMIN_TENANT:
        raise ValueError(f"{where}: the tenant name {ADMIN_TENANT!r} is the admin key's own; give --admin-key for a "
                         "key that sees every tenant, or name the tenant otherwise")
    return key, tenant


def _check_key(key: str, where: str) -> None:
    if not key or any(c.isspace() for c in key) or not key.isprintable():
        raise ValueError(f"{where}: an API key must be non-empty, printable, with no whitespace")


def _lines(path: str) -> list[tuple[int, str]]:
    """The entries of a keys file with their line numbers: `#` starts a comment line, blank lines are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--api-keys-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-keys-file {path}: cannot be read as UTF-8 text ({type(e).__name__})") from None
    return [(n, line) for n, line in enumerate(text.splitlines(), start=1)
            if line.strip() and not line.lstrip().startswith("#")]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
