"""A streamed gateway reply whose job restarts mid-stream (a drain hands it back; another worker runs it again).

An SSE client cannot take text back: a restart that repeats itself goes on seamlessly, one that differs fails
with `stream_restarted`. Real `kvgate worker --simulated` processes: workers with one engine seed generate the
same text for a job, workers with different seeds different text."""
from __future__ import annotations

import signal
import threading

import openai
import pytest

from kvgate.gateway.errors import ApiError
from kvgate.gateway.chat.replay import Replay
from kvgate.producer import Client, Delta, Restart
from tests.gateway.conftest import start_gateway, wait_for_workers
from tests.reliability.chaos_harness import stop_all
from tests.reliability.test_stream_attempts import SLOW as STREAM_ATTEMPTS_WORKER
from tests.support import spawn_worker, wait_for

SLOW = (*STREAM_ATTEMPTS_WORKER, "--drain-timeout", "0.2")


def delta(text: str, n: int = 1, attempt: int = 1, logprobs=None) -> Delta:
    return Delta(2, "j", 0, text, list(range(n)), attempt, logprobs)


def test_replay_sends_only_what_the_client_has_not_seen():
    r = Replay()
    assert r.take(delta("Hel")) == ("Hel", None) and r.take(delta("lo")) == ("lo", None)
    assert r.take(Restart("j", 2, "redelivered")) is None
    assert r.take(delta("He", attempt=2)) is None and r.take(delta("l", attempt=2)) is None  # a repeat: nothing
    assert r.take(delta("lo w", attempt=2)) == (" w", None)  # straddles the sent text: only the growth
    assert r.take(delta("orld", attempt=2)) == ("orld", None)


def test_replay_keeps_logprobs_of_new_tokens_only_and_passes_a_mid_character_token():
    r = Replay()
    assert r.take(delta("ab", 2, logprobs=["a", "b"])) == ("ab", ["a", "b"])
    assert r.take(delta("", 1, logprobs=["half"])) == ("", ["half"])  # no text yet, a logprob all the same
    r.take(Restart("j", 2, "redelivered"))
    assert r.take(delta("ab", 2, 2, ["a", "b"])) is None
    assert r.take(delta("c", 2, 2, ["half", "c"])) == ("c", ["c"])


def test_replay_refuses_a_restart_that_says_something_else():
    r = Replay()
    r.take(delta("Hello"))
    r.take(Restart("j", 2, "redelivered"))
    assert r.take(delta("Hel", attempt=2)) is None
    with pytest.raises(ApiError, match="attempt 2.*differs") as e:
        r.take(delta("p!", attempt=2))
    assert e.value.code == "stream_restarted"


@pytest.fixture
def fleet(redis_server, namespace, tmp_path):
    procs, gw = [], start_gateway(redis_server.url, namespace)

    def spawn(worker_id: str, seed: int):
        procs.append(spawn_worker(redis_server.url, namespace, *SLOW, "--seed", str(seed), worker_id=worker_id,
                                  log=tmp_path / f"{worker_id}.log"))
        wait_for_workers(redis_server.url, namespace, count=1, proc=procs[-1])
        return procs[-1]

    yield gw, spawn
    gw.stop()
    stop_all(procs)


class Chat:
    """One streamed chat, read in a thread through the official client."""

    def __init__(self, base_url: str):
        self.pieces, self.error, self.job_id = [], None, None
        self.client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            raw = self.client.chat.completions.with_raw_response.create(
                model="simulated", max_tokens=160, stream=True,
                messages=[{"role": "user", "content": "tell a long story"}])
            self.job_id = raw.headers["x-request-id"]
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    self.pieces.append(chunk.choices[0].delta.content)
        except openai.APIError as e:
            self.error = e

    def join(self) -> None:
        self.thread.join(60)
        assert not self.thread.is_alive()


def restart_mid_stream(fleet, second_seed: int) -> Chat:
    gw, spawn = fleet
    first = spawn("a", 1)
    chat = Chat(gw.base_url)
    wait_for(lambda: len(chat.pieces) >= 20 or chat.error, 60, "20 streamed pieces from the first worker")
    assert chat.error is None, chat.error
    first.send_signal(signal.SIGTERM)  # drains: the running job is aborted and handed back after 0.2 s
    assert first.wait(20) == 0
    spawn("b", second_seed)
    chat.join()
    return chat


def test_a_restart_that_repeats_itself_streams_on_seamlessly(fleet, redis_server, namespace):
    chat = restart_mid_stream(fleet, second_seed=1)
    assert chat.error is None, chat.error
    with Client(redis_server.url, namespace) as sdk:
        result = sdk.attach(chat.job_id).result(timeout=10)
    assert result.attempt == 2, "the job ran twice"
    assert "".join(chat.pieces) == result.text and len(result.token_ids) == 160


def test_a_restart_that_differs_fails_the_stream_instead_of_splicing_two_texts(fleet):
    chat = restart_mid_stream(fleet, second_seed=2)
    assert chat.error is not None and "stream_restarted" in str(chat.error.body or chat.error), chat.error
