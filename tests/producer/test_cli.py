"""`kvgate submit`, `kvgate batch` (OpenAI Batch format, resumable, bad lines) and `kvgate stats`."""
from __future__ import annotations

import json
import threading
import time

import pytest

from kvgate.producer.keys import PRIORITIES
from kvgate.commands.cli import main


class EchoWorker(threading.Thread):
    """Answers every job with 'echo: <last message or prompt>' until stopped, or fails those asking for it."""

    def __init__(self, fake):
        super().__init__(daemon=True)
        self.fake, self.stopping, self.served = fake, threading.Event(), 0
        fake.ensure_groups()

    def run(self):
        while not self.stopping.is_set():
            for priority in PRIORITIES:
                for job in self.fake.take(priority, count=50, block_ms=20):
                    text = job.prompt if job.prompt is not None else job.messages[-1].content
                    if job.stream:
                        self.fake.delta(job, 0, "echo", [1])
                    if "FAIL" in text:
                        self.fake.final(job, status="error", error="the model refused")
                    else:
                        self.fake.final(job, text=f"echo: {text}", token_ids=[1, 2])
                    self.served += 1


@pytest.fixture
def echo(worker):
    thread = EchoWorker(worker)
    thread.start()
    yield thread
    thread.stopping.set()
    thread.join(5)


def _cli(redis_url, namespace, *argv) -> int:
    return main([argv[0], "--redis-url", redis_url, "--namespace", namespace, *argv[1:]])


def test_submit_command_prints_the_answer(redis_url, namespace, echo, capsys):
    assert _cli(redis_url, namespace, "submit", "hello there", "--timeout", "10") == 0
    assert capsys.readouterr().out.strip() == "echo: hello there"


def test_submit_command_streams_and_prints_json(redis_url, namespace, echo, capsys):
    assert _cli(redis_url, namespace, "submit", "hi", "--stream", "--system", "be brief", "--timeout", "10") == 0
    assert capsys.readouterr().out.strip() == "echo: hi"
    assert _cli(redis_url, namespace, "submit", "hi", "--json", "--timeout", "10") == 0
    row = json.loads(capsys.readouterr().out)
    assert row["status"] == "done" and row["text"] == "echo: hi" and row["latency_s"] > 0


def test_submit_command_rejects_bad_input_with_exit_2(redis_url, namespace, capsys):
    assert _cli(redis_url, namespace, "submit", "hi", "--temperature", "-1") == 2
    assert "temperature=-1.0" in capsys.readouterr().err


def test_submit_command_sends_penalties_and_logprobs_and_prints_them(redis_url, namespace, worker, capsys):
    from kvgate.producer.protocol import TokenLogprob, TopLogprob

    answer = [TokenLogprob(1, "echo", b"echo", -0.25, [TopLogprob(1, "echo", b"echo", -0.25),
                                                        TopLogprob(2, "ECHO", b"ECHO", -1.5)])]

    def serve():
        (job,) = worker.take(block_ms=5000)
        sent.append(job.sampling)
        worker.final(job, text="echo", token_ids=[1], logprobs=answer)

    worker.ensure_groups()
    for extra in ([], ["--json"]):
        sent: list = []
        thread = threading.Thread(target=serve)
        thread.start()
        assert _cli(redis_url, namespace, "submit", "hi", "--logprobs", "2", "--frequency-penalty", "0.5",
                    "--presence-penalty", "-1", "--timeout", "10", *extra) == 0
        thread.join(10)
        assert (sent[0].logprobs, sent[0].frequency_penalty, sent[0].presence_penalty) == (2, 0.5, -1.0)
    printed = capsys.readouterr()
    assert "'echo'\t-0.250\t['echo' -0.250, 'ECHO' -1.500]" in printed.err  # the plain answer's token table
    row = json.loads(printed.out.splitlines()[-1])
    assert row["logprobs"] == [{"token": "echo", "logprob": -0.25, "bytes": list(b"echo"), "top_logprobs": [
        {"token": "echo", "logprob": -0.25, "bytes": list(b"echo")},
        {"token": "ECHO", "logprob": -1.5, "bytes": list(b"ECHO")}]}]
    assert _cli(redis_url, namespace, "submit", "hi", "--logprobs", "21") == 2
    assert "logprobs=21" in capsys.readouterr().err


def test_submit_json_prints_prompt_logprobs_with_a_null_first_as_valid_json(redis_url, namespace, worker, capsys):
    import math

    from kvgate.producer.protocol import TokenLogprob

    prompt = [TokenLogprob(5, "hi", b"hi", math.nan), TokenLogprob(6, " there", b" there", -1.5)]

    def serve():
        (job,) = worker.take(block_ms=5000)
        sent.append(job.sampling)
        worker.final(job, text="ok", token_ids=[1], prompt_logprobs=prompt)

    worker.ensure_groups()
    sent: list = []
    thread = threading.Thread(target=serve)
    thread.start()
    assert _cli(redis_url, namespace, "submit", "hi there", "--raw", "--prompt-logprobs", "0", "--timeout", "10",
                "--json") == 0
    thread.join(10)
    assert sent[0].prompt_logprobs == 0
    row = json.loads(capsys.readouterr().out.splitlines()[-1])  # NaN would not parse as strict JSON
    assert [(t["token"], t["logprob"]) for t in row["prompt_logprobs"]] == [("hi", None), (" there", -1.5)]


def test_submit_and_batch_record_the_tenant_given_and_refuse_a_bad_one(redis_url, namespace, worker, tmp_path,
                                                                       capsys, monkeypatch):
    """Before: neither command had --tenant, so jobs from the command line were nobody's."""
    worker.ensure_groups()
    assert _cli(redis_url, namespace, "submit", "hi", "--no-wait", "--tenant", "team-a") == 0
    monkeypatch.setenv("KVGATE_TENANT", "team-b")
    src = _lines(tmp_path, [_chat("a", "first", max_tokens=4)])
    thread = threading.Thread(target=_cli, args=(redis_url, namespace, "batch", str(src), "-o",
                                                 str(tmp_path / "out.jsonl"), "--timeout", "10", "--no-progress"))
    thread.start()
    jobs = [job for priority in ("normal", "low") for job in worker.take(priority, count=5, block_ms=5000)]
    for job in jobs:
        worker.final(job, text="ok", token_ids=[1])
    thread.join(15)
    assert sorted(job.tenant for job in jobs) == ["team-a", "team-b"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        _cli(redis_url, namespace, "submit", "hi", "--no-wait", "--tenant", "team a")
    assert refused.value.code == 2 and "tenant 'team a' must be 1 to 64 letters" in capsys.readouterr().err


def _lines(tmp_path, rows):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _chat(custom_id, content, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "default", "messages": [{"role": "user", "content": content}], **body}}


def test_batch_round_trip_in_openai_format_with_bad_lines_as_error_lines(redis_url, namespace, echo, tmp_path,
                                                                          capsys):
    src = _lines(tmp_path, [
        _chat("a", "first", max_tokens=8),
        {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "second"}},
        {"custom_id": "no-body", "method": "POST", "url": "/v1/completions"},
        _chat("c", "hot", temperature=-3),
        _chat("d", "x", response_format={"type": "json"}),
        {"custom_id": "e", "method": "POST", "url": "/v1/moderations", "body": {"input": "x"}},
        _chat("f", "FAIL please"),
    ])
    out = tmp_path / "out.jsonl"
    assert _cli(redis_url, namespace, "batch", str(src), "-o", str(out), "--no-progress", "--timeout", "20") == 0
    rows = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    a, b = rows["a"], rows["b"]
    assert a["error"] is None and a["response"]["status_code"] == 200
    assert a["response"]["body"]["object"] == "chat.completion"
    assert a["response"]["body"]["choices"][0]["message"]["content"] == "echo: first"
    assert a["response"]["body"]["usage"]["total_tokens"] == 5
    assert b["response"]["body"]["choices"][0]["text"] == "echo: second"
    assert rows["no-body"]["error"]["code"] == "invalid_request"
    assert rows["c"]["error"]["code"] == "invalid_request" and "temperature" in rows["c"]["error"]["message"]
    # honoured since issue 25, so a response_format of no known type is a bad value rather than an unknown field
    assert rows["d"]["error"]["code"] == "invalid_request" and "response_format" in rows["d"]["error"]["message"]
    assert rows["e"]["error"]["code"] == "invalid_url"
    assert rows["f"]["error"] == {"code": "error", "message": "the model refused"} and rows["f"]["response"] is None
    assert len(out.read_text().splitlines()) == 7
    assert ("7 lines written: 2 succeeded, 5 failed (4 rejected before submission, 1 failed on the fleet)"
            in capsys.readouterr().err)


def test_batch_resumes_skipping_answered_lines_and_reusing_in_flight_jobs(redis_url, namespace, worker, tmp_path):
    src = _lines(tmp_path, [_chat(f"r{i}", f"q{i}") for i in range(6)])
    out = tmp_path / "out.jsonl"
    # The interrupted run: r0 answered and written, r1 half-written, every job enqueued, r2..r5 still in flight.
    assert _cli(redis_url, namespace, "batch", str(src), "-o", str(out), "--no-progress", "--timeout", "0.3") == 3
    jobs = {j.messages[-1].content: j for j in worker.take("low", count=10)}
    assert len(jobs) == 6
    worker.final(jobs["q0"], text="echo: q0")
    worker.final(jobs["q1"], text="echo: q1")
    out.write_text(json.dumps({"custom_id": "r0", "response": {"status_code": 200}, "error": None}) + "\n"
                   + '{"custom_id": "r1", "resp')
    # The first run's worker finishes the jobs it holds while the batch is resumed.
    finisher = threading.Timer(0.5, lambda: [worker.final(jobs[f"q{i}"], text=f"echo: q{i}") for i in range(2, 6)])
    finisher.start()
    assert _cli(redis_url, namespace, "batch", str(src), "-o", str(out), "--no-progress", "--timeout", "20") == 0
    finisher.join()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == [f"r{i}" for i in range(6)]
    assert {r["response"]["body"]["choices"][0]["message"]["content"] for r in rows[1:]} == {
        f"echo: q{i}" for i in range(1, 6)}
    assert worker.r.xlen(worker.keys.jobs(None, "low")) == 6  # nothing resubmitted: in-flight jobs were reused
    assert worker.take("low", block_ms=50) == []


def test_batch_with_a_completion_window_gives_every_job_its_end_as_deadline_and_expired_lines_as_openai(
        redis_url, namespace, worker, tmp_path, capsys):
    """Issue 44: `kvgate batch --completion-window` as /v1/batches takes it: each job is due at the window's end (so
    the fleet serves it earliest deadline first), and a line whose job the fleet answers expired (not started by
    then) is OpenAI's batch_expired line, not a bare 'expired' error."""
    src = _lines(tmp_path, [_chat("on-time", "a"), _chat("late", "b")])
    out, taken = tmp_path / "out.jsonl", {}
    worker.ensure_groups()

    def fleet():
        while len(taken) < 2:
            taken.update({j.messages[-1].content: j for j in worker.take("low", block_ms=100)})
        worker.final(taken["a"], text="echo: a")
        worker.final(taken["b"], status="expired", error="deadline passed before it started")

    started = time.time()
    serving = threading.Thread(target=fleet)
    serving.start()
    assert _cli(redis_url, namespace, "batch", str(src), "-o", str(out), "--no-progress", "--timeout", "20",
                "--completion-window", "2h") == 0
    serving.join()
    assert all(started + 7200 <= j.deadline <= time.time() + 7200 for j in taken.values())
    rows = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["on-time"]["error"] is None
    assert rows["late"]["response"] is None and rows["late"]["error"] == {
        "code": "batch_expired", "message": "this request could not be executed before the completion window expired"}
    assert "2 lines written: 1 succeeded, 1 failed" in capsys.readouterr().err


@pytest.mark.parametrize("window", ["30m", "8d", "1.5h", "soon"])
def test_batch_refuses_a_completion_window_outside_1h_to_7d_naming_it_and_submits_nothing(redis_url, namespace,
                                                                                         worker, tmp_path, capsys,
                                                                                         window):
    out = tmp_path / "out.jsonl"
    worker.ensure_groups()
    assert _cli(redis_url, namespace, "batch", str(_lines(tmp_path, [_chat("a", "x")])), "-o", str(out),
                "--no-progress", "--completion-window", window) == 2
    err = capsys.readouterr().err
    assert f"--completion-window: completion_window={window!r}" in err and "from 1h to 7d" in err
    assert not out.exists() and worker.take("low", block_ms=50) == []


def test_stats_command_prints_a_table_and_json(redis_url, namespace, client, capsys):
    client.submit_many([{"prompt": "x", "priority": "high"}] * 2, progress=False)
    assert _cli(redis_url, namespace, "stats") == 0
    table = capsys.readouterr().out
    assert "high" in table and "live workers: 0" in table
    assert _cli(redis_url, namespace, "stats", "--json") == 0
    assert json.loads(capsys.readouterr().out)["priorities"]["high"]["backlog"] == 2


def test_stats_command_shows_tenants_under_quotas_by_name_and_the_rest_summed(redis_url, namespace, capsys):
    from kvgate.producer import Client, Quota

    with Client(redis_url, namespace, tenant="team-a", quota=Quota(max_jobs=5)) as a:
        a.submit_many([{"prompt": "x", "max_tokens": 10}] * 3, progress=False)
    assert _cli(redis_url, namespace, "stats") == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("team-a"))
    # 3 jobs queued or running, 3 x (ceil(1 / 4) + 10) tokens (a hair less should the server's minute turn meanwhile)
    assert row.split()[:2] == ["team-a", "3"] and 32 <= int(row.split()[2]) <= 33
    assert _cli(redis_url, namespace, "stats", "--json") == 0
    tenants = json.loads(capsys.readouterr().out)["tenants"]
    assert [(u["tenant"], u["jobs"]) for u in tenants["top"]] == [("team-a", 3)]
    assert tenants["other"] == {"tenant": None, "jobs": 0, "tokens_per_minute": 0}
