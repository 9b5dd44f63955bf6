"""Webhooks: batch and background-response events signed as Standard Webhooks, delivered at least once from an
outbox in Redis (outbox.py) by every gateway (sender.py), to URLs checked when they are read (targets.py)."""
