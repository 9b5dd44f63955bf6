"""`kvgate top`: one frame rendered to a captured console, and the live view driven in a real tmux terminal."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from kvgate.producer.keys import Keys
from kvgate.producer.queue_stats import read_queue_stats
from kvgate.commands.top import render
from kvgate.worker.heartbeat import write_beat

ROOT = Path(__file__).parents[1]


def _seed(client, keys: Keys) -> None:
    write_beat(client, keys, "gpu-a", {"worker_id": "gpu-a", "running": 7, "free_blocks": 123, "total_blocks": 400,
                                       "block_size": 16, "tokens_per_s": 4321.0, "state": "serving", "jobs_done": 99},
               ttl_s=60)
    for _ in range(12):
        client.xadd(keys.jobs(None, "high"), {"p": b"x"})


def test_one_frame_shows_workers_with_running_jobs_free_kv_and_streams_with_backlog(shared_redis, namespace):
    client, keys = shared_redis.client(), Keys(namespace)
    _seed(client, keys)
    console = Console(record=True, width=140, color_system=None)
    console.print(render(read_queue_stats(client, keys), namespace))
    screen = console.export_text()
    assert "gpu-a" in screen and "123/400" in screen and "4,321" in screen
    high = next(line for line in screen.splitlines() if "high" in line)
    assert "12" in high.split("high", 1)[1]


def test_an_empty_fleet_says_no_live_workers(shared_redis, namespace):
    console = Console(record=True, width=120, color_system=None)
    console.print(render(read_queue_stats(shared_redis.client(), Keys(namespace)), namespace))
    assert "no live workers" in console.export_text()


def test_streams_and_workers_are_grouped_by_model_and_a_model_nobody_serves_is_flagged(shared_redis, namespace):
    client, keys = shared_redis.client(), Keys(namespace)
    client.sadd(keys.models(), "alpha", "gamma")
    client.xadd(keys.jobs("gamma", "low"), {"p": b"x"})
    write_beat(client, keys, "gpu-b", {"worker_id": "gpu-b", "model": "alpha", "models": "alpha,default",
                                       "total_blocks": 10, "block_size": 16, "state": "serving"}, ttl_s=60)
    console = Console(record=True, width=160, color_system=None)
    console.print(render(read_queue_stats(client, keys), namespace))
    lines = console.export_text().splitlines()
    assert any([c.strip() for c in line.split("│")[1:3]] == ["alpha", "gpu-b"] for line in lines), lines
    gamma = next(line for line in lines if "gamma" in line)
    assert "high" in gamma and "waiting for scale-up" in gamma
    assert any("low" in line and " 1 " in line for line in lines[lines.index(gamma):lines.index(gamma) + 3])


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


def _wait_for(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
@pytest.mark.parametrize("key", ["q", "C-c"])
def test_live_view_refreshes_in_a_real_terminal_and_leaves_cleanly(shared_redis, namespace, tmp_path, key):
    client, keys = shared_redis.client(), Keys(namespace)
    _seed(client, keys)
    session, rc_file = f"kvtop-{namespace}-{key}", tmp_path / "rc"
    command = (f"cd {ROOT} && {sys.executable} -m kvgate.commands.cli top --redis-url {shared_redis.url} "
               f"--namespace {namespace} --interval 0.2; echo $? > {rc_file}; sleep 30")
    _tmux("new-session", "-d", "-s", session, "-x", "150", "-y", "40", command)
    try:
        assert _wait_for(lambda: "gpu-a" in _tmux("capture-pane", "-p", "-t", session)), \
            _tmux("capture-pane", "-p", "-t", session)
        client.hset(keys.worker("gpu-a"), "running", 31)
        assert _wait_for(lambda: " 31 " in _tmux("capture-pane", "-p", "-t", session))  # it refreshes
        _tmux("send-keys", "-t", session, key)
        assert _wait_for(rc_file.exists, 10), _tmux("capture-pane", "-p", "-t", session)
        assert rc_file.read_text().strip() == "0"
        assert "Traceback" not in _tmux("capture-pane", "-p", "-t", session)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_one_frame_shows_each_tenants_backlog_running_tokens_and_queue_wait_with_the_rest_as_other(shared_redis,
                                                                                                  namespace):
    """Issue 27's per-tenant view: the busiest ten by name and every other tenant summed; backlog needs fair share."""
    import json

    from kvgate.producer.keys import QUEUE_WAIT_BUCKETS

    client, keys = shared_redis.client(), Keys(namespace)
    row = lambda running, tokens: [running, tokens, 0, 0, 0, 5] + [0] * (len(QUEUE_WAIT_BUCKETS) - 3)  # 10-25 ms
    tenants = {"acme": row(3, 6000)} | {f"t{i}": row(1, i) for i in range(12)}
    write_beat(client, keys, "gpu-a", {"worker_id": "gpu-a", "tenants": json.dumps(tenants)}, ttl_s=60)
    console = Console(record=True, width=140, color_system=None)
    console.print(render(read_queue_stats(client, keys), namespace))
    screen = console.export_text()
    acme = next(line for line in screen.splitlines() if "acme" in line)
    cells = [c.strip() for c in acme.replace("│", "|").split("|") if c.strip()]
    assert cells[:4] == ["acme", "-", "3", "100.0"]  # backlog unknown without fair share, running, tokens/s
    assert "(other tenants)" in screen and "ms" in acme
