"""`kvgate serve`: the OpenAI-compatible HTTP gateway (POST /v1/chat/completions, /v1/completions, GET /v1/models,
/v1/files, /v1/batches).

Run as many replicas as you like behind a load balancer; each enqueues through the SDK and answers from its own
reply stream. Batches keep their state in Redis and their files in the file store, which replicas must share
(--files-dir on a shared volume). Needs the gateway extra: pip install 'kvgate[gateway]'.
"""
from __future__ import annotations

import argparse
import signal
import sys


from kvgate.commands.flags import add_settings_arguments, settings_of
from kvgate.gateway.settings import GatewaySettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # --redis-url and --namespace come with every command (kvgate/commands/cli.py)
    add_settings_arguments(parser, GatewaySettings, skip={"redis_url", "namespace"})


def settings_from(args: argparse.Namespace) -> GatewaySettings:
    return settings_of(args, GatewaySettings)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from kvgate.gateway import create_app
    except ImportError as e:
        print(f"kvgate serve: {e}; install the gateway extra: pip install 'kvgate[gateway]'", file=sys.stderr)
        return 2

    settings = settings_from(args)
    table = settings.api_key_table()
    keys = "open (no API key)" if table.open else (f"{len(table.tenants)} API key(s) of {table.tenant_count()} "
                                                   f"tenant(s), {len(table.admins)} admin key(s)")
    print(f"kvgate serve: http://{settings.host}:{settings.port}/v1 -> namespace {settings.namespace!r}, {keys}",
          flush=True)
    # uvicorn drains on SIGTERM, then re-raises it to the handler it found: make that one a no-op so a graceful
    # stop (Kubernetes, systemd) exits 0 instead of dying by the signal after the drain
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
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
