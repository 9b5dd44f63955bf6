"""Redis URLs split without urllib's netloc checks: a Sentinel or Cluster URL lists several hosts
(`redis+sentinel://[::1]:26379,[::1]:26380/mymaster`), which current CPython releases (3.11.12+, 3.12.9+, 3.13.2+
and distributions' patched builds) refuse in `urlsplit` as an invalid IPv6 netloc. The split is RFC 3986's
(appendix B): scheme, authority, path, query, fragment, with no opinion on what the authority holds. The Redis URL's
own rules (its schemes, the environment variable and default, a password masked for logs) live here too."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

_URL = re.compile(r"^(?:(?P<scheme>[^:/?#]+):)?(?://(?P<netloc>[^/?#]*))?(?P<path>[^?#]*)"
                  r"(?:\?(?P<query>[^#]*))?(?:#(?P<fragment>.*))?$", re.S)


@dataclass(frozen=True, slots=True)
class UrlParts:
    scheme: str
    netloc: str
    path: str
    query: str
    fragment: str
    authority: bool = True  # the URL has `//` (an authority, maybe empty): `unix:///x` has one, `host:6379` none

    @property
    def userinfo(self) -> str:
        return self.netloc.rpartition("@")[0]

    @property
    def hosts(self) -> list[str]:
        """Each host[:port] of the authority, in order (one for a plain URL, several for Sentinel and Cluster)."""
        return [h for h in self.netloc.rpartition("@")[2].split(",") if h]

    def replace(self, **changes: str) -> UrlParts:
        return replace(self, **changes)

    def unsplit(self) -> str:
        return (f"{self.scheme}:" if self.scheme else "") + (f"//{self.netloc}" if self.authority else "") \
            + self.path + (f"?{self.query}" if self.query else "") + (f"#{self.fragment}" if self.fragment else "")


def split_url(url: str) -> UrlParts:
    m = _URL.match(url)  # the pattern matches any string
    return UrlParts(*(m.group(name) or "" for name in ("scheme", "netloc", "path", "query", "fragment")),
                    authority=m.group("netloc") is not None)


def host_port(text: str, default_port: int) -> tuple[str, int] | None:
    """`host:port`, `host`, `[v6]:port` or `[v6]` as (host, port) with the brackets removed; None if malformed."""
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            return None
        port = rest[1:]
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host or (port and not port.isdigit()):
        return None
    return host, int(port) if port else default_port


# ---- the Redis URL, as producers, workers and every command take it ----------------------------------------------
URL_ENV = "KVGATE_REDIS_URL"
DEFAULT_URL = "redis://127.0.0.1:6379/0"  # the default of the worker and every `kvgate` command; never the SDK's


URL_SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel",  # Sentinel: producer/redis_url.py
               "redis+cluster", "rediss+cluster")  # Redis Cluster: producer/cluster.py


def check_url(url: str) -> str:
    if split_url(url).scheme not in URL_SCHEMES:
        raise ValueError(f"Redis URL {mask_url(url)!r} must start with redis://, rediss://, unix://, "
                         f"redis+sentinel:// or redis+cluster:// (for example {DEFAULT_URL})")
    return url


def mask_url(url: str) -> str:
    """The URL with its password replaced by ***, fit for messages and logs."""
    parts = split_url(url)
    # the query may carry a Sentinel's own password (redis+sentinel://...?sentinel_password=...)
    query = re.sub(r"(password=)[^&]*", r"\1***", parts.query)
    userinfo, at, hosts = parts.netloc.rpartition("@")  # a Sentinel URL lists several host:port, so no .port
    if ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":***"
    return parts.replace(netloc=f"{userinfo}{at}{hosts}", query=query).unsplit()
