"""An OpenAI-compatible HTTP gateway over the producer SDK: `kvgate serve`.

It enqueues through kvgate.producer.AsyncClient and answers from its reply stream, so it holds no job
state of its own: any number of replicas can run behind a load balancer. Managed batches (/v1/batches) keep
their state in Redis and their files in a file store the replicas share. Starlette + uvicorn, from the
`gateway` extra; importing this package never imports torch.
"""
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .settings import GatewaySettings

__all__ = ["create_app", "GatewaySettings"]


def __getattr__(name: str):
    """The app (Starlette) loads on first use: `kvgate serve`'s flags, derived from GatewaySettings, are built for
    every `kvgate` command, which should not import a web stack for that. The settings load on first use too:
    `kvgate stats` reads the webhook outbox's counts (webhooks/outbox.py) on the SDK's install, without
    pydantic-settings."""
    if name == "GatewaySettings":
        from .settings import GatewaySettings

        return GatewaySettings
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
