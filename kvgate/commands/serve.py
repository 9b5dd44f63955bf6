"""`kvgate serve`: the OpenAI-compatible HTTP gateway (POST /v1/chat/completions, /v1/completions, GET /v1/models,
/v1/files, /v1/batches).

Run as many replicas as you like behind a load balancer; each enqueues through the SDK and answers from its own
reply stream. Batches keep their state in Redis and their files in the file store, which replicas must share
(--files-dir on a shared volume). Needs the gateway extra: pip install 'kvgate[gateway]'.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--host", default=os.environ.get("KVGATE_HOST", "127.0.0.1"), help="address to bind (env KVGATE_HOST)")
    add("--port", type=int, default=int(os.environ.get("KVGATE_PORT", "8000")), help="port (env KVGATE_PORT)")
    add("--api-key", action="append", dest="api_key", metavar="KEY",
        help="accept `Authorization: Bearer KEY`; repeatable, joined with env KVGATE_API_KEYS (comma-separated); "
             "no key at all leaves the gateway open")
    add("--model", action="append", dest="model", metavar="NAME",
        help="accept requests for this model even before any worker serves it (scale from zero); repeatable, "
             "joined with env KVGATE_MODELS (comma-separated). With none, the gateway accepts the models live "
             "workers serve and those the fleet knows ({ns}:models); with some, only these and live ones")
    add("--max-backlog", type=int, help="answer 429 while this many jobs wait in the queue (default: no limit)")
    add("--retry-after", type=int, default=1, help="seconds a 429's Retry-After asks clients to wait")
    add("--request-timeout", type=float, default=600.0, help="seconds before an unanswered job is cancelled (504)")
    add("--default-max-tokens", type=int, default=512, help="max_tokens when a request gives none")
    add("--max-n", type=int, default=16, help="most choices (n times prompts) in one request")
    add("--durability", choices=("primary", "replicated"), default=os.environ.get("KVGATE_DURABILITY", "primary"),
        help="replicated: a request is enqueued only once a replica holds it, resent across a failover "
             "(RELIABILITY.md, Failover; env KVGATE_DURABILITY)")
    add("--files-dir", default=os.environ.get("KVGATE_FILES_DIR"),
        help="where /v1/files and batch outputs are stored (env KVGATE_FILES_DIR; default "
             "$XDG_DATA_HOME/kvgate/files or ~/.local/share/kvgate/files); replicas must share it")
    add("--max-file-size", type=int, default=200 * 1024 * 1024, help="largest upload to /v1/files, in bytes")
    add("--batch-window", type=int, default=256, help="jobs of one batch queued or running at a time")
    add("--batch-priority", choices=("high", "normal", "low"), default="low", help="queue for batch jobs")
    add("--batch-lease", type=float, default=float(os.environ.get("KVGATE_BATCH_LEASE_S", "30")),
        help="seconds after which another replica resumes the batches of a replica that died "
             "(env KVGATE_BATCH_LEASE_S)")
    add("--log-level", default="info")


def settings_from(args: argparse.Namespace):
    from kvgate.gateway import GatewaySettings
    from kvgate.gateway.auth import parse_keys

    return GatewaySettings(redis_url=args.redis_url, namespace=args.namespace,
                           api_keys=parse_keys(args.api_key, os.environ.get("KVGATE_API_KEYS")),
                           max_backlog=args.max_backlog, retry_after_s=args.retry_after,
                           request_timeout_s=args.request_timeout, default_max_tokens=args.default_max_tokens,
                           max_n=args.max_n, models=allowed_models(args.model, os.environ.get("KVGATE_MODELS")),
                           durability=args.durability,

                           files_dir=args.files_dir, max_file_bytes=args.max_file_size,
                           batch_window=args.batch_window, batch_priority=args.batch_priority,
                           batch_lease_s=args.batch_lease)


def allowed_models(flags: list[str] | None, env: str | None) -> tuple[str, ...]:
    from kvgate.producer.protocol import check_model_name

    names = [n.strip() for v in [*(flags or []), env or ""] for n in v.split(",") if n.strip()]
    return tuple(dict.fromkeys(check_model_name(n) for n in names))


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from kvgate.gateway import create_app
    except ImportError as e:
        print(f"kvgate serve: {e}; install the gateway extra: pip install 'kvgate[gateway]'", file=sys.stderr)
        return 2

    settings = settings_from(args)
    keys = f"{len(settings.api_keys)} API key(s)" if settings.api_keys else "open (no API key)"
    print(f"kvgate serve: http://{args.host}:{args.port}/v1 -> namespace {settings.namespace!r}, {keys}", flush=True)
    # uvicorn drains on SIGTERM, then re-raises it to the handler it found: make that one a no-op so a graceful
    # stop (Kubernetes, systemd) exits 0 instead of dying by the signal after the drain
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=30)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m kvgate.commands.serve ...`, the same command without going through kvgate/commands/cli.py."""
    from kvgate.commands.cli import add_connection_arguments

    parser = argparse.ArgumentParser(prog="kvgate serve", description=__doc__.splitlines()[0])
    add_connection_arguments(parser)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
