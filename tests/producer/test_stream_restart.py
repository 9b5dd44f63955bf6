"""The stream contract on the wire, event by event: attempts, restarts, a zombie's late deltas, a version-1 delta."""
from __future__ import annotations

from kvgate.producer import Restart
from kvgate.producer.protocol import FIELD, PROTOCOL_VERSION, Delta, encode


def send(worker, job, index: int, text: str, attempt: int = 1, v: int = PROTOCOL_VERSION) -> None:
    delta = Delta(v=v, job_id=job.job_id, index=index, text=text, token_ids=[index], attempt=attempt)
    worker.r.xadd(worker.keys.reply(job.client_id), {FIELD: encode(delta)})


def read(items) -> str:
    text: list[str] = []
    for item in items:
        text = [] if isinstance(item, Restart) else [*text, item.text]
    return "".join(text)


def test_a_newer_attempt_restarts_the_stream_and_an_older_ones_late_deltas_are_dropped(client, worker):
    handle = client.submit("hi", stream=True)
    job, = worker.take()
    send(worker, job, 0, "a1 ")
    send(worker, job, 1, "a2 ")
    send(worker, job, 0, "b1 ", attempt=2)
    send(worker, job, 2, "a3 ")  # the zombie of attempt 1 resumes
    send(worker, job, 1, "b2", attempt=2)
    worker.final(job, text="b1 b2", token_ids=[0, 1])
    items = list(handle.stream(timeout=5))
    assert [type(i).__name__ for i in items] == ["Delta", "Delta", "Restart", "Delta", "Delta"]
    assert read(items) == "b1 b2" == handle.result(timeout=1).text


def test_a_result_that_does_not_continue_the_stream_restarts_it_with_the_whole_text(client, worker):
    handle = client.submit("hi", stream=True)
    job, = worker.take()
    send(worker, job, 0, "b1 ", attempt=2)
    worker.final(job, text="a1 a2 a3", token_ids=[7, 8, 9])  # the zombie's attempt finished first
    items = list(handle.stream(timeout=5))
    assert isinstance(items[-2], Restart) and read(items) == "a1 a2 a3"


def test_a_version_1_delta_reads_as_attempt_1(client, worker):
    handle = client.submit("hi", stream=True)
    job, = worker.take()
    send(worker, job, 0, "old ", v=1)
    worker.final(job, text="old worker", token_ids=[0, 1])
    items = list(handle.stream(timeout=5))
    assert [i.text for i in items] == ["old ", "worker"] and items[0].attempt == 1
