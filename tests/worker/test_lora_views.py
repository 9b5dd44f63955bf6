"""A real worker's adapter slots as `kvgate stats`, `kvgate top` and the exporter read them from its heartbeat
(issue 42, "Metrics and views"): the adapters its slots hold, its loads and evictions."""
from __future__ import annotations

from rich.console import Console

from kvgate.commands import exporter, stats as stats_command, top
from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer import Client
from kvgate.producer.keys import Keys
from kvgate.producer.queue_stats import read_queue_stats
from tests.support import wait_for

BASE = "org/base"


def test_a_worker_with_one_slot_serving_two_adapters_counts_two_loads_and_one_eviction(thread_worker, queue,
                                                                                          tmp_path):
    engine = SimulatedEngine(num_blocks=512, max_num_seqs=8, step_overhead_s=0.002, per_token_s=0.00005, max_loras=1)
    keys = Keys(queue.ns)
    with Client(queue.server.url, queue.ns) as client:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            (tmp_path / name / "adapter_config.json").write_text("{}")
            client.add_lora(name, str(tmp_path / name), BASE)
        with thread_worker(engine=engine, worker_id="w1", served_model_name=BASE, max_loras=1,
                           heartbeat_interval_s=0.1):
            for name in ("a", "b"):  # one after the other: b takes a's slot once a's job is done
                assert client.submit("hi", lora=name, max_tokens=3).result(timeout=60).status == "done"

            def seen():
                w = next((w for w in read_queue_stats(queue.r, keys).workers if w.worker_id == "w1"), None)
                return w if w is not None and w.loras is not None and w.loras.loads == 2 else None

            w = wait_for(seen, 30, "a heartbeat with both loads")
            assert (w.loras.loaded, w.loras.count, w.loras.evictions) == (["b"], 1, 1)
            snap = read_queue_stats(queue.r, keys)
            assert "adapters loaded: b   loads 2   evictions 1" in stats_command.render(snap, queue.ns)
            console = Console(record=True, width=200, color_system=None)
            console.print(top.render(snap, queue.ns))
            row = next(line for line in console.export_text().splitlines() if "│ w1 " in line)
            assert [c.strip() for c in row.split("│")[-3:-1]] == ["b", "2/1"]
            b = next(a for a in snap.adapters.top if a.adapter == "b")
            assert b.loaded_on == 1 and next(a for a in snap.adapters.top if a.adapter == "a").loaded_on == 0
            registry = exporter.build_registry(queue.r, keys)
            assert registry.get_sample_value("kvgate_adapter_loaded_workers",
                                             {"kvgate_namespace": queue.ns, "adapter": "b"}) == 1
