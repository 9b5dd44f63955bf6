"""Multi-host Redis URLs (Sentinel, Cluster) with bracketed IPv6 hosts parse on every CPython: current releases
(3.11.12+, 3.12.9+, 3.13.2+, distributions' patched builds) make urllib's `urlsplit` refuse such a netloc, so the
URL code must not hand it to urllib. The strict check is reproduced here, whatever this interpreter is."""
from __future__ import annotations

import urllib.parse

import pytest

from kvgate.producer import cluster, redis_url, urls
from kvgate.producer.cluster import parse_cluster_url
from kvgate.producer.redis_url import parse_sentinel_url
from kvgate.producer.urls import check_url, host_port, mask_url, split_url

SENTINEL = "redis+sentinel://user:s3cret@[::1]:26379,[::1]:26380,host3/mymaster/2?sentinel_password=pw"
CLUSTER = "redis+cluster://:s3cret@[::1]:7000,[fe80::1]:7001,10.0.0.3/?shards=4"
_lenient = urllib.parse.urlsplit


def strict_urlsplit(url, *args, **kwargs):
    """What newer CPythons do with a multi-host netloc holding a bracketed IPv6 host."""
    netloc = _lenient(url, *args, **kwargs).netloc.rpartition("@")[2]
    if "[" in netloc and netloc.count("[") > 1:
        raise ValueError("Invalid IPv6 URL")
    return _lenient(url, *args, **kwargs)


@pytest.fixture
def strict_urllib(monkeypatch):
    monkeypatch.setattr(urllib.parse, "urlsplit", strict_urlsplit)
    for module in (urls, redis_url, cluster):  # where a module imported the name itself
        if hasattr(module, "urlsplit"):
            monkeypatch.setattr(module, "urlsplit", strict_urlsplit)


def test_sentinel_and_cluster_urls_with_ipv6_hosts_parse_where_urllib_refuses_them(strict_urllib):
    with pytest.raises(ValueError, match="Invalid IPv6"):
        urllib.parse.urlsplit(SENTINEL)  # the interpreter's behaviour the fixture reproduces
    assert check_url(SENTINEL) == SENTINEL and check_url(CLUSTER) == CLUSTER
    s = parse_sentinel_url(SENTINEL)
    assert s.sentinels == (("::1", 26379), ("::1", 26380), ("host3", 26379))
    assert (s.service, s.db, s.username, s.password, s.sentinel_password) == ("mymaster", 2, "user", "s3cret", "pw")
    c = parse_cluster_url(CLUSTER)
    assert c.nodes == (("::1", 7000), ("fe80::1", 7001), ("10.0.0.3", 6379)) and c.password == "s3cret"
    assert c.shards == 4


def test_mask_url_hides_passwords_of_multi_host_urls(strict_urllib):
    assert mask_url(SENTINEL) == "redis+sentinel://user:***@[::1]:26379,[::1]:26380,host3/mymaster/2?sentinel_password=***"
    assert mask_url(CLUSTER) == "redis+cluster://:***@[::1]:7000,[fe80::1]:7001,10.0.0.3/?shards=4"
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


@pytest.mark.parametrize("url", ["redis://h:1/0", "rediss://u:p@h/3?x=1#f", "unix:///tmp/r.sock?db=2", SENTINEL,
                                 CLUSTER, "", "no-scheme", "redis://", "localhost:6379", "//h:1/x"])
def test_split_url_agrees_with_urllib_where_urllib_accepts_the_url(url):
    ours, theirs = split_url(url), _lenient(url)
    assert (ours.scheme, ours.netloc, ours.path, ours.query, ours.fragment) == tuple(theirs)
    assert ours.unsplit() == url  # the text it came from, "//" of an empty authority included


@pytest.mark.parametrize("text, expected", [("h:1", ("h", 1)), ("h", ("h", 9)), ("[::1]:2", ("::1", 2)),
                                            ("[::1]", ("::1", 9)), ("[::1", None), ("[::1]x", None), (":5", None),
                                            ("h:x", None)])
def test_host_port_reads_names_ipv4_and_bracketed_ipv6(text, expected):
    assert host_port(text, 9) == expected
