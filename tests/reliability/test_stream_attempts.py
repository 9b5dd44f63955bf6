"""Invariant 7: what `stream()` yields, read as documented (the deltas' texts joined since the last Restart),
is the result's text, also when the job is generated twice with different text.

Real `kvgate worker --simulated` processes; the two workers of each test run with different engine seeds, so a
redelivered job (no per-job seed, as with temperature > 0 and no seed) writes a different text. Before the
attempt number, the SDK spliced the first worker's early deltas to the second worker's later ones."""
from __future__ import annotations

import signal
import threading
import time

import pytest

from kvgate.producer import Client
from tests.reliability.chaos_harness import stop_all
from tests.support import spawn_worker, wait_for

SLOW = ("--simulated", "--sim-step-ms", "15", "--sim-per-token-ms", "0", "--max-num-seqs", "4",
        "--reclaim-idle-ms", "1000")


class Reader:
    """Consumes a handle's stream in a thread, keeping every item."""

    def __init__(self, handle):
        self.items, self.error = [], None
        self.thread = threading.Thread(target=self._run, args=(handle,), daemon=True)
        self.thread.start()

    def _run(self, handle) -> None:
        try:
            for item in handle.stream(timeout=40):
                self.items.append(item)
        except Exception as e:  # shown by the test's assertion
            self.error = e

    def deltas(self) -> int:
        return len(self.items)

    def join(self) -> None:
        self.thread.join(45)
        assert self.error is None, f"stream() raised {self.error!r}"


def read_as_documented(items) -> str:
    """The stream's text: the deltas' texts joined since the last Restart (by name, so this reads old SDKs too)."""
    text: list[str] = []
    for item in items:
        if type(item).__name__ == "Restart":
            text = []
        else:
            text.append(item.text)
    return "".join(text)


@pytest.fixture
def fleet(redis_server, namespace, tmp_path):
    procs = []

    def spawn(worker_id: str, seed: int, *extra: str):
        proc = spawn_worker(redis_server.url, namespace, *SLOW, "--seed", str(seed), *extra, worker_id=worker_id,
                            log=tmp_path / f"{worker_id}.log")
        procs.append(proc)
        return proc

    with Client(redis_server.url, namespace) as client:
        yield client, spawn
    stop_all(procs)


def submit_long(client, **extra):
    return client.submit("tell a long story", max_tokens=160, ignore_eos=True, stream=True, **extra)


def stream_from_first_worker(fleet, *worker_args: str, **submit):
    """Worker "a" (engine seed 1) streams a long job until 20 deltas are in: its process, handle and reader."""
    client, spawn = fleet
    first = spawn("a", 1, *worker_args)
    handle = submit_long(client, **submit)
    reader = Reader(handle)
    wait_for(lambda: reader.deltas() >= 20, 30, "20 deltas from the first worker")
    return first, handle, reader


def check_reconstructs(reader: Reader, handle) -> None:
    reader.join()
    result = handle.result(timeout=5)
    assert result.status == "done" and len(result.token_ids) == 160
    assert read_as_documented(reader.items) == result.text
    restarts = [i for i in reader.items if type(i).__name__ == "Restart"]
    assert restarts, "the job was generated twice, so the stream must have restarted"
    last = max(i for i, item in enumerate(reader.items) if type(item).__name__ == "Restart")
    assert all(item.attempt == result.attempt for item in reader.items[last + 1:])


def test_stream_after_a_sigkill_mid_generation_restarts_and_reconstructs_the_result(fleet):
    _, spawn = fleet
    first, handle, reader = stream_from_first_worker(fleet)
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    spawn("b", seed=2)
    check_reconstructs(reader, handle)
    assert handle.result().attempt == 2


def test_stream_after_a_drain_hand_back_restarts_and_reconstructs_the_result(fleet):
    _, spawn = fleet
    first, handle, reader = stream_from_first_worker(fleet, "--drain-timeout", "0.2")
    first.send_signal(signal.SIGTERM)  # drains: its running job is aborted and handed back after 0.2 s
    assert first.wait(20) == 0
    spawn("b", seed=2)
    check_reconstructs(reader, handle)


def test_logprobs_restart_with_the_text_after_a_drain_hand_back(fleet):
    _, spawn = fleet
    first, handle, reader = stream_from_first_worker(fleet, "--drain-timeout", "0.2", logprobs=2)
    first.send_signal(signal.SIGTERM)
    assert first.wait(20) == 0
    spawn("b", seed=2)
    check_reconstructs(reader, handle)
    result = handle.result(timeout=5)
    last = max(i for i, item in enumerate(reader.items) if type(item).__name__ == "Restart")
    streamed = [t for item in reader.items[last + 1:] for t in item.logprobs]
    assert streamed == result.logprobs and [t.id for t in streamed] == result.token_ids
    assert "".join(t.text for t in streamed) == result.text


def test_a_zombie_workers_late_deltas_are_not_spliced_into_the_stream(fleet):
    _, spawn = fleet
    zombie, handle, reader = stream_from_first_worker(fleet)
    zombie.send_signal(signal.SIGSTOP)  # stalls past the 1 s reclaim timeout: its job is taken over
    spawn("b", seed=2)
    wait_for(lambda: any(getattr(i, "attempt", 1) > 1 or type(i).__name__ == "Restart" for i in reader.items)
             or len(reader.items) >= 40, 30, "deltas from the second worker")
    time.sleep(0.3)
    zombie.send_signal(signal.SIGCONT)  # resumes mid-generation of the job it no longer holds
    check_reconstructs(reader, handle)
