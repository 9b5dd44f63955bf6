"""A batch outlives its gateway: SIGKILL `kvgate serve` mid-batch, start another, and the batch completes with
every custom_id answered once and no job run twice."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import openai
import pytest
import redis

from kvgate.producer.keys import Keys
from tests.gateway.batch_files import jsonl, request, rows_of, wait_final
from tests.gateway.conftest import gateway_up, running_worker
from tests.support import ROOT, free_port, wait_for

N = 80
LEASE_S = 1.5


def serve(url: str, ns: str, files_dir: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvgate.commands.serve", "--redis-url", url, "--namespace", ns, "--port", str(port),
           "--files-dir", files_dir, "--batch-window", "8", "--batch-lease", str(LEASE_S), "--log-level", "warning"]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


@pytest.fixture
def slow_fleet(shared_redis, namespace):
    """Slow enough (about 50 ms a job, 8 at a time) that a kill lands mid-batch."""
    with running_worker(shared_redis.url, namespace, "--simulated", "--sim-step-ms", "2", "--max-num-seqs", "16",
                        worker_id="sim-restart") as fleet:
        yield fleet


def test_a_batch_resumes_after_its_gateway_is_killed_and_runs_no_job_twice(slow_fleet, tmp_path):
    url, ns = slow_fleet
    port = free_port()
    first = serve(url, ns, str(tmp_path), port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
    second = None
    try:
        wait_for(lambda: gateway_up(client), 60, "the first gateway")
        f = client.files.create(file=("in.jsonl", jsonl([request(i, max_tokens=25) for i in range(N)])),
                                purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 8, 60, "some answers")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        with redis.Redis.from_url(url) as r:
            killed_at = int(r.hget(f"{ns}:batch:{batch.id}", "completed"))
        assert killed_at < N, "the batch finished before the kill: slow the fleet down"

        second = serve(url, ns, str(tmp_path), port)
        wait_for(lambda: gateway_up(client), 60, "the second gateway")
        done = wait_final(client.batches.retrieve, batch.id, timeout=120)
        assert done.status == "completed", done
        client_counts = done.request_counts
        assert (client_counts.total, client_counts.completed, client_counts.failed) == (N, N, 0)
        out = rows_of(client.files.content(done.output_file_id).content)
        assert [r["custom_id"] for r in out] == [f"req-{i}" for i in range(N)]
        job_ids = {r["response"]["request_id"] for r in out}
        assert len(job_ids) == N
        with redis.Redis.from_url(url) as r:  # one result per job ever run: a job run twice would add one
            time.sleep(0.5)
            results = list(r.scan_iter(match=Keys(ns).result("*"), count=1000))
        assert len(results) == N and {k.decode().rsplit(":", 1)[1] for k in results} == job_ids
    finally:
        client.close()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)


@pytest.fixture
def slow_embedding_fleet(shared_redis, namespace):
    """4 embedding jobs a 40 ms step: 60 lines of 4 inputs take seconds, so a kill lands mid-batch."""
    with running_worker(shared_redis.url, namespace, "--simulated", "--sim-step-ms", "40", "--max-num-seqs", "4",
                        worker_id="sim-restart-embed") as fleet:
        yield fleet


def test_a_batch_of_several_input_embeddings_lines_resumes_with_one_line_each_and_no_job_twice(slow_embedding_fleet,
                                                                                               tmp_path):
    url, ns = slow_embedding_fleet
    lines, inputs = 60, 4
    rows = [{"custom_id": f"emb-{i}", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": "simulated", "input": [f"line {i} input {k}" for k in range(inputs)]}}
            for i in range(lines)]
    port = free_port()
    first = serve(url, ns, str(tmp_path), port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
    second = None
    try:
        wait_for(lambda: gateway_up(client), 60, "the first gateway")
        f = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, 60, "some answers")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        with redis.Redis.from_url(url) as r:
            killed_at = int(r.hget(f"{ns}:batch:{batch.id}", "completed"))
        assert killed_at < lines, "the batch finished before the kill: slow the fleet down"

        second = serve(url, ns, str(tmp_path), port)
        wait_for(lambda: gateway_up(client), 60, "the second gateway")
        done = wait_final(client.batches.retrieve, batch.id, timeout=120)
        assert done.status == "completed", done
        counts = done.request_counts  # lines, not jobs
        assert (counts.total, counts.completed, counts.failed) == (lines, lines, 0)
        out = rows_of(client.files.content(done.output_file_id).content)
        assert [r["custom_id"] for r in out] == [f"emb-{i}" for i in range(lines)]
        assert all([d["index"] for d in r["response"]["body"]["data"]] == list(range(inputs)) for r in out)
        with redis.Redis.from_url(url) as r:  # one result per job ever run: an input embedded twice would add one
            time.sleep(0.5)
            results = list(r.scan_iter(match=Keys(ns).result("*"), count=1000))
        assert len(results) == lines * inputs
    finally:
        client.close()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)
