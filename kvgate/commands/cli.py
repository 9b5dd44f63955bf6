"""kvgate: asynchronous LLM inference, a fleet of continuous-batching workers behind Redis Streams.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`; those modules
import torch only inside `run`, so SDK commands work on the base install. Every failure is one line on stderr
and a non-zero exit; `--debug` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

DESCRIPTION = "kvgate: asynchronous LLM inference, a fleet of continuous-batching workers behind Redis Streams."
COMMANDS: dict[str, tuple[str, str]] = {
    "redis": ("kvgate.commands.embedded_redis", "start an embedded redis-server and print its URL"),
    "demo": ("kvgate.commands.demo", "embedded Redis + one worker + a few chat prompts, end to end"),
    "worker": ("kvgate.commands.worker", "run a GPU/CPU worker that serves jobs from Redis"),
    "submit": ("kvgate.commands.submit", "submit one prompt and print (or stream) its answer"),
    "get": ("kvgate.commands.get", "print a finished job's result"),
    "cancel": ("kvgate.commands.cancel", "ask the fleet to stop a job"),
    "batch": ("kvgate.commands.batch", "run an OpenAI Batch-format JSONL file through the fleet"),
    "stats": ("kvgate.commands.stats", "backlog, pending and live workers per queue"),
    "models": ("kvgate.commands.models", "list the models the fleet knows; add or remove some (scale from zero)"),
    "loras": ("kvgate.commands.loras", "list the fleet's LoRA adapters; add or remove one (name, folder, base model)"),
    "top": ("kvgate.commands.top", "live terminal view of the fleet"),
    "serve": ("kvgate.commands.serve", "OpenAI-compatible HTTP gateway: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models"),
    "exporter": ("kvgate.commands.exporter", "Prometheus exporter for queue lag, backlog and live workers"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "engine": ("kvgate.bench.engine", "W-CPU / W-GPU: kvgate continuous vs static vs HF transformers"),
    "steps": ("kvgate.bench.steps", "W-CPU once per scheduling policy, every engine step timed; --profile N"),
    "queue": ("kvgate.bench.queue", "W-QUEUE: throughput and per-job overhead through Redis"),
    "host": ("kvgate.bench.host", "W-HOST: host CPU time per engine step by part, beside a baseline commit's engine"),
    "gateway": ("kvgate.bench.gateway", "W-GATEWAY: latency and req/s the HTTP gateway adds over the SDK; --burst N: W-BURST, N requests at once"),
    "fleet": ("kvgate.bench.fleet", "W-FLEET: simulated fleet, capacity admission vs fixed prefetch"),
    "fair": ("kvgate.bench.fair", "W-FAIR: one tenant's flood beside two small tenants, FIFO vs the fair reader"),
    "prefix": ("kvgate.bench.prefix", "W-PREFIX: prefix-affinity lanes vs one shared stream vs an ideal single cache"),
    "structured": ("kvgate.bench.structured", "W-STRUCT: JSON-schema-constrained vs free generation, mask, compile"),
    "durability": ("kvgate.bench.durability", "W-DURABILITY: submit and finish latency with and without WAIT"),
    "scale": ("kvgate.bench.scale", "W-SCALE: a simulated day under KEDA scaling on work vs on job counts vs a constant fleet"),
    "embed": ("kvgate.bench.embed", "W-EMBED: embedding jobs through the queue vs in process, and mixed with generation"),
    "lora": ("kvgate.bench.lora", "W-LORA (engine): W-CPU's requests over 8 rank-16 adapters vs the base model, one run"),
}
NEEDS_REDIS = {"worker", "submit", "get", "cancel", "batch", "stats", "models", "loras", "top", "exporter"}
SUBMITS = {"submit", "batch"}  # commands that enqueue jobs, so take --tenant


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line: what was wrong and where to read more."""

    def error(self, message: str) -> None:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """Every command talks to one Redis namespace; flags win over KVGATE_* variables."""
    from kvgate.producer.connection import DEFAULT_URL

    parser.add_argument("--redis-url", default=None,
                        help=f"redis://, rediss:// or unix:// URL (env KVGATE_REDIS_URL; default {DEFAULT_URL})")
    parser.add_argument("--namespace", default=os.environ.get("KVGATE_NAMESPACE", "kvgate"),
                        help="key prefix (env KVGATE_NAMESPACE; default kvgate)")
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks instead of one-line errors")


def add_tenant_argument(parser: argparse.ArgumentParser) -> None:
    """Commands that submit jobs record whose they are (the gateway takes it from the API key instead)."""
    from kvgate.producer.protocol import ProtocolError, check_tenant_name

    def tenant(text: str) -> str:
        try:
            return check_tenant_name(text)
        except ProtocolError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parser.add_argument("--tenant", type=tenant, default=os.environ.get("KVGATE_TENANT") or None,
                        help="the tenant every job is recorded under (env KVGATE_TENANT; default: none, which "
                             "fair share and quotas count as 'default')")


def _register(subparsers, table: dict[str, tuple[str, str]], dest: str) -> None:
    for name, (module_name, help_text) in table.items():
        parser = subparsers.add_parser(name, help=help_text, description=help_text)
        add_connection_arguments(parser)
        if table is COMMANDS and name in SUBMITS:
            add_tenant_argument(parser)
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:  # a command whose extra is not installed still shows in --help
            parser.set_defaults(**{dest: None, "_missing": f"{module_name}: {e}"})
            continue
        module.add_arguments(parser)
        parser.set_defaults(**{dest: module.run, "_prog": parser.prog})


def build_parser() -> argparse.ArgumentParser:
    from kvgate import __version__

    parser = Parser(prog="kvgate", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"kvgate {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _register(sub, COMMANDS, "_run")
    bench = sub.add_parser("bench", help="standard benchmark workloads (see BENCHMARKS.md)")
    _register(bench.add_subparsers(dest="bench", required=True, metavar="WORKLOAD"), BENCHES, "_run")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # argparse would blame `kvgate`; the flag belongs to the subcommand's help
        Parser(prog=getattr(args, "_prog", "kvgate")).error(f"unrecognized arguments: {' '.join(extra)}")
    name = f"kvgate {args.command}" + (f" {args.bench}" if getattr(args, "bench", None) else "")
    if args._run is None:
        extra = "gateway" if args.command == "serve" else "worker"
        print(f"{name}: not available in this install ({args._missing}); "
              f"install the {extra} extra: pip install 'kvgate[{extra}]'", file=sys.stderr)
        return 2
    try:
        if args.command in NEEDS_REDIS:
            from kvgate.producer.connection import DEFAULT_URL, resolve_url

            args.redis_url = resolve_url(args.redis_url, DEFAULT_URL)
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if args.debug:
            raise
        from kvgate.commands.cli_errors import describe, exit_code

        print(f"{name}: {describe(e, getattr(args, 'redis_url', None))}", file=sys.stderr)
        return exit_code(e)


if __name__ == "__main__":
    sys.exit(main())
