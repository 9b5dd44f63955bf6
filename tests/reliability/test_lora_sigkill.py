"""SIGKILL of a worker mid-generation with LoRA adapters loaded loses nothing: its adapters' jobs are reclaimed by
another worker of the base model, which loads the adapters itself, and each job is answered once, under its adapter's
name. Real `kvgate worker --simulated` processes with adapter slots."""
from __future__ import annotations

import signal

from kvgate.producer import Client
from tests.reliability.chaos_harness import stop_all
from tests.support import spawn_worker, wait_for

SLOW = ("--simulated", "--sim-step-ms", "15", "--sim-per-token-ms", "0", "--max-num-seqs", "4",
        "--reclaim-idle-ms", "1000", "--served-model-name", "org/base", "--max-loras", "2")


def test_sigkill_mid_generation_with_adapters_loaded_loses_no_job(redis_server, namespace, tmp_path):
    folders = {name: tmp_path / name for name in ("c1", "c2")}
    for folder in folders.values():
        folder.mkdir()
        (folder / "adapter_config.json").write_text("{}")
    loras = [arg for name, folder in folders.items() for arg in ("--lora", f"{name}={folder}")]
    procs = []

    def spawn(worker_id: str):
        procs.append(spawn_worker(redis_server.url, namespace, *SLOW, *loras, worker_id=worker_id,
                                  log=tmp_path / f"{worker_id}.log"))
        return procs[-1]

    try:
        with Client(redis_server.url, namespace) as client:
            first = spawn("a")
            wait_for(lambda: set(client.loras()) == {"c1", "c2"}, 60, "worker a to register its --lora adapters")
            handles = [client.submit("tell a long story", lora=name, max_tokens=120, ignore_eos=True)
                       for name in ("c1", "c2") for _ in range(3)]
            wait_for(lambda: sum(h.status().state == "running" for h in handles) >= 2, 60,
                     "adapter jobs running on worker a")
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            spawn("b")
            results = {h.job_id: h.result(timeout=120) for h in handles}
    finally:
        stop_all(procs)
    assert all(r.status == "done" for r in results.values()), [(r.status, r.error) for r in results.values()]
    assert sorted(r.model for r in results.values()) == ["c1"] * 3 + ["c2"] * 3
    assert sum(r.worker == "b" for r in results.values()) >= 2  # at least the jobs running on a when it died
