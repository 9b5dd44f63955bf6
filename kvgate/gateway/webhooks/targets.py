"""Where each tenant's webhook events go: the gateway's --webhook-url and --webhook-secret, or a tenant's own pair from
--webhooks-file (TOML, as the quotas file):

    [tenants.team-a]
    url = "https://hooks.team-a.example/kvgate"
    secret = "whsec_..."

Every URL is checked when it is read: http or https; a host whose addresses (every one it resolves to) are
private, loopback, link-local or otherwise not global is refused unless the operator allows private receivers
(--webhook-allow-private); a URL that points at the gateway itself (its own listen address and port) is refused
always. Deliveries check the URL again (sender.py): a name may resolve elsewhere later; and each delivery connects to
an address that check approved (`route`), never to what the name resolves to a moment later (DNS rebinding).
"""
from __future__ import annotations

import base64
import binascii
import ipaddress
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from kvgate.producer.protocol import ProtocolError, check_tenant_name

SECRET_PREFIX = "whsec_"
DOCS = "see docs/webhooks.md"
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def check_secret(secret: str, what: str) -> str:
    """A Standard Webhooks secret: whsec_ and base64 of the key's bytes."""
    try:
        key = base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True) if secret.startswith(
            SECRET_PREFIX) else b""
    except (binascii.Error, ValueError):
        key = b""
    if len(key) < 16:
        raise ValueError(f"{what} must be whsec_ followed by the base64 of 16 to 64 random bytes (Standard Webhooks), "
                         "e.g. python -c \"import base64,os;print('whsec_'+base64.b64encode(os.urandom(32)).decode())\""
                         f"; {DOCS}")
    return secret


def _addresses(host: str, port: int) -> list[Address]:
    try:
        return [ipaddress.ip_address(host.split("%")[0])]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except OSError as e:
        raise ValueError(f"its host {host!r} does not resolve ({e})") from None
    return list(dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos))


def _private(a: Address) -> bool:
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    return not a.is_global or a.is_loopback or a.is_link_local or a.is_private or a.is_multicast


@dataclass(frozen=True, slots=True)
class Listen:
    """Where the gateway itself listens: a webhook URL there would call the gateway."""

    host: str
    port: int

    def points_here(self, addresses: list[Address], port: int) -> bool:
        if port != self.port:
            return False
        mine = _addresses(self.host, self.port)
        anywhere = any(a.is_unspecified for a in mine)  # 0.0.0.0 or ::: every local address, loopback among them
        return any(a in mine or a.is_unspecified or (anywhere and a.is_loopback) or (anywhere and _local(a))
                   for a in addresses)


def _local(a: Address) -> bool:
    try:
        return str(a) in socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        return False


def check_url(url: str, what: str, allow_private: bool, listen: Listen | None) -> str:
    """The URL, or ValueError naming `what` (the flag or the file entry), the value and what to do."""
    _checked_addresses(url, what, allow_private, listen)
    return url


@dataclass(frozen=True, slots=True)
class Route:
    """How one delivery reaches a checked URL: `url` names the address the check approved instead of the host, so
    the connection goes where the check looked (a name that resolves elsewhere a moment later, DNS rebinding, changes
    nothing); the host travels in the Host header and, over https, in TLS's SNI and certificate check
    (`extensions`, httpx's sni_hostname)."""

    url: str
    headers: dict[str, str]
    extensions: dict[str, str]


def route(url: str, what: str, allow_private: bool, listen: Listen | None) -> Route:
    """check_url's checks, then the Route to the first address they approved."""
    parts = urlsplit(url)
    address = _checked_addresses(url, what, allow_private, listen)[0]
    host = f"[{address}]" if address.version == 6 else str(address)
    port = f":{parts.port}" if parts.port is not None else ""
    userinfo = parts.netloc.rpartition("@")[0]
    pinned = parts._replace(netloc=f"{userinfo}@{host}{port}" if userinfo else f"{host}{port}").geturl()
    named = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    return Route(pinned, {"host": f"{named}{port}"}, extensions)


def _checked_addresses(url: str, what: str, allow_private: bool, listen: Listen | None) -> list[Address]:
    """Every address the URL's host resolves to, each one allowed; else ValueError as check_url's."""
    def refuse(why: str) -> ValueError:
        return ValueError(f"{what} {url!r}: {why}; {DOCS}")

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise refuse("must be an http:// or https:// URL with a host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        addresses = _addresses(parts.hostname, port)
    except ValueError as e:
        raise refuse(str(e)) from None
    if listen is not None and listen.points_here(addresses, port):
        raise refuse(f"points at this gateway itself ({listen.host}:{listen.port}): give the receiver's own URL")
    bad = [str(a) for a in addresses if _private(a)]
    if bad and not allow_private:
        raise refuse(f"resolves to {', '.join(bad)}, a private, loopback or link-local address: webhooks go to public "
                     "receivers unless the operator allows private ones with --webhook-allow-private "
                     "(KVGATE_WEBHOOK_ALLOW_PRIVATE=1), for receivers on premises")
    return addresses


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    secret: str = field(repr=False)


@dataclass(frozen=True, slots=True)
class Targets:
    """Each tenant's receiver: its own, else the gateway's (None: no events for it)."""

    default: Target | None = None
    tenants: dict[str, Target] = field(default_factory=dict)

    @property
    def any(self) -> bool:
        return self.default is not None or bool(self.tenants)

    def of(self, tenant: str) -> Target | None:
        return self.tenants.get(tenant, self.default)

    def check(self, allow_private: bool, listen: Listen | None) -> None:
        """Every URL checked afresh (sender.py before each delivery: a name may resolve elsewhere now)."""
        for name, t in [("--webhook-url", self.default), *self.tenants.items()]:
            if t is not None:
                check_url(t.url, name, allow_private, listen)


def read_targets(path: str | Path, default: Target | None, allow_private: bool, listen: Listen | None) -> Targets:
    """The file's tenants over the gateway's default; ValueError names the file, the entry and what is wrong."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"webhooks file {path}: {e}; {DOCS}") from None
    unknown = set(data) - {"tenants"}
    if unknown or not isinstance(data.get("tenants", {}), dict):
        raise ValueError(f"webhooks file {path}: only [tenants.NAME] tables are read, got {sorted(unknown) or data}; "
                         f"{DOCS}")
    tenants = {}
    for name, entry in data.get("tenants", {}).items():
        where = f"webhooks file {path}: [tenants.{name}]"
        try:
            check_tenant_name(name)
        except ProtocolError as e:
            raise ValueError(f"{where}: {e}") from None
        if not isinstance(entry, dict) or set(entry) != {"url", "secret"} or not all(
                isinstance(v, str) for v in entry.values()):
            raise ValueError(f"{where} must hold exactly url and secret, both strings; {DOCS}")
        tenants[name] = Target(check_url(entry["url"], f"{where} url", allow_private, listen),
                               check_secret(entry["secret"], f"{where} secret"))
    return Targets(default, tenants)
