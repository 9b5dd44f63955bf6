"""Worker settings: the engine's own (EngineConfig) plus the worker's. Flags win over KVGATE_* environment
variables, which win over these defaults; `kvgate worker` derives its flags from these fields (kvgate/commands/flags.py)."""
from __future__ import annotations

import os
import socket
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from kvgate.engine.config import EngineConfig
from kvgate.producer.job_checks import ProtocolError, check_model_name
from kvgate.producer.keys import Keys
from kvgate.producer.urls import DEFAULT_URL, check_url
from kvgate.producer.redis_url import Durability


def _names(value: object) -> object:
    """KVGATE_MODEL_ALIASES=a,b (and one --model-alias given as a,b) is a list of names."""
    if isinstance(value, str):
        return [n.strip() for n in value.split(",") if n.strip()]
    if isinstance(value, (list, tuple)):
        return [n.strip() for v in value for n in (v.split(",") if isinstance(v, str) else [v]) if n.strip()]
    return value


def _s(default, description: str, *flags: str, **constraints):
    """A field whose description is its --help text; `flags` replace the --field-name derived from its name."""
    extra = {"flags": list(flags)} if flags else None
    return Field(default, description=description, json_schema_extra=extra, **constraints)


def default_worker_id() -> str:
    return os.environ.get("KVGATE_WORKER_ID") or f"{socket.gethostname()}-{os.getpid()}"


class WorkerSettings(BaseSettings, EngineConfig):
    model_config = SettingsConfigDict(env_prefix="KVGATE_", extra="forbid", validate_assignment=True)

    redis_url: str = _s(DEFAULT_URL, "redis://, rediss://, unix:// or redis+sentinel://host:26379,.../service URL "
                                     "of the fleet's Redis")
    namespace: str = _s("kvgate", "key prefix shared by producers and workers")
    worker_id: str | None = _s(None, "stable consumer name; unset: hostname-pid")
    model: str = _s("smollm2-135m", "model alias, HF folder, GGUF file or random:<name>")

    # which job streams this worker serves: {ns}:jobs:<name>:<priority> for each name
    served_model_name: str | None = _s(None, "the model name jobs ask for and results report; unset: the "
                                             "engine's own name for the loaded model")
    model_aliases: Annotated[list[str], NoDecode, BeforeValidator(_names)] = _s(
        [], "more model names this worker serves (repeat the flag, or comma-separate)", "--model-alias")
    serve_default: bool = _s(True, "also serve jobs that name no model (the 'default' model)")
    loras: Annotated[list[str], NoDecode, BeforeValidator(_names)] = _s(
        [], "a LoRA adapter NAME=PATH (its PEFT folder) registered fleet-wide as an adapter of this worker's model and "
            "loaded at start (repeat the flag); needs --max-loras >= 1. The worker also serves every adapter of its "
            "model registered in Redis (kvgate loras add), loading it on first use", "--lora")
    lora_aging_ms: int = _s(5000, "a job of an adapter with no slot free here is left to workers that hold it, until "
                                  "the adapter's oldest job waited this much longer than the oldest waiting job of the "
                                  "adapters this worker holds (this long, where those have none): then any worker with "
                                  "KV room reads it", ge=0)
    embeddings: Literal["on", "off", "only"] = _s(
        "on", "embedding jobs (task embed): on: served beside generation; only: this worker's model names serve "
        "embeddings alone (a generation job gets an error result saying so); off: refused with an error result")
    tool_call_parser: Literal["auto", "hermes", "llama3"] = _s(
        "auto", "the format tool calls of tool_choice auto are read in: hermes (<tool_call> JSON blocks: Hermes, "
                "Qwen2.5/3, and models whose chat template renders no tools, which get kvgate's hermes prompt), "
                "llama3 (bare {\"name\", \"parameters\"} JSON); auto: from the chat template")

    # simulated engine (no model; the W-FLEET cost model)
    simulated: bool = _s(False, "run the cost-model engine instead of a model (fleet tests and benchmarks)")
    sim_num_blocks: int = _s(2048, "KV blocks of the simulated engine", ge=1)
    sim_step_ms: float = _s(2.0, "simulated cost of one step, milliseconds", ge=0)
    sim_per_token_ms: float = _s(0.1, "simulated cost per scheduled token, milliseconds", ge=0)
    sim_lora_load_ms: float = _s(0.0, "simulated cost of loading a LoRA adapter into a slot, milliseconds", ge=0)

    # admission
    local_queue_size: int = _s(4, "jobs read from Redis that may wait locally for KV room", ge=2)
    block_ms: int = _s(100, "XREADGROUP BLOCK while the engine is idle, milliseconds", ge=1)
    busy_poll_ms: float = _s(20.0, "while busy, look for new jobs at most this often after an empty look", ge=0)
    initial_tokens_per_job: int = _s(512, "prompt + output tokens assumed per job until jobs have been seen", ge=1)
    hand_back_ms: int = _s(100, "a job read that turns out not to fit (nor to make room) goes back to Redis after "
                           "waiting here this long, for another worker's next read to take at once (no delivery "
                           "counted; at most once per job and worker); 0: it waits here for room", ge=0)

    # prefix affinity (producer/lanes.py, worker/affinity.py)
    affinity: Literal["on", "off"] = _s("off", "own prefix-affinity lanes: read jobs whose prompt prefix hashes to "
                                        "our lanes first, others' only when ours are empty; the first worker with "
                                        "it on gives the namespace its lanes")
    affinity_lanes: int = _s(32, "lanes a namespace gets when a worker with affinity on finds none", ge=1, le=1024)
    affinity_steal_age_ms: int = _s(100, "a job in another worker's lane is taken only once this old, so its owner "
                                    "gets the first chance", ge=0)
    affinity_max_lag_ms: int = _s(1000, "take a job from another worker's lane before our own once it has waited this "
                                  "much longer than ours (its owner is not keeping up); 0: only when ours are empty",
                                  ge=0)

    # fair share across tenants (worker/fair.py)
    fair_share: Literal["on", "off", "keep"] = _s(
        "keep", "on: give the namespace fair share (each tenant its own stream, served by weighted virtual token "
        "counters within a priority; producers follow within 5 s); off: end it (producers go back to one FIFO "
        "stream per priority; tenants' streams still drain); keep: whatever the namespace has")
    fair_preempt_ms: int = _s(50, "with fair share: a job that has waited this long (server clock) and whose tenant "
                              "runs under its share of a full worker's jobs of its band starts there at once, the "
                              "youngest jobs of the tenants over their share stepping aside (preempted by recompute, "
                              "resumed first); 0: never (a job waits for room anywhere in the fleet)", ge=0)

    tenant_weights: str | None = _s(
        None, "a TOML file of tenants' fair-share weights, one table: [weights] with lines like team-a = 2 (a weight "
        "from 0.001 to 1000); read at start and written to {ns}:tenants, replacing it, so every worker serves by the "
        "same weights")

    @field_validator("tenant_weights")
    @classmethod
    def _weights_file(cls, path: str | None) -> str | None:
        if path is not None:
            from kvgate.worker.tenant_weights import read_weights

            read_weights(path)  # a bad file stops the start, saying what is wrong in it
        return path

    # leases, reclaim, dead letters
    reclaim_idle_ms: int = _s(30_000, "pending jobs idle this long are taken over from dead workers", ge=100)
    max_deliveries: int = _s(5, "deliveries after which a job goes to the dead stream", ge=1)
    cancel_poll_ms: int = _s(100, "how often running jobs are checked for cancellation, milliseconds", ge=1)

    # publishing and hygiene
    result_ttl_s: int = _s(86_400, "seconds a final result stays readable", ge=1)
    reply_ttl_s: int = _s(3_600, "seconds a reply stream outlives its last event", ge=1)
    reply_maxlen: int = _s(10_000, "entries kept per reply stream", ge=1)
    dead_maxlen: int = _s(100_000, "entries kept in the dead stream", ge=1)
    trim_interval_s: float = _s(5.0, "seconds between job stream trims", gt=0)
    heartbeat_interval_s: float = _s(1.0, "seconds between heartbeats", gt=0)
    heartbeat_ttl_s: int = _s(10, "seconds a silent worker stays listed as live", ge=1)

    # lifecycle
    drain_timeout_s: float = _s(30.0, "seconds to finish running jobs after SIGTERM", "--drain-timeout",
                                "--drain-timeout-s", ge=0)
    metrics_port: int | None = _s(None, "serve Prometheus metrics on this port; unset: no metrics server",
                                  ge=0, le=65535)
    max_backoff_s: float = _s(5.0, "longest wait between retries while Redis is down, seconds", gt=0)
    otel_endpoint: str | None = _s(None, "send each job's OpenTelemetry spans over OTLP/HTTP to this collector "
                                         "(http://collector:4318); unset: the standard OTEL_EXPORTER_OTLP_[TRACES_]"
                                         "ENDPOINT, else no tracing (needs kvgate[tracing])")

    @field_validator("loras")
    @classmethod
    def _loras(cls, value):
        for entry in value:
            name, eq, path = entry.partition("=")
            try:
                check_model_name(name)
            except ProtocolError as e:
                raise ValueError(f"--lora {entry!r}: {e}") from None
            if not eq or not path:
                raise ValueError(f"--lora {entry!r} must be NAME=PATH, the adapter's name and its PEFT folder")
        return value

    @field_validator("served_model_name", "model_aliases")
    @classmethod
    def _model_names(cls, value):
        try:
            for name in [value] if isinstance(value, str) else value or []:
                check_model_name(name)
        except ProtocolError as e:
            raise ValueError(str(e)) from None
        return value

    # failover (RELIABILITY.md, Failover)
    durability: Literal["primary", "replicated"] = _s(
        "primary", "replicated: a finished job counts as settled only once a replica has its result (WAIT 1), "
        "else its final is sent again; primary: once the primary has it")
    replica_timeout_ms: int = _s(1000, "WAIT timeout of the replicated durability, milliseconds", ge=1)

    # deadline order within a priority (worker/due.py)
    deadline_order: Literal["on", "off"] = _s(
        "on", "on: within a priority, serve jobs earliest deadline first (a job without one is due when it arrived), "
        "from a window of up to deadline_window new jobs per stream parked in Redis; off: in arrival order (jobs "
        "other workers parked are still taken first). Affinity lanes too: each lane has its own window")
    deadline_window: int = _s(64, "with deadline order: new jobs per stream looked at to find the earliest due (a job "
                              "further back waits its turn in arrival order)", ge=1, le=4096)

    @field_validator("worker_id")
    @classmethod
    def _not_parked(cls, worker_id: str | None) -> str | None:
        if worker_id == Keys.PARKED:
            raise ValueError(f"worker_id {worker_id!r} is the consumer that holds jobs parked for deadline order; "
                             "choose another name")
        return worker_id

    @property
    def read_window(self) -> int:
        """Entries parked per stream for deadline order (worker/due.py); 0: off."""
        return self.deadline_window if self.deadline_order == "on" else 0

    @field_validator("redis_url")
    @classmethod
    def _url_with_scheme(cls, url: str) -> str:
        return check_url(url)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**self.model_dump(include=set(EngineConfig.model_fields)))

    @property
    def replication(self) -> Durability:
        return Durability(self.durability, 1, self.replica_timeout_ms)

    @property
    def renew_interval_s(self) -> float:
        """Renew leases at a quarter of the reclaim timeout, so a slow step never lets one lapse."""
        return self.reclaim_idle_ms / 4000

    @property
    def reclaim_interval_s(self) -> float:
        return min(1.0, self.reclaim_idle_ms / 2000)
