"""The fleet a gateway benchmark measures (W-GATEWAY, gateway.py, and W-BURST, burst.py): one `kvgate worker
--simulated` and one `kvgate serve` on one Redis, as the processes they are in production, and the CPU a process has
spent, read from outside it."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from kvgate.redis_server import free_port


class Fleet:
    """The worker and the gateway, as the processes they are in production."""

    def __init__(self, url: str, ns: str, args: argparse.Namespace, serve_args: list[str] = (),
                 max_num_seqs: int = 64):
        self.common = ["--redis-url", url, "--namespace", ns]
        self.args, self.serve_args, self.max_num_seqs = args, list(serve_args), max_num_seqs
        self.port = args.port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Fleet":
        worker = ["worker", *self.common, "--simulated", "--sim-step-ms", str(self.args.sim_step_ms),
                  "--sim-per-token-ms", "0.01", "--max-num-seqs", str(self.max_num_seqs), "--worker-id",
                  "bench-gw-worker"]
        self.procs.append(subprocess.Popen([sys.executable, "-m", "kvgate.commands.cli", *worker]))
        serve = [*self.common, "--port", str(self.port), "--log-level", "warning", *self.serve_args]
        self.gateway = subprocess.Popen([sys.executable, "-m", "kvgate.commands.serve", *serve])
        self.procs.append(self.gateway)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self, timeout: float = 120.0) -> None:
        """Until the gateway answers and lists the worker's model (its heartbeat is up)."""
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            try:
                models = httpx.get(f"{self.base_url}/models", timeout=2).json().get("data") or []
                if any(m.get("live_workers") for m in models):  # an allowed model (--model) is listed without one
                    return
            except httpx.TransportError:
                pass
            dead = [p.args for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway or worker did not come up: exited {dead}" if dead else
                                   f"the gateway or worker did not come up within {timeout:g} s")
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU of a process so far (Linux /proc); None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
