"""The worker sends each step's outbox on an I/O thread while the engine keeps stepping: what is in flight is
kept apart from what the next step adds, cleared only when its replies settle, and sent again first when the
round trip fails."""
from __future__ import annotations

import pytest
import redis

from kvgate.producer.keys import Keys
from kvgate.producer.protocol import PROTOCOL_VERSION, Delta
from kvgate.worker.publisher import Publisher


def delta(i: int) -> Delta:
    return Delta(PROTOCOL_VERSION, "job", i, f"t{i}", [i])


@pytest.fixture
def publisher(redis_server, namespace) -> Publisher:
    return Publisher(redis_server.client(), Keys(namespace), 60, 60, 1000, 1000)


def test_events_added_while_a_fill_is_in_flight_wait_for_the_next_fill(publisher):
    publisher.delta("c", delta(0), "k")
    pipe = publisher.client.pipeline(transaction=False)
    n = publisher.fill(pipe)
    publisher.delta("c", delta(1), "k")  # the next step, while the first round trip is on its way
    assert publisher.pending == 2
    with pytest.raises(RuntimeError, match="has not settled"):
        publisher.fill(publisher.client.pipeline(transaction=False))
    publisher.settle(pipe.execute(raise_on_error=False)[:n])
    assert [d.index for _, d, _ in publisher.deltas] == [1] and publisher.pending == 1


def test_a_failed_round_trip_goes_out_again_before_newer_events(publisher):
    publisher.delta("c", delta(0), "k")
    publisher.fill(publisher.client.pipeline(transaction=False))
    publisher.delta("c", delta(1), "k")
    publisher.requeue()  # the connection dropped: nothing of the first fill is known to have landed
    assert [d.index for _, d, _ in publisher.deltas] == [0, 1]


def test_a_server_refusal_on_settle_requeues_the_fill_and_raises(publisher):
    publisher.delta("c", delta(0), "k")
    publisher.fill(publisher.client.pipeline(transaction=False))
    publisher.delta("c", delta(1), "k")
    with pytest.raises(redis.ResponseError, match="OOM"):
        publisher.settle([redis.ResponseError("OOM command not allowed"), 1])
    assert [d.index for _, d, _ in publisher.deltas] == [0, 1] and publisher.pending == 2
