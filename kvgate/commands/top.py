"""`kvgate top`: a live terminal view of the fleet, grouped by model (workers and their KV room and adapter slots,
streams and their backlog), tenants, and LoRA adapters (backlog and wait). The streams' rows are the exporter's
(QueueStats.served): a LoRA adapter's jobs count in its base model's rows; one adapter alone is in the adapters'
table."""
from __future__ import annotations

import argparse
import contextlib
import select
import sys
import time

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvgate.producer.connection import DEFAULT_URL, resolve_url
from kvgate.producer.keys import Keys
from kvgate.producer.queue_stats import QueueStats, read_queue_stats
from kvgate.producer.redis_url import connect, keys_for


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def _workers_table(snap: QueueStats) -> Table:
    """Each live worker; with adapter slots anywhere, the adapters each holds and its loads/evictions too."""
    table = Table(title=f"workers ({len(snap.workers)} live)", expand=True, title_justify="left")
    slots = any(w.loras is not None for w in snap.workers)
    columns = ("model", "worker", "state", "running", "waiting", "free KV blocks", "KV used", "tokens/s", "done",
               *(("adapters loaded", "loads/evictions") if slots else ()))
    for column in columns:
        table.add_column(column, justify="left" if column in ("model", "worker", "state", "adapters loaded")
                         else "right")
    for w in sorted(snap.workers, key=lambda w: (w.model, w.worker_id)):
        adapters = (() if not slots else ("-", "-") if w.loras is None else
                    (w.loras.shown(), f"{w.loras.loads}/{w.loras.evictions}"))
        table.add_row(w.model, w.worker_id, w.state, str(w.running), str(w.waiting),
                      f"{w.free_blocks}/{w.total_blocks}", f"{w.kv_usage:.0%}", f"{w.tokens_per_s:,.0f}",
                      str(w.jobs_done), *adapters)
    if not snap.workers:
        table.add_row("", Text("no live workers", style="bold red"), "", "", "", "", "", "", "")
    return table


def _streams_table(snap: QueueStats) -> Table:
    table = Table(title="streams", expand=True, title_justify="left")
    for column in ("model", "priority", "backlog (lag)", "pending", "length", "oldest job", "workers"):
        table.add_column(column, justify="left" if column in ("model", "priority") else "right")
    for m in snap.served.values():  # an adapter's streams in its base's rows
        if not (m.workers or any(s.length or s.pending for s in m.priorities.values())):
            continue  # a model nobody serves or asks for any more
        served = str(len(m.workers))
        if m.waiting_for_workers:  # nobody serves it, or (its own name served) its adapters' jobs wait for slots
            served = Text(f"{len(m.workers)}, none with adapter slots" if m.workers else "none: waiting for scale-up",
                          style="bold red")
        for i, s in enumerate(m.priorities.values()):
            age = _age(s.oldest_age_s) if s.oldest_age_s is not None else "-"
            table.add_row(m.model if i == 0 else "", s.priority, str(s.backlog), str(s.pending), str(s.length), age,
                          served if i == 0 else "")
    table.add_row("dead", "", "", "", str(snap.dead), "", "")
    return table


def _wait(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}ms" if seconds < 1 else _age(seconds)


def _tenants_table(snap: QueueStats) -> Table:
    """Per tenant: the busiest by name, the rest summed (limits.TOP_TENANTS); backlog only with fair share."""
    v = snap.tenant_view
    table = Table(title=f"tenants (last {v.to_dict()['window_s']:.0f}s)", expand=True, title_justify="left")
    for column in ("tenant", "backlog", "running", "tokens/s", "wait p50", "wait p99"):
        table.add_column(column, justify="left" if column == "tenant" else "right")
    for t in v.top + [v.other]:
        name = Text("(other tenants)", style="dim") if t is v.other else t.tenant
        table.add_row(name, str(t.backlog) if v.backlog_by_tenant else "-", str(t.running), f"{t.tokens_per_s:,.1f}",
                      _wait(t.wait_quantile(0.5)), _wait(t.wait_quantile(0.99)))
    return table


def _adapters_table(snap: QueueStats) -> Table | None:
    """Per registered LoRA adapter: the most backlog by name, the rest summed (limits.top_and_rest); None: none."""
    v = snap.adapters
    if not v.registered:
        return None
    table = Table(title=f"LoRA adapters ({v.registered} registered)", expand=True, title_justify="left")
    for column in ("adapter", "base", "backlog", "pending", "oldest job", "loaded on"):
        table.add_column(column, justify="left" if column in ("adapter", "base") else "right")
    for a in v.top + ([v.other] if v.other.adapters else []):
        name = Text(f"(other {a.adapters} adapters)", style="dim") if a is v.other else a.adapter
        table.add_row(name, a.base or "", str(a.backlog), str(a.pending),
                      _age(a.oldest_age_s) if a.oldest_age_s is not None else "-", str(a.loaded_on))
    return table


def render(snap: QueueStats, namespace: str) -> Group:
    tokens = sum(w.tokens_per_s for w in snap.workers)
    header = Text.assemble(("kvgate top", "bold"), f"  namespace {namespace}  ",
                           f"free KV {snap.free_kv_tokens:,} tokens  {tokens:,.0f} tokens/s  ",
                           time.strftime("%H:%M:%S"), ("   q to quit", "dim"))
    adapters = _adapters_table(snap)
    return Group(header, _workers_table(snap), _streams_table(snap), _tenants_table(snap),
                 *([adapters] if adapters else []))


def _frame(client: redis.Redis, keys: Keys):
    try:
        return render(read_queue_stats(client, keys), keys.ns)
    except redis.RedisError as e:
        return Text(f"kvgate top: cannot read Redis ({e}); retrying", style="bold red")


@contextlib.contextmanager
def _keys_unbuffered():
    """Single key presses without Enter; the terminal is put back however we leave."""
    if not sys.stdin.isatty():
        yield
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _quit_pressed(timeout: float) -> bool:
    if not sys.stdin.isatty():
        time.sleep(timeout)
        return False
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    return bool(ready) and sys.stdin.read(1) in ("q", "Q")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")


def run(args: argparse.Namespace) -> int:
    url = resolve_url(args.redis_url, DEFAULT_URL)
    client = connect(url, socket_timeout=5, socket_connect_timeout=5)
    keys = keys_for(url, client, args.namespace)
    snap = read_queue_stats(client, keys)  # unreachable or refused: one line from `kvgate`, not a live frame
    console = Console()
    if args.once:
        console.print(render(snap, keys.ns))
        return 0
    try:
        with _keys_unbuffered(), Live(_frame(client, keys), console=console, auto_refresh=False,
                                      screen=True) as live:
            while not _quit_pressed(args.interval):
                live.update(_frame(client, keys), refresh=True)
    except KeyboardInterrupt:
        pass
    return 0
