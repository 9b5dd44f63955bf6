"""The `kvgate` command. Each subcommand lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`; those modules import torch only inside `run`, so SDK commands work on the base install."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "redis": ("kvgate.worker.embedded_redis", "start an embedded redis-server and print its URL"),
    "demo": ("kvgate.demo", "embedded Redis + one worker + a few chat prompts, end to end"),
    "worker": ("kvgate.worker.main", "run a GPU/CPU worker that serves jobs from Redis"),
    "submit": ("kvgate.producer.commands.submit", "submit one prompt and print (or stream) its answer"),
    "batch": ("kvgate.producer.commands.batch", "run an OpenAI Batch-format JSONL file through the fleet"),
    "stats": ("kvgate.producer.commands.stats", "backlog, pending and live workers per queue"),
    "top": ("kvgate.top", "live terminal view of the fleet"),
    "serve": ("kvgate.serve", "OpenAI-compatible HTTP gateway: /v1/chat/completions, /v1/completions, /v1/models"),
    "exporter": ("kvgate.exporter", "Prometheus exporter for queue lag, backlog and live workers"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "engine": ("kvgate.bench.engine", "W-CPU / W-GPU: kvgate continuous vs static vs HF transformers"),
    "steps": ("kvgate.bench.steps", "W-CPU once per scheduling policy, every engine step timed; --profile N"),
    "queue": ("kvgate.bench.queue", "W-QUEUE: throughput and per-job overhead through Redis"),
    "gateway": ("kvgate.bench.gateway", "W-GATEWAY: latency and req/s the HTTP gateway adds over the SDK"),
    "fleet": ("kvgate.bench.fleet", "W-FLEET: simulated fleet, capacity admission vs fixed prefetch"),
}


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """Every command talks to one Redis namespace; flags win over KVGATE_* variables."""
    parser.add_argument("--redis-url", default=os.environ.get("KVGATE_REDIS_URL"),
                        help="redis://, rediss:// or unix:// URL (env KVGATE_REDIS_URL)")
    parser.add_argument("--namespace", default=os.environ.get("KVGATE_NAMESPACE", "kvgate"),
                        help="key prefix (env KVGATE_NAMESPACE, default kvgate)")


def _register(subparsers, table: dict[str, tuple[str, str]], dest: str) -> None:
    for name, (module_name, help_text) in table.items():
        parser = subparsers.add_parser(name, help=help_text, description=help_text)
        add_connection_arguments(parser)
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:  # a command whose extra is not installed still shows in --help
            parser.set_defaults(**{dest: None, "_missing": f"{module_name}: {e}"})
            continue
        module.add_arguments(parser)
        parser.set_defaults(**{dest: module.run})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _register(sub, COMMANDS, "_run")
    bench = sub.add_parser("bench", help="standard benchmark workloads (see BENCHMARKS.md)")
    _register(bench.add_subparsers(dest="bench", required=True), BENCHES, "_run")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args._run is None:
        print(f"kvgate {args.command}: not available in this install ({args._missing}); "
              "install the worker extra: pip install 'kvgate[worker]'", file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
