"""Per LoRA adapter backlog and wait, per worker the adapters in its slots (issue 42, "Metrics and views"), as
`kvgate stats` (text and --json), `kvgate top` and the exporter read them: the ten adapters with the most backlog by
name, the rest summed as `_other` (the tenant views' rule, limits.top_and_rest)."""
from __future__ import annotations

import json
import time

import pytest

from kvgate.commands import exporter
from kvgate.commands.cli import main
from kvgate.commands.stats import NO_SLOTS
from kvgate.producer import Client
from kvgate.producer.keys import Keys
from kvgate.producer.limits import OTHER_NAMED, TOP_NAMED
from kvgate.producer.queue_stats import read_queue_stats
from kvgate.worker.heartbeat import write_beat

BASE = "org/base"
NAMES = [f"a{i:02}" for i in range(12)]  # a00 has 1 job waiting, a01 2, ... a11 12 (and one 30 s old)


def _twelve_adapters(url: str, namespace: str, r) -> None:
    keys = Keys(namespace)
    with Client(url, namespace) as client:
        for i, name in enumerate(NAMES):
            client.add_lora(name, f"/adapters/{name}", BASE)
            client.submit_many([{"prompt": "x", "model": name, "max_tokens": 4}] * (i + 1), progress=False)
    seconds, micros = r.time()
    r.xadd(keys.jobs("a11", "low"), {"p": b"x"}, id=f"{seconds * 1000 + micros // 1000 - 30_000}-0")
    loras = json.dumps({"loaded": ["a11", "a00"], "loads": 5, "evictions": 3})
    write_beat(r, keys, "w1", {"worker_id": "w1", "model": BASE, "models": BASE, "updated_at": time.time(),
                               "loras": loras}, ttl_s=30)


def test_stats_name_the_ten_adapters_with_the_most_backlog_and_sum_the_other_two_as_other(redis_server, namespace,
                                                                                          capsys):
    r = redis_server.client()
    _twelve_adapters(redis_server.url, namespace, r)
    stats = read_queue_stats(r, Keys(namespace))
    got = stats.adapters
    assert stats.models["a11"].workers == ["w1"] and not stats.models["a11"].waiting_for_workers  # w1 reads its streams
    assert [a.adapter for a in got.top] == [f"a{i:02}" for i in range(11, 1, -1)]  # most backlog first
    assert [a.backlog for a in got.top] == [13] + list(range(11, 2, -1))  # every priority: a11's low job too
    assert (got.other.adapter, got.other.backlog, got.other.adapters) == (OTHER_NAMED, 1 + 2, 2)
    a11 = got.top[0]
    assert a11.base == BASE and 29 <= a11.oldest_age_s < 120 and got.top[1].oldest_age_s < 29  # the wait
    assert a11.loaded_on == 1 and got.other.loaded_on == 1  # a00, summed in `_other`, is loaded on w1 too

    assert main(["stats", "--redis-url", redis_server.url, "--namespace", namespace]) == 0
    text = capsys.readouterr().out
    table = text.split("\nadapter ", 1)[1].splitlines()[1:]  # the adapters' table (each counts in its base's row)
    rows = {line.split()[0]: line.split() for line in table if line.startswith("a")}
    assert set(rows) == {a.adapter for a in got.top}  # a00 and a01 are not named
    assert not any(line.startswith("a00") for line in text.splitlines())  # nor listed as models: bounded
    assert rows["a11"][1:4] == [BASE, "13", "0"] and rows["a11"][5] == "1"
    other = next(line for line in table if line.startswith("(other 2 adapters)"))
    assert other.split()[3] == "3"
    assert "adapters loaded: a00, a11   loads 5   evictions 3" in text  # the worker's slots

    assert main(["stats", "--redis-url", redis_server.url, "--namespace", namespace, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [a["adapter"] for a in d["adapters"]["top"]] == [a.adapter for a in got.top]
    assert d["adapters"]["other"] | {"oldest_age_s": None} == {
        "adapter": OTHER_NAMED, "base": None, "backlog": 3, "pending": 0, "oldest_age_s": None, "loaded_on": 1,
        "adapters": 2}
    assert d["adapters"]["registered"] == 12
    assert d["workers"][0]["loras"] == {"loaded": ["a00", "a11"], "count": 2, "loads": 5, "evictions": 3}


def test_the_exporter_labels_the_ten_adapters_with_the_most_backlog_and_other(redis_server, namespace):
    r = redis_server.client()
    _twelve_adapters(redis_server.url, namespace, r)
    samples = {(s.name, s.labels["adapter"]): s.value for f in exporter.build_registry(r, Keys(namespace)).collect()
               if f.name.startswith("kvgate_adapter") for s in f.samples}
    backlog = {a: v for (name, a), v in samples.items() if name == "kvgate_adapter_backlog"}
    assert backlog == {f"a{i:02}": (13 if i == 11 else i + 1) for i in range(2, 12)} | {OTHER_NAMED: 3}
    assert len(backlog) == TOP_NAMED + 1  # bounded however many adapters are registered
    assert 29 <= samples[("kvgate_adapter_oldest_job_age_seconds", "a11")] < 120
    assert samples[("kvgate_adapter_loaded_workers", "a11")] == 1
    assert samples[("kvgate_adapter_loaded_workers", OTHER_NAMED)] == 1
    assert samples[("kvgate_adapter_pending", OTHER_NAMED)] == 0
    per_model = {s.labels["model"] for f in exporter.build_registry(r, Keys(namespace)).collect() for s in f.samples
                 if "model" in s.labels}
    assert per_model == {BASE, "default"}  # the adapters count in their base's rows, not one series each
    assert exporter.build_registry(r, Keys(namespace)).get_sample_value(  # w1 serves them
        "kvgate_model_waiting_for_workers", {"kvgate_namespace": namespace, "model": BASE, "served_by": BASE}) == 0


def test_top_shows_the_ten_adapters_with_the_most_backlog_the_rest_as_other_and_each_workers_slots(redis_server,
                                                                                                 namespace):
    pytest.importorskip("rich", reason="kvgate top needs the worker extra's rich (make test-pythons runs without it)")
    from rich.console import Console

    from kvgate.commands import top

    r = redis_server.client()
    _twelve_adapters(redis_server.url, namespace, r)
    console = Console(record=True, width=200, color_system=None)
    console.print(top.render(read_queue_stats(r, Keys(namespace)), namespace))
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in console.export_text().splitlines()]
    adapters = {row[0]: row for row in cells if len(row) == 6 and row[1] in (BASE, "")}
    assert set(adapters) == {f"a{i:02}" for i in range(2, 12)} | {"(other 2 adapters)"}
    assert adapters["a11"][2:4] == ["13", "0"] and adapters["a11"][4].endswith("s")
    assert adapters["(other 2 adapters)"][2] == "3"
    worker = next(row for row in cells if len(row) > 1 and row[1] == "w1")
    assert worker[-2:] == ["a00, a11", "5/3"]


def test_a_fleet_without_adapters_shows_no_adapter_table_or_series(redis_server, namespace, capsys):
    r = redis_server.client()
    write_beat(r, Keys(namespace), "w1", {"worker_id": "w1", "model": BASE, "models": BASE, "loras": ""}, ttl_s=30)
    got = read_queue_stats(r, Keys(namespace))
    assert got.adapters.registered == 0 and got.workers[0].loras is None
    assert main(["stats", "--redis-url", redis_server.url, "--namespace", namespace]) == 0
    assert "adapter" not in capsys.readouterr().out
    families = {f.name: f for f in exporter.build_registry(r, Keys(namespace)).collect()}
    assert not families["kvgate_adapter_backlog"].samples


def test_a_heartbeats_adapter_names_are_kept_to_a_bound_and_a_bad_field_counts_for_nothing(redis_server, namespace):
    from kvgate.producer.adapter_view import MAX_LOADED_NAMES

    r, keys = redis_server.client(), Keys(namespace)
    many = json.dumps({"loaded": [f"x{i:03}" for i in range(200)], "loads": 200, "evictions": 0})
    write_beat(r, keys, "w1", {"worker_id": "w1", "loras": many}, ttl_s=30)
    write_beat(r, keys, "w2", {"worker_id": "w2", "loras": "not json{"}, ttl_s=30)
    write_beat(r, keys, "w3", {"worker_id": "w3", "loras": json.dumps({"loaded": [], "loads": -1, "evictions": 0})},
               ttl_s=30)
    w1, w2, w3 = read_queue_stats(r, keys).workers
    assert len(w1.loras.loaded) == MAX_LOADED_NAMES and w1.loras.count == 200
    assert w1.loras.shown().endswith(f"(+{200 - MAX_LOADED_NAMES} more)")
    assert w2.loras is None and w3.loras is None


def test_an_adapters_jobs_wait_for_workers_while_its_bases_workers_have_no_adapter_slots(redis_server, namespace,
                                                                                          capsys):
    r, keys = redis_server.client(), Keys(namespace)
    with Client(redis_server.url, namespace) as client:
        client.add_lora("c", "/adapters/c", BASE)
        client.submit_many([{"prompt": "x", "model": "c"}], progress=False)
    write_beat(r, keys, "w1", {"worker_id": "w1", "model": BASE, "models": BASE, "loras": ""}, ttl_s=30)
    got = read_queue_stats(r, keys).models["c"]
    assert got.workers == [] and got.waiting_for_workers and got.adapter_of == BASE
    labels = {"kvgate_namespace": namespace, "model": BASE, "served_by": BASE}  # its base's row says so: it alerts
    registry = exporter.build_registry(r, keys)
    assert registry.get_sample_value("kvgate_model_waiting_for_workers", labels) == 1
    assert registry.get_sample_value("kvgate_model_live_workers", labels) == 1
    assert main(["stats", "--redis-url", redis_server.url, "--namespace", namespace]) == 0  # and so does stats'
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(BASE))
    assert row.split()[1] == "1" and row.endswith(f"served by 1 worker(s): w1; {NO_SLOTS}")


def test_a_bases_row_in_stats_and_top_counts_its_adapters_jobs_as_the_exporters_does(redis_server, namespace,
                                                                                      capsys):
    """`kvgate stats` (text and --json) and `kvgate top` show the exporter's per-model rows (QueueStats.served): the
    base's backlog counts its adapters' jobs per priority, equal to its `kvgate_queue_lag`, the adapters have no rows
    of their own there (their view is the adapters' table), and the rows add up to the total. Before, the base's row
    left its adapters' jobs out: 2 waiting where the exporter said 6."""
    pytest.importorskip("rich", reason="kvgate top needs the worker extra's rich (make test-pythons runs without it)")
    from rich.console import Console

    from kvgate.commands import top

    r, keys = redis_server.client(), Keys(namespace)
    with Client(redis_server.url, namespace) as client:
        client.add_lora("sql", "/adapters/sql", BASE)
        client.add_lora("chat", "/adapters/chat", BASE)
        client.submit_many([{"prompt": "x", "model": BASE, "priority": "high"}] * 2, progress=False)
        client.submit_many([{"prompt": "x", "model": "sql"}] * 3, progress=False)
        client.submit_many([{"prompt": "x", "model": "chat", "priority": "low"}], progress=False)
    write_beat(r, keys, "w1", {"worker_id": "w1", "model": BASE, "models": BASE, "updated_at": time.time(),
                               "loras": json.dumps({"loaded": ["sql"], "loads": 1, "evictions": 0})}, ttl_s=30)
    registry = exporter.build_registry(r, keys)
    lag = {p: registry.get_sample_value("kvgate_queue_lag", {"kvgate_namespace": namespace, "model": BASE,
                                                             "served_by": BASE, "priority": p})
           for p in ("high", "normal", "low")}
    assert lag == {"high": 2, "normal": 3, "low": 1}  # the exporter's figure for the base

    assert main(["stats", "--redis-url", redis_server.url, "--namespace", namespace, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    base = d["models"][BASE]
    assert {p: s["backlog"] for p, s in base["priorities"].items()} == lag
    assert set(d["models"]) == {BASE, "default"}  # sql and chat count in their base's row
    assert (base["backlog"], base["workers"], base["waiting_for_workers"]) == (6, ["w1"], False)
    assert sum(m["backlog"] for m in d["models"].values()) == d["backlog"] == 6

    assert main(["stats", "--redis-url", redis_server.url, "--namespace", namespace]) == 0
    lines = capsys.readouterr().out.split("\nadapter ", 1)[0].splitlines()  # the per-model table, not the adapters'
    row = next(line.split() for line in lines if line.startswith(BASE))
    assert row[1:3] == ["6", "0"] and "served by 1 worker(s): w1" in " ".join(row)
    subrows = {line.split()[0]: line.split()[1] for line in lines
               if line.startswith(" ") and line.split()[0] in lag}
    assert subrows == {p: str(int(n)) for p, n in lag.items()}
    assert not any(line.startswith(("sql", "chat")) for line in lines)

    console = Console(record=True, width=200, color_system=None)
    console.print(top.render(read_queue_stats(r, keys), namespace))
    text = console.export_text()
    streams = text.split("streams", 1)[1].split("tenants", 1)[0]
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in streams.splitlines()]
    rows = [row for row in cells if len(row) == 7 and row[1] in lag]
    start = next(i for i, row in enumerate(rows) if row[0] == BASE)
    assert {row[1]: row[2] for row in rows[start:start + 3]} == {p: str(int(n)) for p, n in lag.items()}
    assert rows[start][6] == "1" and not [row for row in rows if row[0] in ("sql", "chat")]
