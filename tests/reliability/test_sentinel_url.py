"""The redis+sentinel:// URL: what it means, what it refuses (by name), and that logs never show either password."""
from __future__ import annotations

import pytest

from kvgate.producer.urls import check_url, mask_url
from kvgate.producer.redis_url import Durability, NotReplicated, SentinelUrl, parse_sentinel_url


def test_a_sentinel_url_names_the_sentinels_the_service_the_db_and_two_separate_credentials():
    url = ("redis+sentinel://app:node%20pw@10.0.0.1:26379,10.0.0.2,[::1]:26380/mymaster/3"
           "?sentinel_username=watch&sentinel_password=s3cret")
    assert parse_sentinel_url(check_url(url)) == SentinelUrl(
        (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("::1", 26380)), "mymaster", 3, "app", "node pw", "watch", "s3cret")


def test_the_tls_form_and_the_defaults():
    s = parse_sentinel_url("rediss+sentinel://h:1/svc")
    assert (s.db, s.username, s.password, s.sentinel_password, s.ssl) == (0, None, None, None, True)
    assert s.node_kwargs()["ssl"] is True


@pytest.mark.parametrize("url, says", [
    ("redis+sentinel:///mymaster", "names no sentinel"),
    ("redis+sentinel://h:26379", "needs the monitored service name"),
    ("redis+sentinel://h:26379/mymaster/x", "db 'x' must be a number"),
    ("redis+sentinel://h:port/mymaster", "'h:port' is not host:port"),
    ("redis+sentinel://h/mymaster?password=x", "unknown option 'password'"),
])
def test_a_malformed_sentinel_url_is_refused_with_what_is_wrong(url, says):
    with pytest.raises(ValueError, match=says):
        parse_sentinel_url(url)


def test_masking_hides_the_node_password_and_the_sentinel_password():
    shown = mask_url("redis+sentinel://app:nodepw@h1:26379,h2:26379/m/0?sentinel_password=sentpw")
    assert "nodepw" not in shown and "sentpw" not in shown
    assert shown == "redis+sentinel://app:***@h1:26379,h2:26379/m/0?sentinel_password=***"
    assert mask_url("redis://:pw@[::1]:6379/0") == "redis://:***@[::1]:6379/0"  # the single-host form, as before


def test_another_scheme_is_refused_naming_the_sentinel_form():
    with pytest.raises(ValueError, match=r"redis\+sentinel://"):
        check_url("sentinel://h:26379/m")


def test_replicated_durability_refuses_fewer_replicas_than_asked():
    d = Durability("replicated", 1, 50)
    d.check(1)
    with pytest.raises(NotReplicated, match="0 of 1 replicas acknowledged within 50 ms"):
        d.check(0)
    with pytest.raises(ValueError, match="allowed values: primary, replicated"):
        Durability("quorum")
