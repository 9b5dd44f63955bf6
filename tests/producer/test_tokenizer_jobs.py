"""The wire's tokenizer jobs (Job.task): what each takes, and generation jobs' digests unchanged by the new fields."""
from __future__ import annotations

import hashlib

import msgspec
import pytest

from kvgate.producer import InvalidRequest
from kvgate.producer import protocol as wire
from kvgate.producer.request import NEWER_THAN_DIGESTS, build_job, validate_request


@pytest.mark.parametrize("args", [{"prompt_token_ids": [1, 2], "task": "tokenize"},
                                  {"prompt": "hi", "task": "detokenize"},
                                  {"prompt": "hi", "task": "summarize"}])
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
    before = req.model_dump(exclude={"idempotency_key", "deadline", "prefix_key", "tenant", "traceparent",
                                     *NEWER_THAN_DIGESTS}, mode="json")
    assert req.digest() == hashlib.sha256(msgspec.json.encode(before, order="sorted")).hexdigest()[:32]
    assert validate_request({"prompt": "hi", "max_tokens": 3, "task": "tokenize"}).digest() != req.digest()


def test_a_generation_jobs_digest_is_unchanged_by_the_sampling_fields_added_after_it_unless_one_is_used():
    req = validate_request({"prompt": "hi", "max_tokens": 3})
    before = req.model_dump(exclude={"idempotency_key", "deadline", "prefix_key", "tenant", "traceparent",
                                     *NEWER_THAN_DIGESTS}, mode="json")
    assert set(NEWER_THAN_DIGESTS) <= set(req.model_dump())  # each is a field, left out only at its default
    assert req.digest() == hashlib.sha256(msgspec.json.encode(before, order="sorted")).hexdigest()[:32]
    for used in ({"min_p": 0.1}, {"logit_bias": {5: 1.0}}, {"skip_special_tokens": False}, {"prompt_logprobs": 0}):
        assert validate_request({"prompt": "hi", "max_tokens": 3, **used}).digest() != req.digest()


@pytest.mark.parametrize("kwargs, says", [
    ({"tokenize": True}, "apply_chat_template's own parameters"),
    ({"bad-name": 1}, "template variable name"),
    ({f"k{i}": i for i in range(17)}, "at most 16"),
    ({"text": "x" * 5000}, "over the limit of 4096"),
    ({"x": float("nan")}, "finite"),
])
def test_a_hostile_chat_template_kwargs_on_the_wire_is_a_protocol_error_naming_it(kwargs, says):
    job = wire.Job(v=1, job_id="j", client_id="c", enqueued_at=1.0, messages=[wire.Message("user", "hi")],
                   chat_template_kwargs=kwargs)
    with pytest.raises(wire.ProtocolError, match="chat_template_kwargs") as e:
        wire.decode_job(wire.encode(job))
    assert says in str(e.value)
    with pytest.raises(InvalidRequest) as sdk:
        validate_request({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs})
    assert sdk.value.errors[0].field.startswith("chat_template_kwargs")


def test_template_arguments_apply_to_messages_only_and_travel_on_the_job():
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"add_generation_prompt": False}):
        with pytest.raises(InvalidRequest) as e:
            validate_request({"prompt": "hi", **extra})
        assert e.value.errors[0].field == next(iter(extra))
    req = validate_request({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False,
                            "chat_template_kwargs": {"enable_thinking": False, "effort": "low"}})
    job = wire.decode_job(wire.encode(build_job(req, "c")))
    assert (job.add_generation_prompt, job.chat_template_kwargs) == (False, {"enable_thinking": False, "effort": "low"})
    nested = msgspec.msgpack.encode({"v": 1, "job_id": "j", "client_id": "c", "enqueued_at": 1.0,
                                     "messages": [{"role": "user", "content": "hi"}],
                                     "chat_template_kwargs": {"a": [1, 2]}})
    with pytest.raises(wire.ProtocolError, match="chat_template_kwargs"):
        wire.decode_job(nested)


def test_an_embedding_job_takes_a_prompt_messages_or_token_ids_and_its_settings_ride_only_on_it():
    for given in ({"prompt": "hi"}, {"prompt_token_ids": [1, 2]}, {"messages": [{"role": "user", "content": "hi"}]}):
        job = build_job(validate_request({**given, "task": "embed", "pooling": "mean", "dimensions": 8}), "c" * 16)
        assert wire.decode_job(wire.encode(job)).embedding == wire.Embedding("mean", True, 8)
    assert b"embedding" not in wire.encode(build_job(validate_request({"prompt": "hi", "task": "embed"}), "c" * 16))
    with pytest.raises(InvalidRequest) as e:
        validate_request({"prompt": "hi", "dimensions": 8})
    assert e.value.errors[0].field == "dimensions" and "embedding jobs only" in e.value.errors[0].reason
    with pytest.raises(InvalidRequest) as e:
        validate_request({"prompt": "hi", "task": "embed", "dimensions": 0})
    assert e.value.errors[0].field == "dimensions"
    hostile = wire.Job(v=1, job_id="j", client_id="c", enqueued_at=1.0, prompt="hi", task="embed",
                       embedding=wire.Embedding(dimensions=10**9))
    with pytest.raises(wire.ProtocolError, match="dimensions=1000000000 must be None"):
        wire.decode_job(wire.encode(hostile))
    stray = wire.Job(v=1, job_id="j", client_id="c", enqueued_at=1.0, prompt="hi", embedding=wire.Embedding())
    with pytest.raises(wire.ProtocolError, match="embedding settings are for task 'embed'"):
        wire.decode_job(wire.encode(stray))


def test_a_quota_charges_an_embedding_job_its_prompt_alone():
    from kvgate.producer.quotas import estimate_tokens

    embed = build_job(validate_request({"prompt_token_ids": [1, 2, 3], "task": "embed"}), "c" * 16)
    generate = build_job(validate_request({"prompt_token_ids": [1, 2, 3], "max_tokens": 50}), "c" * 16)
    assert (estimate_tokens(embed), estimate_tokens(generate)) == (3, 53)


@pytest.mark.parametrize("setting", [{"max_tokens": 5}, {"temperature": 0.0}, {"stream": True}, {"regex": "a+"}])
def test_an_embedding_job_refuses_generation_settings_by_name(setting):
    with pytest.raises(InvalidRequest, match="is a generation setting; an embedding job generates nothing"):
        validate_request({"prompt": "hi", "task": "embed", **setting})


def test_embed_makes_one_job_per_input_and_refuses_no_inputs():
    from kvgate.producer.client_base import ClientBase

    jobs = ClientBase._embed_requests(["a", [1, 2]], {"model": "m", "pooling": "mean"})
    assert jobs == [{"model": "m", "pooling": "mean", "task": "embed", "prompt": "a"},
                    {"model": "m", "pooling": "mean", "task": "embed", "prompt_token_ids": [1, 2]}]
    assert ClientBase._embed_requests([5, 6], {}) == [{"task": "embed", "prompt_token_ids": [5, 6]}]
    for nothing in ([], None, 3):
        with pytest.raises(InvalidRequest, match="inputs"):
            ClientBase._embed_requests(nothing, {})
