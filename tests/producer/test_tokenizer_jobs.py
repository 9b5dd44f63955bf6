"""The wire's tokenizer jobs (Job.task): what each takes, and generation jobs' digests unchanged by the new fields."""
from __future__ import annotations

import hashlib

import msgspec
import pytest

from kvgate.producer import InvalidRequest
from kvgate.producer import protocol as wire
from kvgate.producer.request import build_job, validate_request


@pytest.mark.parametrize("args", [{"prompt_token_ids": [1, 2], "task": "tokenize"},
                                  {"prompt": "hi", "task": "detokenize"},
                                  {"prompt": "hi", "task": "embed"}])
def test_a_tokenizer_job_takes_only_the_input_its_task_reads(args):
    with pytest.raises(InvalidRequest) as e:
        validate_request(args)
    assert e.value.errors[0].field == "task"


def test_the_worker_refuses_a_detokenize_job_without_token_ids_on_the_wire():
    job = wire.Job(v=1, job_id="j", client_id="c", enqueued_at=1.0, prompt="hi", task="detokenize")
    with pytest.raises(wire.ProtocolError, match="detokenize job takes prompt_token_ids"):
        wire.decode_job(wire.encode(job))


def test_a_generation_jobs_payload_and_digest_are_what_they_were_before_tasks():
    req = validate_request({"prompt": "hi", "max_tokens": 3})
    assert b"task" not in wire.encode(build_job(req, "c"))  # omit_defaults: old workers read it as before
    before = req.model_dump(exclude={"idempotency_key", "deadline", "prefix_key", "tenant", "task",
                                     "add_special_tokens", "tools", "tool_choice", "parallel_tool_calls"}, mode="json")
    assert req.digest() == hashlib.sha256(msgspec.json.encode(before, order="sorted")).hexdigest()[:32]
    assert validate_request({"prompt": "hi", "max_tokens": 3, "task": "tokenize"}).digest() != req.digest()
