"""Hostile and malformed input, injected raw into the job stream: every one gets an error event that names
the problem (or a dead-stream entry with the reason when there is nobody to answer), and the worker goes on
serving the good job that follows them (invariant 3)."""
from __future__ import annotations

import math
import random
from collections import Counter
import threading
import time

import msgspec
import pytest

from tests.reliability.chaos_harness import Ledger
from tests.support import RawQueue, wait_for
from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer.keys import Keys
from kvgate.producer.limits import MAX_PAYLOAD_BYTES, MAX_STOP_STRINGS, MAX_TOKENS_LIMIT
from kvgate.producer.protocol import encode
from kvgate.worker.intake import identify
from kvgate.worker.settings import WorkerSettings
from kvgate.worker.worker import Worker


def _raw(q: RawQueue, job_id: str, **changes) -> bytes:
    """A valid job as a plain map, with fields replaced (or removed where the value is DROP)."""
    body = msgspec.to_builtins(q.job("hello world", job_id=job_id))
    body.update(changes)
    return msgspec.msgpack.encode({k: v for k, v in body.items() if v is not DROP})


def _sampling(q: RawQueue, job_id: str, **sampling) -> bytes:
    return _raw(q, job_id, sampling={"max_tokens": 4, **sampling})


def _depth_bomb(levels: int) -> bytes:
    return b"\x91" * levels + b"\xc0"  # [[[[...nil...]]]]


DROP = object()
NESTED_1000 = '{"a":' * 1000 + '{}' + '}' * 1000  # 6 KB of JSON text nested 1,001 objects deep

# name -> (payload, job_id that can be answered, words the error must contain)
def answerable_cases(q: RawQueue) -> dict[str, tuple[bytes, str]]:
    valid = msgspec.to_builtins(q.job("x", job_id="utf8"))
    bad_utf8 = msgspec.msgpack.encode({**valid, "prompt": "hello"}).replace(b"\xa5hello", b"\xa5h\xff\xfelo")
    return {
        "wrong type: prompt is an int": (_raw(q, "wt", prompt=42), "$.prompt"),
        "wrong type: max_tokens is a bool": (_sampling(q, "bool", max_tokens=True), "max_tokens"),
        "wrong type: sampling is a list": (_raw(q, "sl", sampling=[1, 2]), "$.sampling"),
        "missing field enqueued_at": (_raw(q, "mf", enqueued_at=DROP), "enqueued_at"),
        "extra unknown field": (_raw(q, "xf", evil="rm -rf /"), "evil"),
        "huge prompt": (_raw(q, "hp", prompt="x" * 600_000), "prompt has 600000 characters"),
        "huge max_tokens": (_sampling(q, "hm", max_tokens=MAX_TOKENS_LIMIT + 1), "max_tokens"),
        "negative temperature": (_sampling(q, "nt", temperature=-1.0), "temperature=-1.0"),
        "NaN temperature": (_sampling(q, "nan", temperature=math.nan), "temperature=nan"),
        "infinite temperature": (_sampling(q, "inf", temperature=math.inf), "temperature=inf"),
        "top_p above 1": (_sampling(q, "tp1", top_p=1.5), "top_p=1.5"),
        "top_p of 0": (_sampling(q, "tp0", top_p=0.0), "top_p=0.0"),
        "top_k of 0": (_sampling(q, "tk", top_k=0), "top_k=0"),
        "negative seed": (_sampling(q, "seed", seed=-3), "seed=-3"),
        "too many stop strings": (_sampling(q, "ss", stop=["s"] * (MAX_STOP_STRINGS + 1)), "stop strings"),
        "empty stop string": (_sampling(q, "es", stop=[""]), "stop string"),
        "negative stop token id": (_sampling(q, "sti", stop_token_ids=[-5]), "stop_token_ids"),
        "invalid UTF-8 in the prompt": (bad_utf8, "UTF-8"),
        "unknown priority": (_raw(q, "pr", priority="urgent"), "$.priority"),
        "unknown protocol version": (_raw(q, "v9", v=9), "unknown protocol version 9"),
        "oversize payload": (_raw(q, "big", prompt="x" * (MAX_PAYLOAD_BYTES + 10)), "over the limit"),
        "empty prompt": (_raw(q, "ep", prompt=""), "prompt has 0 characters"),
        "prompt and messages both given": (_raw(q, "both", messages=[{"role": "user", "content": "hi"}]),
                                           "exactly one of"),
        "no prompt at all": (_raw(q, "none", prompt=None), "exactly one of"),
        "message with an unknown role": (_raw(q, "role", prompt=None, messages=[{"role": "wizard", "content": "hi"}]),
                                         "$.messages[0].role"),
        "message content not a string": (_raw(q, "mc", prompt=None, messages=[{"role": "user", "content": 5}]),
                                         "$.messages[0].content"),
        "message missing content": (_raw(q, "mm", prompt=None, messages=[{"role": "user"}]), "content"),
        "no messages": (_raw(q, "nm", prompt=None, messages=[]), "messages has 0 entries"),
        "negative prompt token id": (_raw(q, "neg", prompt=None, prompt_token_ids=[1, -2]), "prompt_token_ids"),
        "prompt token id outside the vocabulary": (_raw(q, "oov", prompt=None, prompt_token_ids=[1, 10**9]),
                                                   "outside the vocabulary"),
        "prompt longer than the model": (_raw(q, "long", prompt=None, prompt_token_ids=[7] * 5000),
                                         "max_model_len"),
        "metadata value not a string": (_raw(q, "md", metadata={"k": 1}), "$.metadata"),
        "depth bomb inside a typed field": (_raw(q, "bomb1", metadata=[[[[[[[[[[]]]]]]]]]]), "$.metadata"),
        "deadline in the past": (_raw(q, "late", deadline=time.time() - 60), "deadline passed"),
        # issue 45.1: 2 KB of schema text nested 1,000 deep raised RecursionError out of the intake and killed
        # every worker that read the job (again after each restart, as its pending entry came back)
        "schema text nested 1,000 deep": (_sampling(q, "deep-schema", structured={
            "kind": "json_schema", "spec": NESTED_1000}), "nested too deeply"),
        "tool parameters nested 1,000 deep": (_raw(q, "deep-tool", prompt=None, messages=[{"role": "user",
                                                                                       "content": "hi"}],
                                                   tools={"functions": [{"name": "f", "parameters": NESTED_1000}]}),
                                              "nested too deeply"),
    }


def dead_cases() -> dict[str, tuple[dict, str]]:
    """Entries with nobody to answer: no readable job_id and client_id. name -> (stream fields, reason words)."""
    return {
        "garbage bytes": ({"p": b"\xc1\xff garbage"}, "malformed"),
        "empty payload": ({"p": b""}, "malformed"),
        "msgpack nil": ({"p": b"\xc0"}, "malformed"),
        "array instead of a map": ({"p": msgspec.msgpack.encode([1, "job", 2.0])}, "malformed"),
        "missing p field": ({"q": b"anything"}, "no payload"),
        "map header claiming 4 billion entries": ({"p": b"\xdf\xff\xff\xff\xff"}, "malformed"),
        "deep nesting bomb": ({"p": _depth_bomb(200_000)}, "malformed"),
        "empty job_id": ({"p": msgspec.msgpack.encode({"v": 1, "job_id": "", "client_id": "c" * 16,
                                                       "enqueued_at": 1.0, "prompt": "x"})}, "job_id"),
        "job_id of 300 characters": ({"p": msgspec.msgpack.encode({"v": 1, "job_id": "j" * 300, "client_id": "c" * 16,
                                                                   "enqueued_at": 1.0, "prompt": "x"})}, "job_id"),
    }


@pytest.fixture
def serving(redis_server, namespace):
    """One Worker with a SimulatedEngine in a thread; yields (raw queue, ledger, thread)."""
    keys = Keys(namespace)
    settings = WorkerSettings(redis_url=redis_server.url, namespace=namespace, worker_id="w-bad-input",
                              reclaim_idle_ms=2000)
    engine = SimulatedEngine(num_blocks=512, max_num_seqs=8, step_overhead_s=0.001, per_token_s=0.0)
    worker = Worker(engine, settings)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    queue, ledger = RawQueue(redis_server, namespace), Ledger(redis_server.client(), keys)
    worker._ensure_groups()
    yield queue, ledger, thread
    stop.set()
    thread.join(30)
    assert not thread.is_alive(), "the worker did not stop"


def test_each_hostile_payload_gets_an_error_naming_it_and_the_worker_then_serves_a_good_job(serving):
    queue, ledger, thread = serving
    cases = answerable_cases(queue)
    ids = {}
    for name, (payload, _) in cases.items():
        ids[name] = msgspec.msgpack.decode(payload, type=dict)["job_id"] if name != "invalid UTF-8 in the prompt" \
            else "utf8"
        queue.xadd(payload)
    thread.start()
    unanswered = lambda: sorted(n for n in cases if ids[n] not in ledger.final_counts([queue.client_id]))
    wait_for(lambda: not unanswered(), timeout=20, what=lambda: f"answers to {unanswered()}")
    good = queue.submit("a good job after the bad ones", max_tokens=5)
    wait_for(lambda: good in ledger.final_counts([queue.client_id]), what="the good job's answer")
    time.sleep(0.3)  # a second answer to anything would land by now
    finals = {f.job_id: f for f in ledger.finals([queue.client_id])}
    counts = ledger.final_counts([queue.client_id])
    assert set(counts.values()) == {1}, [k for k, n in counts.items() if n > 1]
    assert finals[good].status == "done" and len(finals[good].token_ids) == 5
    for name, (_, words) in cases.items():
        final = finals[ids[name]]
        expected = "expired" if name == "deadline in the past" else "error"
        assert final.status == expected, (name, final.status)
        assert words in final.error, (name, final.error)
    assert len(cases) >= 20 and ledger.pending() == 0 and thread.is_alive()


def test_entries_with_nobody_to_answer_land_in_the_dead_stream_with_the_reason_and_serving_goes_on(serving):
    queue, ledger, thread = serving
    cases = dead_cases()
    for fields, _ in cases.values():
        queue.r.xadd(queue.keys.jobs(None, "normal"), fields)
    thread.start()
    wait_for(lambda: len(ledger.dead()) >= len(cases), what="a dead-stream entry for each")
    good = queue.submit("still serving", max_tokens=3)
    wait_for(lambda: good in ledger.final_counts([queue.client_id]), what="the good job's answer")
    reasons = [fields[b"reason"].decode() for fields in ledger.dead()]
    assert len(reasons) == len(cases)
    for (name, (_, words)), reason in zip(cases.items(), reasons):  # dead letters keep the order of arrival
        assert words in reason, (name, reason)
    assert ledger.pending() == 0 and thread.is_alive()


def test_a_job_id_injected_again_after_its_answer_is_not_answered_twice(serving):
    """A replayed (or forged) copy of a finished job meets its stored result: acknowledged, not answered again."""
    queue, ledger, thread = serving
    job = queue.job("once", job_id="replayed", max_tokens=3)
    queue.xadd(encode(job))
    thread.start()
    wait_for(lambda: ledger.final_counts([queue.client_id])["replayed"] == 1, what="the first answer")
    queue.xadd(encode(job))
    good = queue.submit("after the replay", max_tokens=3)
    wait_for(lambda: good in ledger.final_counts([queue.client_id]), what="the next job's answer")
    time.sleep(0.2)
    assert ledger.final_counts([queue.client_id])["replayed"] == 1 and ledger.pending() == 0


def mutated_payloads(q: RawQueue, n: int, seed: int = 7) -> list[bytes]:
    """Valid jobs with a field replaced by a random value, or with random bytes flipped, inserted or cut."""
    rng = random.Random(seed)
    junk = [None, True, -1, 0, 2**63, 2**64 - 1, -(2**63), math.nan, math.inf, -0.0, "", "x" * 300, b"\xff\x00",
            [], [1, "a"], {"a": 1}, {"": None}, [[[[[]]]]], "urgent", "wizard", 1e308]
    out = []
    for i in range(n):
        body = msgspec.to_builtins(q.job("a fuzzed job", job_id=f"fz{i}", max_tokens=4))
        if rng.random() < 0.5:
            target = body["sampling"] if rng.random() < 0.4 else body
            target[rng.choice([*target, "extra"])] = rng.choice(junk)
            out.append(msgspec.msgpack.encode(body))
        else:
            raw = bytearray(msgspec.msgpack.encode(body))
            for _ in range(rng.randint(1, 3)):
                at = rng.randrange(len(raw))
                if rng.random() < 0.5:
                    raw[at] ^= rng.randint(1, 255)
                else:
                    del raw[at]
            out.append(bytes(raw))
    return out


def test_200_randomly_mutated_payloads_are_each_answered_or_dead_lettered_and_the_worker_serves_on(serving):
    queue, ledger, thread = serving
    sent = {queue.xadd(payload): identify(payload) for payload in mutated_payloads(queue, 200)}
    thread.start()
    wait_for(lambda: ledger.pending() == 0 and queue.r.xinfo_groups(queue.keys.jobs(None, "normal"))[0]["lag"] == 0,
             timeout=60, what="every mutated entry to be read and settled")
    good = queue.submit("served after the fuzz", max_tokens=3)
    wait_for(lambda: good in ledger.final_counts([queue.client_id]), what="the good job's answer")
    clients = {queue.client_id} | {ident[1] for ident in sent.values() if ident}  # a mutation may hit client_id
    counts = ledger.final_counts(clients)
    dead = {fields[b"entry"].decode() for fields in ledger.dead()}
    unsettled = [e for e, ident in sent.items() if e not in dead and not (ident and counts[ident[0]])]
    assert unsettled == [] and set(counts.values()) == {1} and thread.is_alive()
    statuses = Counter(f.status for f in ledger.finals(clients))
    print(f"\n200 mutated payloads: {statuses}, {len(dead)} dead-lettered")
