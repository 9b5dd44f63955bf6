"""`kvgate batch` output lines in OpenAI's per-line Batch format, against a `kvgate worker --simulated` subprocess."""
from __future__ import annotations

import json
import os
import time

import pytest
import redis

from kvgate.commands.cli import main
from kvgate.producer.keys import Keys
from tests.support import spawn_worker, wait_for

SIM = ("--simulated", "--sim-step-ms", "1", "--sim-per-token-ms", "0.01", "--max-num-seqs", "16")


@pytest.fixture(scope="module")
def sim_fleet(shared_redis):
    """One simulated worker for the module, on its own namespace of the session's redis-server."""
    ns = f"batch{os.getpid()}-{time.monotonic_ns() % 10**9}"
    proc = spawn_worker(shared_redis.url, ns, *SIM, "--model-alias", "gpt-4o-mini", worker_id="sim-batch")
    r = redis.Redis.from_url(shared_redis.url)
    try:
        wait_for(lambda: proc.poll() is not None or r.exists(Keys(ns).worker("sim-batch")), what="simulated worker")
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        yield shared_redis.url, ns, r
    finally:
        proc.terminate()
        proc.wait(30)
        r.close()


def _batch(sim_fleet, src, out, *extra) -> int:
    url, ns, _ = sim_fleet
    return main(["batch", "--redis-url", url, "--namespace", ns, str(src), "-o", str(out), "--no-progress",
                 "--timeout", "30", *extra])


def _write(tmp_path, rows, name="in.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _chat(custom_id, content, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}],
                     "max_tokens": 4, **body}}


def _rows(out):
    return [json.loads(line) for line in out.read_text().splitlines()]


MIXED = [
    _chat("ok-1", "hello"),
    {"custom_id": "no-body", "method": "POST", "url": "/v1/completions"},
    {"custom_id": "mod", "method": "POST", "url": "/v1/moderations", "body": {"input": "x"}},
    _chat("hot", "x", temperature=-3),
    {"custom_id": "ok-2", "method": "POST", "url": "/v1/completions",
     "body": {"model": "gpt-4o-mini", "prompt": "once upon", "max_tokens": 4}},
    {**_chat("get", "x"), "method": "GET"},
]


def test_every_output_line_has_its_own_id_and_failed_lines_have_a_null_response(sim_fleet, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert _batch(sim_fleet, _write(tmp_path, MIXED), out) == 0
    rows = _rows(out)
    assert len(rows) == len(MIXED)
    assert len({r["id"] for r in rows}) == len(rows), [r["id"] for r in rows]
    assert all(r["id"].startswith("batch_req_") and r["id"] != "batch_req_none" for r in rows)
    by_id = {r["custom_id"]: r for r in rows}
    for failed in ("no-body", "mod", "hot", "get"):
        assert by_id[failed]["response"] is None
        assert set(by_id[failed]["error"]) == {"code", "message"} and by_id[failed]["error"]["message"]
    for ok in ("ok-1", "ok-2"):
        response = by_id[ok]["response"]
        assert by_id[ok]["error"] is None and response["status_code"] == 200
        assert response["request_id"] and response["body"]["choices"][0]["finish_reason"] in ("length", "stop")
    assert "6 lines written: 2 succeeded, 4 failed (4 rejected before submission" in capsys.readouterr().err


def test_a_rerun_with_the_same_output_skips_every_answered_line_good_or_bad(sim_fleet, tmp_path, capsys):
    src, out = _write(tmp_path, MIXED), tmp_path / "out.jsonl"
    assert _batch(sim_fleet, src, out) == 0
    first = out.read_text()
    capsys.readouterr()
    assert _batch(sim_fleet, src, out) == 0
    assert out.read_text() == first
    assert "0 lines written" in capsys.readouterr().err


def test_body_model_routes_the_line_and_the_output_names_the_model_that_served_it(sim_fleet, tmp_path):
    served = sim_fleet[2].hget(Keys(sim_fleet[1]).worker("sim-batch"), "model").decode()
    assert served and served != "gpt-4o-mini"
    out = tmp_path / "out.jsonl"
    assert _batch(sim_fleet, _write(tmp_path, [_chat("m", "which model?")]), out) == 0
    (row,) = _rows(out)
    assert row["response"]["body"]["model"] == served
    assert row["response"]["body"]["system_fingerprint"] == "sim-batch"


def test_logprobs_lines_are_answered_in_the_gateways_shapes_and_bad_counts_fail_naming_them(sim_fleet, tmp_path):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    out = tmp_path / "out.jsonl"
    legacy = {"custom_id": "legacy", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "x", "max_tokens": 3, "logprobs": 2}}
    src = _write(tmp_path, [_chat("lp", "x", logprobs=True), _chat("top", "x", logprobs=True, top_logprobs=3),
                            legacy, _chat("no-lp", "x", logprobs=False, top_logprobs=0),
                            _chat("too-many", "x", logprobs=True, top_logprobs=21),
                            _chat("pen", "x", frequency_penalty=0.5, presence_penalty=-0.5)])
    assert _batch(sim_fleet, src, out) == 0
    rows = {r["custom_id"]: r for r in _rows(out)}
    for custom_id, top in (("lp", 0), ("top", 3)):
        body = rows[custom_id]["response"]["body"]
        content = ChatCompletion.model_validate(body).choices[0].logprobs.content
        assert len(content) == body["usage"]["completion_tokens"] > 0
        # the simulated model is sure of its token: at most that one alternative, at logprob 0
        assert all(len(t.top_logprobs) == min(top, 1) and t.logprob == 0 for t in content)
        assert "".join(t.token for t in content) == body["choices"][0]["message"]["content"]
    legacy_body = rows["legacy"]["response"]["body"]
    lp = Completion.model_validate(legacy_body).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert lp.text_offset[0] == 0 and all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    for custom_id in ("no-lp", "pen"):
        assert rows[custom_id]["error"] is None
        assert rows[custom_id]["response"]["body"]["choices"][0]["logprobs"] is None
    assert rows["too-many"]["response"] is None and "body.top_logprobs" in rows["too-many"]["error"]["message"]


@pytest.mark.parametrize("rows, says", [
    ([_chat("a", "one"), _chat("b", "two"), _chat("a", "three"), _chat("b", "four")],
     ['custom_id "a" appears on lines 1, 3', 'custom_id "b" appears on lines 2, 4']),
    ([_chat("a", "one"), "{not json", [1]], ["line 2 is not JSON", "line 3 is a JSON list, not an object"]),
    ([_chat("a", "one"), {k: v for k, v in _chat("b", "two").items() if k != "custom_id"}, _chat(7, "three")],
     ["line 2 has no custom_id", "line 3: custom_id 7 must be a non-empty string"]),
], ids=["duplicates", "not-json", "no-custom-id"])
def test_a_file_whose_lines_lack_their_own_custom_id_is_refused_before_anything_is_submitted(
        sim_fleet, tmp_path, capsys, rows, says):
    """A line named by its number (`line-2`) could take a real custom_id's place, so such a file is refused, as
    /v1/batches fails it; the message lists every problem, one a line."""
    url, ns, r = sim_fleet
    src = _write(tmp_path, rows)
    out = tmp_path / "out.jsonl"
    before = r.xlen(Keys(ns).jobs(None, "low"))
    assert _batch(sim_fleet, src, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "nothing was submitted" in err[0] and len(err) == 1 + len(says)
    assert all(want in line for want, line in zip(says, err[1:])), err
    assert not out.exists()
    assert r.xlen(Keys(ns).jobs(None, "low")) == before


def test_every_body_field_batch_accepts_is_an_openai_parameter_or_a_named_extension():
    """The accepted fields are checked against the openai package's own request types, so a typo'd or invented
    name cannot slip in; the extensions are vLLM's sampling parameters, which kvgate also honours."""
    from openai.types import completion_create_params as completions
    from openai.types.chat import completion_create_params as chat

    from kvgate.openai.batch import COMPLETION_FIELDS, IGNORED_FIELDS, LOGPROB_FIELDS, SAMPLING_FIELDS

    from kvgate.openai.shapes import STRUCTURED_BODY_FIELDS

    # vLLM's sampling and structured-output parameters, and kvgate's own wire form of the latter
    extensions = {"top_k", "repetition_penalty", "ignore_eos", "structured", "min_p", "min_tokens",
                  "skip_special_tokens"} | (set(STRUCTURED_BODY_FIELDS) -
                                                                                 {"response_format"})
    openai_names = set(chat.CompletionCreateParamsBase.__annotations__) | set(
        completions.CompletionCreateParamsBase.__annotations__) | {"stream"}
    assert (set(SAMPLING_FIELDS) | IGNORED_FIELDS | set(LOGPROB_FIELDS) | set(STRUCTURED_BODY_FIELDS) |
            set(COMPLETION_FIELDS)) - extensions <= openai_names


def test_a_batch_lines_logit_bias_keys_become_token_ids_and_a_bad_key_is_named():
    from kvgate.openai.batch import BadLine, parse_line

    line = ('{"custom_id": "a", "url": "/v1/completions", "body": {"model": "m", "prompt": "x", '
            '"logit_bias": {"42": -100}}}')
    assert parse_line(1, line, "d").jobs[0]["logit_bias"] == {42: -100}
    with pytest.raises(BadLine, match="logit_bias key 'x4'"):
        parse_line(1, line.replace('"42"', '"x4"'), "d")
    with pytest.raises(BadLine, match="prompt_logprobs"):  # an output line has no place for them
        parse_line(1, line.replace('"logit_bias": {"42": -100}', '"prompt_logprobs": 1'), "d")


def test_a_completions_lines_suffix_goes_to_its_job_and_a_chat_lines_is_refused():
    from kvgate.openai.batch import BadLine, parse_line

    line = '{"custom_id": "a", "url": "/v1/completions", "body": {"model": "m", "prompt": "x", "suffix": "y"}}'
    assert parse_line(1, line, "d").jobs[0]["suffix"] == "y"  # the worker renders it with its model's FIM tokens
    chat = ('{"custom_id": "c", "url": "/v1/chat/completions", "body": {"model": "m", '
            '"messages": [{"role": "user", "content": "x"}], "suffix": "y"}}')
    with pytest.raises(BadLine, match="suffix"):
        parse_line(1, chat, "d")


def test_a_several_input_embeddings_line_owns_one_job_per_input_and_is_answered_once_all_are_final():
    import struct

    from kvgate.openai.batch import parse_line, unrun_line
    from kvgate.openai.batch_runs import line_runs, submit_jobs
    from kvgate.producer import Result
    from kvgate.producer import protocol as wire

    emb = parse_line(1, json.dumps({"custom_id": "e", "url": "/v1/embeddings", "body": {
        "model": "m", "input": ["a", "b", "c"], "encoding_format": "float"}}), "d")
    chat = parse_line(2, json.dumps({"custom_id": "c", "url": "/v1/chat/completions",
                                     "body": {"messages": [{"role": "user", "content": "hi"}]}}), "d")
    assert [j["prompt"] for j in emb.jobs] == ["a", "b", "c"]
    assert len({j["idempotency_key"] for j in emb.jobs + chat.jobs}) == 4  # each job reattaches to its own
    assert len(submit_jobs([emb, chat], tenant="t")) == 4
    runs = line_runs([emb, chat], ["j0", "j1", "j2", "j3"])
    assert [(r.request.custom_id, r.job_ids) for r in runs] == [("e", ["j0", "j1", "j2"]), ("c", ["j3"])]
    cut = line_runs([emb, chat], ["j0", "j1"])  # a submit cut short: the line is not submitted, the next not at all
    assert [(r.request.custom_id, r.submitted) for r in cut] == [("e", False)]

    def result(job_id: str, status: str = "done", error: str | None = None, vector=(1.0, 0.0)) -> Result:
        return Result.from_final(wire.Final(v=2, job_id=job_id, status=status, error=error,
                                            embedding=struct.pack("<2f", *vector), usage=wire.Usage(prompt_tokens=2)))

    run = runs[0]
    assert run.add(result("j2", vector=(0.0, 1.0))) is False and run.add(result("j0")) is False
    assert run.add(result("j1")) is True
    body = run.answer("seed")["response"]["body"]
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["data"][2]["embedding"] == [0.0, 1.0]
    assert body["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
    with pytest.raises(ValueError, match="not one of line 1's jobs"):
        run.add(result("j3"))
    failed = line_runs([emb], ["j0", "j1", "j2"])[0]
    for r in (result("j0"), result("j1", "error", "prompt of 900 tokens is longer than 512"), result("j2")):
        failed.add(r)
    row = failed.answer("seed")
    assert row["response"] is None and row["error"]["code"] == "error"
    assert row["error"]["message"].startswith("body.input[1] (input 2 of 3, job j1) ended error: prompt of 900")
    late = line_runs([emb], ["j0", "j1", "j2"])[0]  # one input not started within the batch's window
    for r in (result("j0"), result("j1", "expired"), result("j2")):
        late.add(r)
    assert late.answer("seed") == unrun_line("seed", "e", "expired")
    assert late.answer("seed")["error"]["code"] == "batch_expired"
