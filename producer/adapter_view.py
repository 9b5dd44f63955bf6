"""Per LoRA adapter: backlog, pending, wait and the workers holding it; per worker: the adapters in its slots, its
loads and evictions. Read by `kvgate stats`, `kvgate top` and the exporter (issue 42, "Metrics and views").

- Per adapter: its jobs wait on its own streams (producer/loras.py), so its backlog (jobs not yet delivered, every
  priority, lane and shard), pending and wait are its streams' as a model's are (queue_stats.ModelStats); the wait is
  the age of its oldest job not yet acknowledged, the measure `kvgate stats` shows per model. Every adapter of the
  registry (`{ns}:loras`) is counted, and the view names the TOP_NAMED with the most backlog (then pending, then the
  workers holding it, then the name) and sums the others as OTHER_NAMED: the rule of every per-name view
  (limits.top_and_rest), so the exporter's `adapter` label has at most TOP_NAMED + 1 values however many are
  registered.
- Per worker: its heartbeat's `loras` (worker/adapters.py): the adapters its slots hold, kept to MAX_LOADED_NAMES
  names by a reader whatever a heartbeat holds, and its loads and evictions since it started.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Protocol

from .limits import MAX_MODEL_NAME_CHARS, OTHER_NAMED, TOP_NAMED, top_and_rest
from .loras import Lora

MAX_LOADED_NAMES = 16  # adapter names a reader keeps of one heartbeat (a worker holds --max-loras of them)


@dataclass(slots=True)
class WorkerLoras:
    loaded: list[str] = field(default_factory=list)  # adapters in its slots, by name, at most MAX_LOADED_NAMES
    count: int = 0  # adapters in its slots, all of them
    loads: int = 0  # adapters loaded into a slot since the worker started (a free or an evicted one)
    evictions: int = 0  # adapters evicted from a slot for another one since the worker started

    def shown(self) -> str:
        """The adapters in its slots by name (as many as a reader keeps) and how many more; `-` for none."""
        more = self.count - len(self.loaded)
        return (", ".join(self.loaded) or "-") + (f" (+{more} more)" if more > 0 else "")


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def parse_worker_loras(raw: str) -> WorkerLoras | None:
    """A heartbeat's `loras` field; None for a worker without adapter slots (""), or a field a reader cannot parse
    (a heartbeat never stops a reader)."""
    try:
        value = json.loads(raw) if raw else None
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("loaded"), list):
        return None
    names = sorted({n for n in value["loaded"] if isinstance(n, str) and 0 < len(n) <= MAX_MODEL_NAME_CHARS})
    loads, evictions = _count(value.get("loads")), _count(value.get("evictions"))
    if loads is None or evictions is None:
        return None
    return WorkerLoras(names[:MAX_LOADED_NAMES], len(names), loads, evictions)


class Streams(Protocol):
    """A model's streams as queue_stats.ModelStats sums them (every priority, lane and shard)."""

    @property
    def backlog(self) -> int: ...
    @property
    def pending(self) -> int: ...
    @property
    def oldest_age_s(self) -> float | None: ...


@dataclass(slots=True)
class AdapterView:
    adapter: str
    base: str | None = None  # its base model; None for OTHER_NAMED, which sums adapters of any base
    backlog: int = 0  # jobs on its streams not yet delivered to a worker, every priority
    pending: int = 0  # delivered to a worker, not yet acknowledged
    oldest_age_s: float | None = None  # its oldest job not yet acknowledged (OTHER_NAMED: the oldest of the others)
    loaded_on: int = 0  # live workers whose slots hold it (OTHER_NAMED: slots holding the others)
    adapters: int = 1  # adapters the row stands for (OTHER_NAMED: how many it sums)

    def add(self, other: "AdapterView") -> None:
        self.backlog += other.backlog
        self.pending += other.pending
        ages = [a for a in (self.oldest_age_s, other.oldest_age_s) if a is not None]
        self.oldest_age_s = max(ages) if ages else None
        self.loaded_on += other.loaded_on
        self.adapters += other.adapters


@dataclass(slots=True)
class AdaptersView:
    top: list[AdapterView] = field(default_factory=list)
    other: AdapterView = field(default_factory=lambda: AdapterView(OTHER_NAMED, adapters=0))

    @property
    def registered(self) -> int:
        return sum(a.adapters for a in self.top) + self.other.adapters

    def to_dict(self) -> dict:
        return {"top": [asdict(a) for a in self.top], "other": asdict(self.other), "registered": self.registered}


def adapters_view(loras: dict[str, Lora], models: dict[str, Streams], loaded: list[WorkerLoras],
                  top: int = TOP_NAMED) -> AdaptersView:
    """The registered adapters (`loras`: list_loras) with their streams' figures (`models`: queue_stats' per model)
    and the live workers' slots (`loaded`), folded into the `top` with the most backlog and OTHER_NAMED."""
    views = []
    for name, lora in loras.items():
        m = models.get(name)
        views.append(AdapterView(name, lora.base, backlog=m.backlog if m else 0, pending=m.pending if m else 0,
                                 oldest_age_s=m.oldest_age_s if m else None,
                                 loaded_on=sum(name in w.loaded for w in loaded)))
    view = AdaptersView()
    named, rest = top_and_rest([v for v in views if v.adapter != OTHER_NAMED],
                               lambda v: (-v.backlog, -v.pending, -v.loaded_on, v.adapter), top)
    view.top = named
    for v in rest + [v for v in views if v.adapter == OTHER_NAMED]:  # a name the rule reserves: summed, never shown
        view.other.add(v)
    return view
