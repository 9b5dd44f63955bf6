"""`kvgate serve` as a process: flags and KVGATE_API_KEYS configure it, SIGTERM stops it cleanly, and importing
the gateway never imports torch (it runs on the SDK's install plus the gateway extra)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.support import ROOT, free_port



def test_importing_the_gateway_and_its_command_does_not_import_torch():
    code = "import sys, kvgate.gateway, kvgate.commands.serve; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_serve_takes_keys_from_flags_and_env_and_exits_0_on_sigterm(sim_fleet):
    url, ns = sim_fleet
    port = free_port()
    env = {**os.environ, "KVGATE_API_KEYS": "env-key-1,env-key-2"}
    proc = subprocess.Popen([sys.executable, "-m", "kvgate.commands.serve", "--redis-url", url, "--namespace", ns, "--port", str(port),
                             "--api-key", "flag-key", "--log-level", "warning"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{base}/models", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
                time.sleep(0.1)
        for key, status in [("flag-key", 200), ("env-key-2", 200), ("other", 401)]:
            r = httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
            assert r.status_code == status, (key, r.text)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "3 API key(s)" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def serve_settings(*argv: str):
    import argparse

    from kvgate.commands.cli import add_connection_arguments
    from kvgate.commands.serve import add_arguments, settings_from

    parser = argparse.ArgumentParser()
    add_connection_arguments(parser)
    add_arguments(parser)
    return settings_from(parser.parse_args(argv))


def test_api_keys_and_models_come_from_flags_and_the_comma_separated_variable_together(monkeypatch):
    assert serve_settings().api_keys == [] and serve_settings().models == []
    monkeypatch.setenv("KVGATE_API_KEYS", " c, ,a ")
    monkeypatch.setenv("KVGATE_MODELS", "m2")
    s = serve_settings("--api-key", "a", "--api-key", "b", "--model", "m1")
    assert (s.api_keys, s.models) == (["a", "b", "c"], ["m1", "m2"])
    assert serve_settings().api_keys == ["c", "a"]


def test_every_serve_flag_shows_its_default_and_its_variable():
    from kvgate.gateway import GatewaySettings

    text = subprocess.run([sys.executable, "-m", "kvgate.commands.cli", "serve", "--help"], cwd=ROOT, check=True,
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "250"}).stdout
    for name in set(GatewaySettings.model_fields) - {"redis_url", "namespace"}:
        assert f"env KVGATE_{name.upper()}" in text, name
    for flag in ("--api-key", "--model", "--max-backlog", "--retry-after", "--request-timeout", "--default-max-tokens",
                 "--max-n", "--durability", "--files-dir", "--max-file-size", "--batch-window", "--batch-priority",
                 "--batch-lease", "--host", "--port", "--log-level"):
        assert flag in text, flag


def test_a_bad_serve_setting_is_one_line_naming_the_flag_or_the_variable(monkeypatch):
    import pytest

    with pytest.raises(ValueError, match=r"--max-backlog '0': input should be greater than or equal to 1"):
        serve_settings("--max-backlog", "0")
    monkeypatch.setenv("KVGATE_BATCH_PRIORITY", "urgent")
    with pytest.raises(ValueError, match="KVGATE_BATCH_PRIORITY='urgent': not allowed; allowed values: high, normal, low"):
        serve_settings()


def test_batch_flags_and_their_variables_reach_the_settings(monkeypatch):
    monkeypatch.setenv("KVGATE_FILES_DIR", "/data/kvgate-files")
    monkeypatch.setenv("KVGATE_BATCH_LEASE_S", "7.5")
    s = serve_settings("--batch-window", "5", "--max-file-size", "1000", "--batch-priority", "normal")
    assert (s.files_dir, s.batch_lease_s, s.batch_window, s.max_file_bytes, s.batch_priority) == (
        "/data/kvgate-files", 7.5, 5, 1000, "normal")
