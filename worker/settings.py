"""Worker settings: flags win over KVGATE_* environment variables, which win over these defaults."""
from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVGATE_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "kvgate"
    worker_id: str | None = None

    # engine
    model: str = "smollm2-135m"
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = Field(32, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    max_model_len: int | None = None
    block_size: int = Field(16, ge=1)
    kv_cache_memory: str | None = None  # e.g. "2GiB"; None lets the engine decide
    prefix_caching: bool = True
    scheduling: str = "continuous"
    seed: int = 0

    # simulated engine (no model; the W-FLEET cost model)
    simulated: bool = False
    sim_num_blocks: int = Field(2048, ge=1)
    sim_step_ms: float = 2.0
    sim_per_token_ms: float = 0.1

    # admission
    local_queue_size: int = Field(4, ge=2)  # jobs read from Redis that wait for KV room locally
    block_ms: int = Field(100, ge=1)  # XREADGROUP BLOCK, only when the engine is idle
    busy_poll_ms: float = 20.0  # while busy, look for new jobs at most this often when the last look found none
    initial_tokens_per_job: int = 512  # estimate of prompt + output tokens until jobs have been seen

    # leases, reclaim, dead letters
    reclaim_idle_ms: int = Field(30_000, ge=100)  # a pending entry idle this long belongs to a dead worker
    max_deliveries: int = Field(5, ge=1)
    cancel_poll_ms: int = 100

    # publishing and hygiene
    result_ttl_s: int = 86_400
    reply_ttl_s: int = 3_600
    reply_maxlen: int = 10_000
    dead_maxlen: int = 100_000
    trim_interval_s: float = 5.0
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: int = 10

    # lifecycle
    drain_timeout_s: float = 30.0
    metrics_port: int | None = None
    max_backoff_s: float = 5.0

    @property
    def renew_interval_s(self) -> float:
        """Renew leases at a quarter of the reclaim timeout, so a slow step never lets one lapse."""
        return self.reclaim_idle_ms / 4000

    @property
    def reclaim_interval_s(self) -> float:
        return min(1.0, self.reclaim_idle_ms / 2000)
