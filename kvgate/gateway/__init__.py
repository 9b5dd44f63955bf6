"""An OpenAI-compatible HTTP gateway over the producer SDK: `kvgate serve`.

It enqueues through kvgate.producer.AsyncClient and answers from its reply stream, so it holds no job
state of its own: any number of replicas can run behind a load balancer. Managed batches (/v1/batches) keep
their state in Redis and their files in a file store the replicas share. Starlette + uvicorn, from the
`gateway` extra; importing this package never imports torch.
"""
from .app import create_app
from .settings import GatewaySettings

__all__ = ["create_app", "GatewaySettings"]
