"""The autoscaling policy kvgate renders for KEDA (deploy/render_models.py) and W-SCALE simulates: its triggers, each
once as the PromQL a ScaledObject carries and once as the same arithmetic on the simulator's gauges, and the HPA's
rules that turn trigger values into replicas (kubernetes pkg/controller/podautoscaler: tolerance, stabilisation
windows, scale-up and scale-down policies) with KEDA's activation and cooldown around them.

Scaling on work (`WorkScaling`), per model with every name it serves and every LoRA adapter of it: the queries select
the exporter's `served_by` label (the model workers serve; the exporter counts an adapter's streams in its base's rows,
since adapters are registered at run time and no rendered regex can name them), so an adapter's jobs wake and size
its base's Deployment:
- deadline: the fleet rate (tokens/s) at which every waiting job with a deadline ends by it, over `deadline_margin`
  (plan to finish with a part of the time left to spare: cold starts and estimates), per worker's tokens/s;
- work: while no deadline waits, the rate the fleet served over the last minute over `utilisation` (a fleet
  busier than that grows, one idler shrinks), plus the interactive priorities' tokens waiting drained in `drain_s`.
  Deadline work does not size the fleet by its backlog, or a 1 h batch would take the whole fleet for minutes and
  give it back over the scale-down policy: it is paced to its deadline, and falls behind only into a higher rate;
- wake: 1 while any job waits (`activationThreshold` 0: one job wakes a fleet at zero), so at least one worker.
The lag-count triggers of today (`LagScaling`) are kept for comparison: one per priority, jobs waiting / lagCount.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

INTERACTIVE = ("high", "normal")  # priorities whose waiting work is drained, not paced to a deadline


@dataclass(frozen=True, slots=True)
class Trigger:
    """One KEDA trigger: its value is compared with `target` (metricType AverageValue: desired = value / target)
    and with `activation` (active: value > activation)."""

    name: str
    query: str
    target: float
    activation: float = 0.0


@dataclass(frozen=True, slots=True)
class Gauges:
    """What the exporter publishes for one model (producer/queue_work.py), as the simulator computes it."""

    jobs: int  # waiting, every priority
    tokens_waiting: dict[str, float]  # per priority
    deadline_rate_needed: float  # tokens/s, the largest over priorities
    tokens_per_s: float  # served over the last minute


@dataclass(frozen=True, slots=True)
class WorkScaling:
    worker_tokens_per_s: float = 2000.0  # one worker's sustained prompt plus generated tokens/s (measure yours)
    deadline_margin: float = 0.75  # finish deadline work in this share of the time left
    utilisation: float = 0.8  # the served rate's share of the fleet's capacity the fleet is sized for
    drain_s: float = 60.0  # interactive tokens waiting are drained within this

    def triggers(self, namespace: str, names: list[str]) -> list[Trigger]:
        sel = f'kvgate_namespace="{namespace}",served_by=~"{"|".join(_quote(n) for n in names)}"'
        # per name (the model, an alias; its adapters count in its rows) its largest over priorities; the names add up
        needed = f"sum(max by (model) (kvgate_queue_deadline_tokens_per_second_needed{{{sel}}}))"
        no_deadline = f"(({needed} or vector(0)) == bool 0)"
        served = f"(max(kvgate_model_tokens_per_second{{{sel}}}) or vector(0))"
        waiting = f'(sum(kvgate_queue_tokens_waiting{{{sel},priority=~"{"|".join(INTERACTIVE)}"}}) or vector(0))'
        c = _num(self.worker_tokens_per_s)
        return [Trigger("deadline", f"({needed} or vector(0)) / {_num(self.deadline_margin)}", self.worker_tokens_per_s),
                Trigger("work", f"{served} / {_num(self.utilisation)} * {no_deadline} + {waiting} / "
                                f"{_num(self.drain_s)}", self.worker_tokens_per_s),
                Trigger("wake", f"clamp_max(sum(kvgate_queue_lag{{{sel}}}), 1)", 1.0)]

    def values(self, g: Gauges) -> dict[str, float]:
        """Each trigger's value on the simulator's gauges: the arithmetic of `triggers`' queries."""
        waiting = sum(g.tokens_waiting.get(p, 0.0) for p in INTERACTIVE)
        work = (g.tokens_per_s / self.utilisation if g.deadline_rate_needed == 0 else 0.0) + waiting / self.drain_s
        return {"deadline": g.deadline_rate_needed / self.deadline_margin, "work": work, "wake": min(g.jobs, 1)}

    def targets(self) -> dict[str, Trigger]:
        return {t.name: t for t in self.triggers("sim", ["sim"])}


@dataclass(frozen=True, slots=True)
class LagScaling:
    """Today's triggers (deploy/k8s/keda-scaledobject.yaml before issue 44): jobs waiting per priority."""

    lag_counts: tuple[tuple[str, int], ...] = (("high", 16), ("normal", 32), ("low", 64))

    def values(self, g: Gauges, jobs_by_priority: dict[str, int]) -> dict[str, float]:
        return {p: jobs_by_priority.get(p, 0) for p, _ in self.lag_counts}

    def targets(self) -> dict[str, Trigger]:
        return {p: Trigger(p, f"lag {p}", n) for p, n in self.lag_counts}


def _quote(name: str) -> str:
    """A model name inside a PromQL regex in double quotes: its regex metacharacters escaped."""
    return "".join(f"\\\\{c}" if c in ".+*?()[]{}|^$\\" else c for c in name)


def _num(x: float) -> str:
    return f"{x:g}"


@dataclass(frozen=True, slots=True)
class Policy:
    kind: str  # Pods | Percent
    value: int
    period_s: float


@dataclass(frozen=True, slots=True)
class Behavior:
    """A ScaledObject's advanced.horizontalPodAutoscalerConfig.behavior, and KEDA's own timings around the HPA."""

    up_window_s: float = 0.0
    up_policies: tuple[Policy, ...] = (Policy("Pods", 4, 60), Policy("Percent", 100, 60))
    down_window_s: float = 300.0
    down_policies: tuple[Policy, ...] = (Policy("Percent", 50, 60),)
    min_replicas: int = 0
    max_replicas: int = 32
    polling_s: float = 15.0  # KEDA's pollingInterval and the HPA's sync period, one tick here
    cooldown_s: float = 300.0  # KEDA: inactive this long before scaling to zero
    tolerance: float = 0.1  # the HPA's: no change while value / (target x replicas) is within 1 +- this


# Today's ScaledObject (deploy/k8s/keda-scaledobject.yaml before issue 44), beside its lag-count triggers in W-SCALE.
TODAY = Behavior(up_policies=(Policy("Pods", 4, 60),), down_policies=(Policy("Pods", 1, 120),), polling_s=10.0,
                 cooldown_s=600.0)


@dataclass(slots=True)
class Autoscaler:
    """KEDA around the HPA, one tick at a time: `replicas(now, values, current)` is what the Deployment is set to."""

    behavior: Behavior
    triggers: dict[str, Trigger]
    _recommendations: list[tuple[float, int]] = field(default_factory=list)  # (time, desired) for stabilisation
    _events: list[tuple[float, int]] = field(default_factory=list)  # (time, replica change) for the policies
    _last_active: float = float("-inf")

    def desired(self, values: dict[str, float], current: int) -> int:
        """The HPA's replica count for AverageValue metrics: the largest over triggers; a trigger within the
        tolerance of the current count asks for the current count."""
        best = 0
        for name, value in values.items():
            target = self.triggers[name].target
            ratio = value / (target * current) if current else math.inf
            want = current if current and abs(ratio - 1) <= self.behavior.tolerance else math.ceil(value / target)
            best = max(best, want)
        return best

    def replicas(self, now: float, values: dict[str, float], current: int) -> int:
        b = self.behavior
        if any(v > self.triggers[k].activation for k, v in values.items()):
            self._last_active = now
        if current == 0:  # KEDA: the HPA is idle at zero; activation scales to max(min, 1)
            return max(b.min_replicas, 1) if self._last_active == now else 0
        if now - self._last_active >= b.cooldown_s and b.min_replicas == 0:
            self._recommendations.clear()
            self._events.clear()  # KEDA's, not the HPA's: its policies count from the next wake
            return 0
        want = min(b.max_replicas, max(1, b.min_replicas, self.desired(values, current)))
        self._recommendations = [(t, r) for t, r in self._recommendations if now - t < max(b.down_window_s,
                                                                                           b.up_window_s)]
        self._recommendations.append((now, want))
        if want < current:  # scale down to the highest recommendation of the window
            want = min(current, max(r for t, r in self._recommendations if now - t < b.down_window_s or t == now))
            want = min(current, max(want, self._limit(now, current, b.down_policies, up=False)))
        elif want > current:
            want = max(current, min(r for t, r in self._recommendations if now - t < b.up_window_s or t == now))
            want = max(current, min(want, self._limit(now, current, b.up_policies, up=True)))
        return self._set(now, current, want)

    def _limit(self, now: float, current: int, policies: tuple[Policy, ...], up: bool) -> int:
        """The HPA's selectPolicy Max: the policy that allows the largest change, each counted from the replicas at
        the start of its period (the changes made within it taken back)."""
        limits = []
        for p in policies:
            changed = sum(d for t, d in self._events if now - t < p.period_s and (d > 0) == up)
            start = current - changed
            step = p.value if p.kind == "Pods" else math.ceil(start * p.value / 100) if up else \
                math.floor(start * p.value / 100)
            limits.append(start + step if up else start - step)
        return max(limits) if up else min(limits)

    def _set(self, now: float, current: int, want: int) -> int:
        if want != current:
            self._events.append((now, want - current))
            self._events = [(t, d) for t, d in self._events if now - t < 3600]
        return want
