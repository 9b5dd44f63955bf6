"""The Redis keys of a namespace (`Keys`), the streams' priorities and default model, and what the fleet's own keys
hold (a worker's heartbeat fields and per-tenant windows). Producers, workers and every command name keys through
it; README.md's Architecture section and docs/architecture.md describe them."""
from __future__ import annotations

import json

from .shards import check_shards, shard_of, shard_tags

PRIORITIES = ("high", "normal", "low")  # read in this order
DEFAULT_MODEL = "default"  # the stream of jobs that name no model; workers serve it unless told not to
# A Lua function the scripts that compare stream entry ids share: is id `a` after id `b`?
ID_AFTER_LUA = """
local function id_after(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, as, bm, bs = tonumber(am or 0), tonumber(as or 0), tonumber(bm or 0), tonumber(bs or 0)
  return am > bm or (am == bm and as > bs)
end
"""
TENANT_WINDOW_S = 60.0  # the window of the tokens and queue waits a worker's heartbeat gives per tenant
# Queue wait edges (seconds) of workers' histograms: the Prometheus one and the per-tenant counts in heartbeats.
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                      300.0, 600.0, 1800.0, 3600.0)


def as_text(value) -> str:
    """Redis replies are bytes unless the client decodes them."""
    return value.decode() if isinstance(value, bytes) else str(value)


class Keys:
    """Redis key names for one namespace (see docs/architecture.md, 'Redis keys'). On a Redis Cluster (`cluster=True`) the
    namespace is split into `shards`, each under its own hash tag (producer/shards.py): this root object names a
    job's keys in the job's shard (by its id, or its idempotency key), lists streams of every shard, and puts the
    fleet's own keys (heartbeats, models, lanes) in shard 0; `at(k)` and `of_stream` name one shard's keys."""

    GROUP = "workers"
    # The consumer that holds the entries a reorder window parked for deadline order (worker/due.py): read, not
    # running; never a worker's id (settings refuse it), and the one consumer a reclaim never takes over from.
    PARKED = "kvgate:due"

    def __init__(self, namespace: str = "kvgate", shards: int = 1, cluster: bool = False):
        if not namespace or any(c in namespace for c in " \n\r\t{}"):
            raise ValueError(f"namespace {namespace!r} must be non-empty with no whitespace or braces")
        if not cluster and shards != 1:
            raise ValueError(f"shards={shards}: a namespace is split into shards only on a Redis Cluster")
        self.ns, self.shards, self.cluster = namespace, check_shards(shards), cluster
        self.prefix, self.shard = namespace, 0
        self.parts: list[Keys] = [self]
        if cluster:
            self.parts = [self._part(k, f"{namespace}:{{{tag}}}") for k, tag in enumerate(shard_tags(shards))]
            self.prefix = self.parts[0].prefix
        self._by_prefix = {p.prefix: p for p in self.parts}

    def _part(self, shard: int, prefix: str) -> "Keys":
        part = object.__new__(Keys)
        part.ns, part.shards, part.cluster, part.prefix, part.shard = self.ns, 1, self.cluster, prefix, shard
        part.parts, part._by_prefix = [part], {prefix: part}
        return part

    # -- shards --------------------------------------------------------------------------------------------
    def at(self, shard: int) -> "Keys":
        """One shard's key names."""
        return self.parts[shard]

    def shard_of(self, text: str) -> int:
        """The shard of a job id or an idempotency key."""
        return shard_of(text, len(self.parts))

    def of_stream(self, stream: str) -> "Keys":
        """The shard a job or reply stream's name is in: a job's result, reply and dead letter go there, whatever
        its job id says (a hostile producer's job in another shard's stream must not make a cross-slot script)."""
        if len(self.parts) == 1:
            return self.parts[0]
        head, brace, _ = stream.partition("}")
        part = self._by_prefix.get(head + brace)
        if part is None:
            raise ValueError(f"stream {stream!r} is in no shard of namespace {self.ns!r}")
        return part

    def by_shard(self, items, stream_of=None) -> list[list]:
        """Items grouped by the shard of their stream (`stream_of(item)`; the item itself when it is the stream's
        name), shard by shard, each group in the given order; one group on a single Redis. A command or script may
        touch one shard's keys only."""
        groups: dict[int, list] = {}
        for item in items:
            groups.setdefault(self.of_stream(stream_of(item) if stream_of else item).shard, []).append(item)
        return [groups[k] for k in sorted(groups)]

    def _job(self, text: str) -> "Keys":
        return self.parts[self.shard_of(text)]

    # -- job streams ---------------------------------------------------------------------------------------
    def jobs(self, model: str | None, priority: str, lane: int | None = None, shard: int = 0) -> str:
        """One model's shared stream of one priority in one shard (`None` is the default model), or with `lane`
        that model's prefix-affinity lane (producer/lanes.py)."""
        base = f"{self.parts[shard].prefix}:jobs:{model or DEFAULT_MODEL}:{priority}"
        return base if lane is None else f"{base}:{lane}"

    def job_streams(self, model: str | None, priority: str, lanes: int = 0) -> list[str]:
        """Every stream a job of `model` and `priority` may sit in, shard by shard: the shared one, then each lane's."""
        return [st for k in range(len(self.parts))
                for st in [self.jobs(model, priority, shard=k)] +
                [self.jobs(model, priority, lane, k) for lane in range(lanes)]]

    # -- fair share (worker/fair.py): a band is one model's shared stream of one priority in one shard ---------
    @staticmethod
    def tenant_jobs(band: str, tenant: str) -> str:
        """A tenant's job stream in a band (fair share on): `<band>:t:<tenant>`, under the band's hash tag, so a
        read script touches one slot."""
        return f"{band}:t:{tenant}"

    @staticmethod
    def band_priority(band: str) -> str:
        """A band's priority: its shared stream's name ends in it (`jobs()`)."""
        return band.rsplit(":", 1)[1]

    @staticmethod
    def fair_backlog(band: str) -> str:
        """Sorted set of the band's backlogged tenants, scored by their virtual token counters (weighted tokens
        served); `<band>:fair:vt` holds the band's virtual time (the counter last served) and
        `<band>:fair:pending` the tenant streams that may hold entries a worker has not acknowledged."""
        return f"{band}:fair"

    @staticmethod
    def fair_pending(band: str) -> str:
        return f"{band}:fair:pending"

    @staticmethod
    def fair_queued(band: str) -> str:
        """Jobs in the band's tenants' streams not yet read (producers add, reads subtract): the band's backlog
        for stats and the backlog gate, without a look at every tenant's stream."""
        return f"{band}:fair:queued"

    @staticmethod
    def fair_streams(band: str) -> str:
        """Sorted set of the band's tenants that have (or had) a stream, scored by when a worker's pruning pass
        last looked at it (0: never; producers add a tenant when it joins the backlog): the pass walks it oldest
        first, a bounded slice each time, deleting streams left empty (worker/fair.py)."""
        return f"{band}:fair:streams"

    @staticmethod
    def fair_bell(band: str) -> str:
        """A tiny stream (the last few entries) a producer adds to when a tenant joins the band's backlog: an idle
        worker's blocking read waits on it, as it waits on the shared streams (a read cannot wait on a sorted
        set)."""
        return f"{band}:fair:bell"

    @staticmethod
    def fair_keys(band: str) -> list[str]:
        """The keys a producer's fair enqueue touches besides the tenant's stream, in the scripts' order: the
        backlog, its queued count, the streams index and the bell."""
        return [Keys.fair_backlog(band), Keys.fair_queued(band), Keys.fair_streams(band), Keys.fair_bell(band)]

    def handed_back(self, shard: int = 0) -> str:
        """Sorted set of the shard's job entries a worker read but could not fit and handed back (worker/hand_back.py),
        scored by when (server ms): `giver\\nentry id\\nstream`; any worker's next read takes them before new entries.
        Outside `jobs:*`, which producers may write: only workers may make an entry move."""
        return f"{self.parts[shard].prefix}:handed"

    def due_index(self, stream: str) -> str:
        """Sorted set of a job stream's entries parked for deadline order (worker/due.py), scored by when each is
        due (server ms: entry ms + its relative deadline, or entry ms with none): `entry ms-seq`, zero-padded, so ties
        go in id order. In the stream's shard (its slot), outside `jobs:*`, which producers may write."""
        prefix = self.of_stream(stream).prefix + ":jobs:"
        if not stream.startswith(prefix):
            raise ValueError(f"{stream!r} is no job stream of namespace {self.ns!r} (it does not start {prefix!r})")
        return f"{prefix[:-len('jobs:')]}due:{stream[len(prefix):]}"

    @staticmethod
    def due_entry_id(member: bytes | str) -> str:
        """The entry id a due index's member names (`entry ms-seq` zero-padded, as worker/due.py's script writes it)."""
        ms, seq = as_text(member).split("-")
        return f"{int(ms)}-{int(seq)}"

    def all_jobs(self, model: str | None, lanes: int = 0) -> list[str]:
        """One model's streams, highest priority first, each priority's shared stream before its lanes."""
        return [st for p in PRIORITIES for st in self.job_streams(model, p, lanes)]

    def served_jobs(self, models: list[str]) -> list[str]:
        """The streams of several models in the order a worker reads them: every model's high priority stream
        before any model's normal one, so a priority means the same across the models one worker serves; shard
        by shard within a priority (a read touches one shard: one slot)."""
        return [self.jobs(m, p, shard=k) for p in PRIORITIES for k in range(len(self.parts)) for m in models]

    # -- the fleet's keys, in shard 0 ----------------------------------------------------------------------
    def models(self) -> str:
        """Set of every model name ever submitted to or served: stats, exporter and gateway read it instead of
        scanning key names."""
        return f"{self.prefix}:models"

    def loras(self) -> str:
        """Hash of the fleet's LoRA adapters: name -> JSON {"path", "base"} (`lora_entry`), written by `kvgate loras`,
        the SDK (producer/loras.py) and workers' `--lora`; an adapter's jobs are on its own streams (`jobs(name, p)`),
        served by the workers of its base model."""
        return f"{self.prefix}:loras"

    def lanes(self) -> str:
        """The namespace's lane count, one for every model: set once by the first worker with affinity on;
        absent: no lanes."""
        return f"{self.prefix}:lanes"

    def lane_ring(self, model: str | None) -> str:
        """Sorted set of the workers that own `model`'s lanes (`weight|worker_id`), scored by their last beat
        (server ms): a worker owns lanes only of the models it serves."""
        return f"{self.prefix}:lanes:ring:{model or DEFAULT_MODEL}"

    def lanes_full(self, model: str | None) -> str:
        """Sorted set of the ring's workers that cannot take a job of `model`'s lanes now (no KV room): others
        take their lanes' jobs without waiting the steal age. In shard 0, with the ring."""
        return f"{self.prefix}:lanes:full:{model or DEFAULT_MODEL}"

    def fair(self) -> str:
        """The namespace's fair-share switch (set by `kvgate worker --fair-share on`): while it exists producers
        send each job to its tenant's stream and workers serve the band's tenants by virtual token counters."""
        return f"{self.prefix}:fair"

    def tenants(self) -> str:
        """Hash tenant -> weight for fair share (absent: 1); read by workers every few seconds."""
        return f"{self.prefix}:tenants"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def workers(self) -> str:
        """Sorted set of live workers' ids, scored by when their heartbeat expires (server ms): stats, the exporter
        and the gateway list workers from it, not by scanning key names (SCAN walks the whole keyspace). Each
        worker adds itself and drops expired members in the script that writes its heartbeat (worker/heartbeat.py)."""
        return f"{self.prefix}:workers"

    def quota_leases(self) -> str:
        """Sorted set of admitted jobs, `tenant|job_id`, scored by the end of their lease (server ms); see
        producer/quotas.py."""
        return f"{self.prefix}:quota:leases"

    def quota_jobs(self) -> str:
        """Sorted set tenant -> jobs in flight (queued or running); a tenant leaves it at zero."""
        return f"{self.prefix}:quota:jobs"

    def quota_tokens(self) -> str:
        """Sorted set tenant -> tokens charged in the current server minute."""
        return f"{self.prefix}:quota:tokens"

    def quota_tokens_prev(self) -> str:
        """Sorted set tenant -> tokens charged in the previous server minute."""
        return f"{self.prefix}:quota:tokens:prev"

    def quota_window(self) -> str:
        """Hash: the minute `quota_tokens` counts, and the totals over every tenant (jobs, tokens, tokens_prev)."""
        return f"{self.prefix}:quota:window"

    # -- a job's keys, in its shard ------------------------------------------------------------------------
    def reply(self, client_id: str, shard: int = 0) -> str:
        return f"{self.parts[shard].prefix}:reply:{client_id}"

    def replies(self, client_id: str) -> list[str]:
        """A client's reply stream in every shard."""
        return [self.reply(client_id, k) for k in range(len(self.parts))]

    def result(self, job_id: str) -> str:
        return f"{self._job(job_id).prefix}:result:{job_id}"

    def cancel(self, job_id: str) -> str:
        return f"{self._job(job_id).prefix}:cancel:{job_id}"

    def idempotency(self, key: str) -> str:
        return f"{self._job(key).prefix}:idem:{key}"

    def dead(self, shard: int = 0) -> str:
        return f"{self.parts[shard].prefix}:dead"

    def deads(self) -> list[str]:
        return [self.dead(k) for k in range(len(self.parts))]


def lora_entry(path: str, base: str) -> str:
    """An adapter's value in `Keys.loras()`: where its PEFT folder is (on the workers' file system) and its base
    model."""
    return json.dumps({"path": path, "base": base}, sort_keys=True)


def lora_removed_entry(base: str) -> str:
    """A removed adapter's value in `Keys.loras()` (a tombstone): the workers of `base` still read its streams, to
    answer the jobs left there with an error result; registering the name again overwrites it."""
    return json.dumps({"base": base, "removed": True}, sort_keys=True)


def parse_lora_entry(value) -> tuple[str | None, str] | None:
    """(path, base) of a `Keys.loras()` value, path None for a removed adapter; None for one that is not an
    adapter's entry (written by hand)."""
    try:
        entry = json.loads(as_text(value))
        if entry.get("removed") is True and isinstance(entry.get("base"), str):
            return None, entry["base"]
        return (entry["path"], entry["base"]) if all(isinstance(entry.get(k), str) for k in ("path", "base")) else None
    except (ValueError, TypeError, AttributeError):
        return None


# Fields of the `{ns}:worker:<id>` heartbeat hash; shared by the worker, `kvgate stats/top` and the exporter.
# `model` is the canonical name; `models` every name it serves (canonical, aliases, `default`), comma-separated.
HEARTBEAT_FIELDS = (
    "worker_id", "model", "models", "started_at", "updated_at", "state",  # state: serving | draining
    "running", "waiting", "max_num_seqs", "free_blocks", "total_blocks", "block_size",
    "admissible_tokens", "tokens_per_s", "jobs_done",
    "tenants",  # JSON {tenant: [running, tokens, wait counts...]}: worker/tenant_load.py, read by queue_stats
    "fim",  # the model's fill-in-the-middle family (engine/fim.py), "" for none: the gateway refuses `suffix` early
    "loras",  # JSON {"loaded": adapters in its slots, "loads", "evictions"} (worker/adapters.py); "" without slots
)
