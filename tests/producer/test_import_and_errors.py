"""The SDK stays light (no torch) and says clearly when Redis is missing or unreachable."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvgate.producer import Client, ConnectionFailed, KvgateError
from kvgate.producer.connection import mask_url


def test_importing_producer_does_not_import_torch(repo_root):
    code = ("import sys, kvgate.producer, kvgate.producer.client, kvgate.producer.async_client; "
            "assert 'torch' not in sys.modules, 'torch'")
    subprocess.run([sys.executable, "-c", code], cwd=repo_root, check=True)


def test_missing_url_tells_the_user_to_run_kvgate_redis(monkeypatch):
    monkeypatch.delenv("KVGATE_REDIS_URL", raising=False)
    with pytest.raises(KvgateError, match="kvgate redis"):
        Client()


def test_unreachable_redis_raises_connection_failed_with_the_password_masked(unused_port):
    url = f"redis://app:s3cret@127.0.0.1:{unused_port}/0"
    with pytest.raises(ConnectionFailed) as info:
        Client(url)
    assert "s3cret" not in str(info.value) and "app:***@127.0.0.1" in str(info.value)


def test_mask_url_keeps_urls_without_password():
    assert mask_url("redis://localhost:6379/0") == "redis://localhost:6379/0"
    assert mask_url("rediss://:pw@h:1/2") == "rediss://:***@h:1/2"
