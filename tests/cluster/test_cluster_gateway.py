"""The OpenAI-compatible gateway on a Redis Cluster, through the official openai client: a chat, a streamed
completion, /v1/models, and a managed batch (whose keys live in shard 0: its scripts touch one slot)."""
from __future__ import annotations

import openai

from tests.cluster.test_cluster_queue import workers
from tests.gateway.batch_files import jsonl, request, rows_of, wait_final
from tests.gateway.conftest import start_gateway
from tests.reliability.chaos_harness import stop_all


def test_the_gateway_serves_chats_streams_models_and_a_batch_on_a_cluster(cluster, namespace, tmp_path):
    procs = workers(cluster, namespace, 2)
    gw = start_gateway(cluster.url, namespace, files_dir=str(tmp_path / "files"), batch_window=8, batch_poll_s=0.2)
    try:
        c = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=60)
        chat = c.chat.completions.create(model="simulated", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=5)
        assert chat.choices[0].message.content and chat.usage.completion_tokens == 5
        chunks = c.completions.create(model="simulated", prompt="count", max_tokens=6, stream=True)
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert "simulated" in {m.id for m in c.models.list()}
        f = c.files.create(file=("in.jsonl", jsonl([request(i) for i in range(40)])), purpose="batch")
        batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = wait_final(c.batches.retrieve, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 40, done
        assert len(rows_of(c.files.content(done.output_file_id).content)) == 40
        c.close()
    finally:
        gw.stop()
        stop_all(procs)
