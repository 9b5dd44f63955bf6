"""The worker's metrics where prometheus-client is absent (or a benchmark wants none): every call does nothing."""
from __future__ import annotations


class NullMetrics:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def make_metrics(worker_id: str, model: str):
    try:
        from kvgate.worker.metrics import WorkerMetrics
    except ImportError:
        return NullMetrics()
    return WorkerMetrics(worker_id, model)
