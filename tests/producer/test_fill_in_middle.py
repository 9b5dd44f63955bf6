"""The wire and the SDK for `suffix` (fill-in-the-middle): a text prompt's generation job only, carried as given."""
from __future__ import annotations

import pytest

from kvgate.producer import InvalidRequest
from kvgate.producer import limits, protocol as wire
from kvgate.producer.request import build_job, validate_request


def test_a_suffix_travels_with_its_prompt_on_the_wire():
    job = build_job(validate_request({"prompt": "def f(", "suffix": ") return 1", "max_tokens": 3}), "c")
    assert wire.decode_job(wire.encode(job)).suffix == ") return 1"
    plain = build_job(validate_request({"prompt": "def f(", "max_tokens": 3}), "c")
    assert b"suffix" not in wire.encode(plain)  # omit_defaults: a worker from before it reads the job as before


@pytest.mark.parametrize("args", [
    {"messages": [{"role": "user", "content": "hi"}], "suffix": "end"},
    {"prompt_token_ids": [1, 2], "suffix": "end"},
    {"prompt": "hi", "suffix": "end", "task": "tokenize"},
    {"prompt": "hi", "suffix": "end", "task": "embed"},
])
def test_a_suffix_without_a_text_prompt_to_generate_from_is_refused_naming_suffix(args):
    with pytest.raises(InvalidRequest) as e:
        validate_request(args)
    assert e.value.errors[0].field in ("suffix", "task") and "suffix" in str(e.value)


@pytest.mark.parametrize("suffix", [3, "bad \ud800 surrogate", "x" * (limits.MAX_PROMPT_CHARS + 1)])
def test_a_suffix_that_is_not_bounded_text_is_refused_naming_suffix(suffix):
    with pytest.raises(InvalidRequest) as e:
        validate_request({"prompt": "x", "suffix": suffix})
    assert e.value.errors[0].field == "suffix"


def test_a_suffix_is_part_of_the_idempotency_digest_only_when_given():
    plain = validate_request({"prompt": "hi", "max_tokens": 3})
    assert validate_request({"prompt": "hi", "max_tokens": 3, "suffix": "x"}).digest() != plain.digest()
    assert validate_request({"prompt": "hi", "max_tokens": 3, "suffix": None}).digest() == plain.digest()


@pytest.mark.parametrize("job, says", [
    (wire.Job(v=1, job_id="j", client_id="c", enqueued_at=1.0, messages=[wire.Message("user", "hi")], suffix="x"),
     "suffix goes with a text prompt"),
    (wire.Job(v=1, job_id="j", client_id="c", enqueued_at=1.0, prompt="p" * 10, suffix="s" * limits.MAX_PROMPT_CHARS),
     "prompt and suffix hold more than"),
])
def test_a_hostile_suffix_on_the_wire_is_a_protocol_error_naming_it(job, says):
    with pytest.raises(wire.ProtocolError, match=says):
        wire.decode_job(wire.encode(job))
