"""What one gateway process is configured with; flags and KVGATE_* variables fill it (see kvgate/serve.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class GatewaySettings:
    redis_url: str | None = None
    namespace: str = "kvgate"
    api_keys: tuple[str, ...] = ()  # none: the gateway is open
    max_backlog: int | None = None  # refuse new jobs with a 429 while the queue holds this many
    retry_after_s: int = 1  # the Retry-After a 429 carries
    request_timeout_s: float = 600.0  # a job with no answer by then is cancelled and answered 504
    default_max_tokens: int = 512  # when a request gives neither max_tokens nor max_completion_tokens
    models_cache_s: float = 2.0  # how long the list of live workers' models is reused
    models: tuple[str, ...] = ()  # allowed models; none: any model a live worker serves or {ns}:models knows
    max_n: int = 16  # choices (n) times prompts one request may ask for
    durability: str = "primary"  # or "replicated": the SDK's, see RELIABILITY.md (Failover)
    files_dir: str | None = None  # the local file store; None: file_store.default_files_dir()
    max_file_bytes: int = 200 * 1024 * 1024  # largest upload to /v1/files (OpenAI's batch limit)
    batch_window: int = 256  # jobs of one batch in the queue or running at a time: batches never flood the fleet
    batch_priority: str = "low"  # so interactive requests go first
    batch_lease_s: float = 30.0  # a dead replica's batches are resumed by another after this long
    batch_poll_s: float = 1.0  # how often a replica looks for batches nobody drives

    def __post_init__(self):
        if self.max_backlog is not None and self.max_backlog < 1:
            raise ValueError(f"max_backlog={self.max_backlog} must be at least 1, or None for no limit")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens={self.default_max_tokens} must be at least 1")
        if self.durability not in ("primary", "replicated"):
            raise ValueError(f"durability={self.durability!r}: allowed values: primary, replicated")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s={self.request_timeout_s} must be positive")
        if self.max_file_bytes < 1 or self.batch_window < 1:
            raise ValueError(f"max_file_bytes={self.max_file_bytes} and batch_window={self.batch_window} must be "
                             "at least 1")
        if self.batch_priority not in ("high", "normal", "low"):
            raise ValueError(f"batch_priority={self.batch_priority!r} must be high, normal or low")
        if self.batch_lease_s <= 0 or self.batch_poll_s <= 0:
            raise ValueError(f"batch_lease_s={self.batch_lease_s} and batch_poll_s={self.batch_poll_s} must be "
                             "positive")
        if any(not k or any(c.isspace() for c in k) for k in self.api_keys):
            raise ValueError("API keys must be non-empty with no whitespace")
