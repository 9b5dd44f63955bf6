"""Per-worker Prometheus metrics (prefix `kvgate_`), fed by hooks the worker calls.

Each WorkerMetrics owns its registry by default, so several workers can live in one process (tests, the
fleet simulation) without clashing on metric names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvgate.producer.keys import QUEUE_WAIT_BUCKETS
from kvgate.producer.limits import OTHER_TENANTS

# Bucket edges in seconds, spread over the range each LLM latency really takes.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TOKEN_COUNT_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)

LABELS = ("worker", "model")
# Producers name tenants (the gateway: one per API key's tenant), so a worker labels at most this many distinct ones
# and counts the jobs of any further tenant under OTHER_TENANTS: a label's values must stay few.
MAX_TENANT_LABELS = 32
NO_TENANT = "_none"  # no tenant name starts with '_' (limits.TENANT_NAME)


class StepStats(Protocol):
    """What the engine reports after each step; token and preemption figures are cumulative."""

    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    kv_usage: float
    preemptions: int
    stepped_aside: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    prompt_tokens: int
    generation_tokens: int


@dataclass(slots=True)
class _Cumulative:
    """Turns a cumulative engine figure into counter increments; a reset (engine rebuilt) restarts at 0."""

    last: int = 0

    def delta(self, value: int) -> int:
        step = value - self.last if value >= self.last else value
        self.last = value
        return step


@dataclass(slots=True)
class _Seen:
    preemptions: _Cumulative = field(default_factory=_Cumulative)
    stepped_aside: _Cumulative = field(default_factory=_Cumulative)
    prefix_hit: _Cumulative = field(default_factory=_Cumulative)
    prefix_query: _Cumulative = field(default_factory=_Cumulative)
    prompt: _Cumulative = field(default_factory=_Cumulative)
    generation: _Cumulative = field(default_factory=_Cumulative)
    lora_loads: _Cumulative = field(default_factory=_Cumulative)
    lora_evictions: _Cumulative = field(default_factory=_Cumulative)


@dataclass(slots=True)
class TenantLabels:
    """The tenant label of a job: its tenant while fewer than `limit` have been labelled, else OTHER_TENANTS."""

    limit: int = MAX_TENANT_LABELS
    seen: set[str] = field(default_factory=set)

    def of(self, tenant: str | None) -> str:
        if tenant is None:
            return NO_TENANT
        if tenant not in self.seen and len(self.seen) >= self.limit:
            return OTHER_TENANTS
        self.seen.add(tenant)
        return tenant


class WorkerMetrics:
    def __init__(self, worker_id: str, model: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.labels = {"worker": worker_id, "model": model}
        self._seen = _Seen()
        self._server = None
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kvgate_{name}", doc, LABELS, registry=r).labels(**self.labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kvgate_{name}", doc, LABELS, registry=r).labels(**self.labels)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"kvgate_{name}", doc, LABELS, buckets=buckets, registry=r).labels(**self.labels)

        self.running = gauge("requests_running", "Sequences the engine is running now")
        self.waiting = gauge("requests_waiting", "Sequences admitted to the engine but not yet scheduled")
        self.waiting_local = gauge("requests_waiting_local", "Jobs read from Redis held in the local admission queue")
        self.kv_usage = gauge("kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1)")
        self.free_blocks = gauge("kv_free_blocks", "Free KV cache blocks")
        self.total_blocks = gauge("kv_total_blocks", "KV cache blocks in the pool")
        self.prefix_hit_ratio = gauge("prefix_cache_hit_ratio", "Prefix cache hit tokens / queried tokens since start")
        self.prefix_hit_tokens = counter("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache")
        self.prefix_query_tokens = counter("prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.preemptions = counter("preemptions", "Sequences preempted (recomputed) for lack of KV blocks")
        self.stepped_aside = counter("stepped_aside", "Sequences preempted (recomputed) on purpose: fair share's "
                                     "room for a job that waited under its tenant's share (fair_preempt_ms)")
        self.step_seconds = histogram("engine_step_seconds", "Duration of one engine iteration", STEP_BUCKETS)
        self.admitted = counter("jobs_admitted", "Jobs admitted from Redis into the engine")
        self.queue_wait = histogram("queue_wait_seconds", "Time from enqueue to admission", QUEUE_WAIT_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds", "Time from admission to first token", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean decode time per output token", TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from enqueue to the final event", E2E_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished job",
                                               TOKEN_COUNT_BUCKETS)
        self.request_completion_tokens = histogram("request_completion_tokens", "Completion tokens per finished job",
                                                   TOKEN_COUNT_BUCKETS)
        self.cached_tokens = counter("request_cached_tokens", "Prompt tokens of finished jobs served from cache")
        self._finished = Counter("kvgate_jobs_finished", "Jobs answered with a final event, by status",
                                 (*LABELS, "status"), registry=r)
        self.lanes_owned = gauge("affinity_lanes_owned", "Prefix-affinity lanes this worker owns now")
        self.steals = counter("affinity_steals", "Jobs read from a lane another worker owns (ours were empty)")
        self.loras_loaded = gauge("lora_adapters_loaded", "LoRA adapters in the engine's device slots now")
        self.lora_loads = counter("lora_loads", "LoRA adapters loaded into a device slot (a free or evicted one)")
        self.lora_evictions = counter("lora_evictions", "LoRA adapters evicted from a slot for another adapter")
        self.redeliveries = counter("redeliveries", "Jobs this worker received that were delivered before")
        self._dead = Counter("kvgate_dead_letters", "Jobs this worker moved to the dead stream, by reason",
                             (*LABELS, "reason"), registry=r)
        for status in ("done", "error", "expired", "cancelled"):  # so rate() works before the first of each
            self._finished.labels(**self.labels, status=status)
        self._tenants = TenantLabels()
        self._tenant_finished = Counter("kvgate_tenant_jobs_finished", "Jobs answered with a final event, by tenant "
                                        f"(at most {MAX_TENANT_LABELS} per worker, then '{OTHER_TENANTS}') and status",
                                        (*LABELS, "tenant", "status"), registry=r)
        self._tenant_tokens = Counter("kvgate_tenant_generation_tokens", "Completion tokens of finished jobs, by "
                                      "tenant (bounded as kvgate_tenant_jobs_finished)", (*LABELS, "tenant"),
                                      registry=r)

    # --- hooks the worker calls ---

    def on_step(self, stats: StepStats, step_seconds: float, waiting_local: int) -> None:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.waiting_local.set(waiting_local)
        self.kv_usage.set(stats.kv_usage)
        self.free_blocks.set(stats.free_blocks)
        self.total_blocks.set(stats.total_blocks)
        self.step_seconds.observe(step_seconds)
        seen = self._seen
        self.preemptions.inc(seen.preemptions.delta(stats.preemptions))
        self.stepped_aside.inc(seen.stepped_aside.delta(stats.stepped_aside))
        self.prefix_hit_tokens.inc(seen.prefix_hit.delta(stats.prefix_hit_tokens))
        self.prefix_query_tokens.inc(seen.prefix_query.delta(stats.prefix_query_tokens))
        self.prompt_tokens.inc(seen.prompt.delta(stats.prompt_tokens))
        self.generation_tokens.inc(seen.generation.delta(stats.generation_tokens))
        if stats.prefix_query_tokens > 0:
            self.prefix_hit_ratio.set(stats.prefix_hit_tokens / stats.prefix_query_tokens)

    def on_admitted(self, queue_wait_s: float) -> None:
        self.admitted.inc()
        self.queue_wait.observe(max(0.0, queue_wait_s))

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(max(0.0, ttft_s))

    def on_finished(self, status: str, e2e_s: float, tpot_s: float | None, prompt_tokens: int,
                    completion_tokens: int, cached_tokens: int, tenant: str | None = None) -> None:
        self._finished.labels(**self.labels, status=status).inc()
        label = self._tenants.of(tenant)
        self._tenant_finished.labels(**self.labels, tenant=label, status=status).inc()
        self._tenant_tokens.labels(**self.labels, tenant=label).inc(max(0, completion_tokens))
        self.e2e.observe(max(0.0, e2e_s))
        if tpot_s is not None:
            self.tpot.observe(max(0.0, tpot_s))
        if status == "done":
            self.request_prompt_tokens.observe(prompt_tokens)
            self.request_completion_tokens.observe(completion_tokens)
        self.cached_tokens.inc(max(0, cached_tokens))

    def on_lanes(self, owned: int) -> None:
        self.lanes_owned.set(owned)

    def on_loras(self, loaded: int, loads: int, evictions: int) -> None:
        """The engine's adapter slots as the heartbeat reads them (worker/adapters.py): cumulative loads, evictions."""
        self.loras_loaded.set(loaded)
        self.lora_loads.inc(self._seen.lora_loads.delta(loads))
        self.lora_evictions.inc(self._seen.lora_evictions.delta(evictions))

    def on_steals(self, n: int) -> None:
        self.steals.inc(n)

    def on_redelivery(self) -> None:
        self.redeliveries.inc()

    def on_dead_letter(self, reason: str) -> None:
        # The reason becomes a label: keep it a short category ("max_deliveries", "invalid"), not a message.
        self._dead.labels(**self.labels, reason=reason[:64]).inc()

    def serve(self, port: int) -> None:
        """Expose /metrics on `port` (all interfaces); 0 means metrics stay in-process only."""
        if port:
            self._server = start_http_server(port, registry=self.registry)

    def close(self) -> None:
        if self._server is not None:
            server, thread = self._server
            server.shutdown()
            server.server_close()
            self._server = None
