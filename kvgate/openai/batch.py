"""The OpenAI Batch file format: request lines in, response lines out.

In:  {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings"
      | "/v1/responses" (with the gateway's extra installed), "body": {...}}
Out: {"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}
  or {"id", "custom_id", "response": null, "error": {"code", "message"}} for a line that failed.

A line runs one job (chat, completions) or one per input (/v1/embeddings, as POST /v1/embeddings runs them), and is
answered by exactly one output line once all of them are final: the body /v1/embeddings would answer, or, when any
input's job failed, one error line naming that input (never a partial answer). `LineRun` is a submitted line: its
request and the ids of the jobs it owns (kvgate/openai/batch_runs.py).

An endpoint whose body is read by a layer above this one (/v1/responses: the gateway's Responses parser) is taken
through a `Translator`: it turns the body into a chat body, run as a chat line is, and says how its one result is
answered. The gateway's managed batches and `kvgate batch` give it where the gateway's extra is installed; a caller
that gives none answers such lines with an invalid_url error line.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import msgspec

from kvgate.openai.embeddings import EMBEDDINGS, BadEmbeddings, EmbeddingsBody, parse_body, response_body, submit_args
from kvgate.producer.bounded_json import BadJson, parse_json
from kvgate.producer.quoting import VALUE_CHARS, clipped, shown
from kvgate.openai.shapes import (STRUCTURED_BODY_FIELDS, BadLogprobs, BadStructured, choice, logit_bias_of,
                                  requested_logprobs, structured_of_body)
from kvgate.producer import protocol as wire
from kvgate.producer.errors import InvalidRequest
from kvgate.producer.keys import Keys
from kvgate.producer.result import Result
from kvgate.producer.submission import prepare

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
# Body fields we honour, by their submit name (the wire's sampling fields; logprobs are read by requested_logprobs,
# stop_token_ids is not taken in batch files, nor prompt_logprobs, which an output line has no place for); others are
# refused rather than silently ignored.
SAMPLING_FIELDS = {s.name: s.name for s in wire.SAMPLING_FIELDS
                   if s.name not in ("logprobs", "stop_token_ids", "prompt_logprobs")} | {
    "max_completion_tokens": "max_tokens", "metadata": "metadata"}
IGNORED_FIELDS = {"user", "stream", "n"}  # `model` routes the line to that model's streams
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # chat lines: taken as the SDK takes them
LOGPROB_FIELDS = ("logprobs", "top_logprobs")  # read by requested_logprobs, as the gateway reads them
COMPLETION_FIELDS = ("suffix",)  # completions lines: fill-in-the-middle, rendered by a worker with FIM tokens


class BadLine(ValueError):
    def __init__(self, code: str, message: str):
        self.code = code
        super().__init__(message)


@dataclass(slots=True, frozen=True)
class Translated:
    """A line body of another endpoint as the chat body it asks for, and how its one result is answered: `answer`
    makes the response body from the result and the model that served it."""

    chat: dict[str, Any]
    answer: Callable[[Result, str], dict[str, Any]]


Translator = Callable[[dict[str, Any]], Translated]  # raises BadLine naming the body field it refuses


@dataclass(slots=True)
class BatchRequest:
    """One input line ready to run: the submit arguments of each job it runs, in input order, each with its own
    idempotency key."""

    line_no: int
    custom_id: str
    url: str
    model: str
    jobs: list[dict[str, Any]]  # one for chat and completions; an /v1/embeddings line's: one per input
    embeddings: EmbeddingsBody | None = None  # an /v1/embeddings line's body: its answer's encoding_format
    translated: Translated | None = None  # a line of a translated endpoint (/v1/responses): its answer's maker

    def input_name(self, part: int) -> str:
        """How an error names the line's job `part`: by its input where the line has several."""
        return f"body.input[{part}]" if len(self.jobs) > 1 else "body"


def parse_line(line_no: int, line: str, file_digest: str,
               translators: Mapping[str, Translator] | None = None) -> BatchRequest:
    """One input line as submit arguments; BadLine says what is wrong with it. `translators`: the endpoints taken
    beside chat, completions and embeddings, by url."""
    try:
        data = parse_json(line)
    except BadJson as e:
        raise BadLine("invalid_json", f"line {line_no} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadLine("invalid_request", f"line {line_no} must be a JSON object")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BadLine("invalid_request", f"line {line_no}: custom_id must be a non-empty string")
    if data.get("method", "POST") != "POST":
        raise BadLine("invalid_request", f"method {shown(data.get('method'))} is not supported; use POST")
    url, body, translators = data.get("url"), data.get("body"), translators or {}
    if url not in (CHAT, COMPLETIONS, EMBEDDINGS, *translators):
        taken = ", ".join((CHAT, COMPLETIONS, EMBEDDINGS, *translators))
        where = f" ({RESPONSES} lines need the gateway's Responses parser: pip install 'kvgate[gateway]')" \
            if url == RESPONSES else ""
        raise BadLine("invalid_url", f"url {shown(url)} is not supported here{where}; use one of {taken}")
    if not isinstance(body, dict):
        raise BadLine("invalid_request", "body must be a JSON object")
    embeddings = _embeddings_body(body) if url == EMBEDDINGS else None
    translated = translators[url](body) if url in translators else None
    if embeddings is not None:
        jobs = submit_args(embeddings)
    else:
        jobs = [_submit_args(CHAT, translated.chat) if translated is not None else _submit_args(url, body)]
    for part, args in enumerate(jobs):
        args["idempotency_key"] = idempotency_key(file_digest, custom_id, part)
    return BatchRequest(line_no, custom_id, url, str(body.get("model", "")), jobs, embeddings, translated)


def _embeddings_body(body: dict[str, Any]) -> EmbeddingsBody:
    """As POST /v1/embeddings reads it (up to its MAX_INPUTS inputs, each a job)."""
    try:
        return parse_body(body)
    except BadEmbeddings as e:
        code = "unsupported_parameter" if e.code == "unsupported_parameter" else "invalid_request"
        raise BadLine(code, f"body.{e.param}: {e}") from None


def _submit_args(url: str, body: dict[str, Any]) -> dict[str, Any]:
    try:
        logprobs = requested_logprobs(url == CHAT, body)
    except BadLogprobs as e:
        raise BadLine("invalid_request", f"body.{e.param}: {e}") from None
    if url == COMPLETIONS and body.get("top_logprobs") not in (None, 0):
        raise BadLine("unsupported_parameter", "body.top_logprobs is a chat parameter; /v1/completions takes "
                      "logprobs: N")
    unknown = sorted(set(body) - set(SAMPLING_FIELDS) - IGNORED_FIELDS - set(LOGPROB_FIELDS)
                     - {"messages", "prompt", "model", *STRUCTURED_BODY_FIELDS, *(TOOL_FIELDS if url == CHAT else ()),
                        *(COMPLETION_FIELDS if url == COMPLETIONS else ())})
    if unknown:
        lora = "; a LoRA adapter is named as body.model, as OpenAI clients name it" if "lora" in unknown else ""
        raise BadLine("unsupported_parameter", f"body field(s) {unknown} are not supported{lora}")
    if body.get("n", 1) != 1:
        raise BadLine("unsupported_parameter", f"n={shown(body['n'])}: only n=1 is supported")
    key = "messages" if url == CHAT else "prompt"
    if key not in body:
        raise BadLine("invalid_request", f"{url} needs body.{key}")
    args = {key: body[key]}
    if body.get("model") is not None:  # the line's model picks its streams; none: the `default` model
        args["model"] = body["model"]
    for name, arg in SAMPLING_FIELDS.items():
        if body.get(name) is not None:
            args[arg] = body[name]
    if logprobs is not None:
        args["logprobs"] = logprobs
    if "logit_bias" in args:
        try:
            args["logit_bias"] = logit_bias_of(args["logit_bias"])
        except ValueError as e:
            raise BadLine("invalid_request", f"body.{e}") from None
    args |= {name: body[name] for name in TOOL_FIELDS if body.get(name) not in (None, [])}  # tools=[]: none
    args |= {name: body[name] for name in COMPLETION_FIELDS if body.get(name) is not None}
    try:  # response_format, guided_*, structured_outputs: as the gateway reads them
        asked = structured_of_body(body)
    except BadStructured as e:
        raise BadLine("invalid_request", f"body.{e.param}: {e}") from None
    if asked is not None:
        if "structured" in args:
            raise BadLine("invalid_request", f"body.{asked[0]} and body.structured: give one")
        args["structured"] = asked[1]
    return args


def idempotency_key(file_digest: str, custom_id: str, part: int = 0) -> str:
    """Stable across restarts of the same file, so a resubmission reuses the jobs already in flight; `part`: which of
    the line's jobs (its first keeps the key a line of one job always had)."""
    name = f"{file_digest}\n{custom_id}" + (f"\n{part}" if part else "")
    return "batch:" + hashlib.sha256(name.encode()).hexdigest()[:40]


def file_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


@dataclass(slots=True, frozen=True)
class FileProblem:
    """What makes a whole batch file unusable, in the shape of OpenAI's `errors.data` entries."""

    code: str
    message: str
    line: int | None = None
    param: str | None = "custom_id"


def file_problems(lines: list[tuple[int, str]], endpoint: str | None = None) -> list[FileProblem]:
    """Why the file must be refused before anything runs, as OpenAI refuses it; empty when it may run. Every line of a
    file that passes is a JSON object with its own non-empty string custom_id, so no line's answer or error can take
    another line's place: a line is never named by its number. custom_ids are compared as JSON values of any type
    (7 twice is a repeat, 7 and "7" are not). `endpoint`: the batch's, which every line's url must be (the gateway's
    /v1/batches; `kvgate batch` takes both endpoints in one file)."""
    problems, where = [], {}
    for n, raw in lines:
        try:
            data = parse_json(raw)
        except BadJson as e:
            problems.append(FileProblem("invalid_json", f"line {n} is not JSON ({e}); every line of a batch file is "
                                                        "one JSON request with a custom_id", n, None))
            continue
        if not isinstance(data, dict):
            problems.append(FileProblem("invalid_json", f"line {n} is a JSON {type(data).__name__}, not an object "
                                                        "with a custom_id", n, None))
            continue
        custom_id = data.get("custom_id")
        if custom_id is None:
            problems.append(FileProblem("missing_custom_id", f"line {n} has no custom_id; every request of a batch "
                                                             "needs its own, to find its answer by", n))
        else:
            where.setdefault(msgspec.json.encode(custom_id, order="sorted"), []).append(n)
            if not isinstance(custom_id, str) or not custom_id:
                problems.append(FileProblem("invalid_custom_id", f"line {n}: custom_id {_shown(custom_id)} must be a "
                                                                 "non-empty string", n))
        url = data.get("url")
        if endpoint is not None and isinstance(url, str) and url != endpoint:
            problems.append(FileProblem("mismatched_endpoint", f"line {n}: url {shown(url)} differs from the batch's "
                                                               f"endpoint {endpoint!r}; every line of a batch must "
                                                               "use its endpoint", n, "url"))
    for custom_id, line_nos in where.items():
        if len(line_nos) > 1:
            named, listed = clipped(custom_id.decode(), VALUE_CHARS), clipped(", ".join(map(str, line_nos)), 200)
            problems.append(FileProblem("duplicate_custom_id", f"custom_id {named} appears on lines {listed}; every "
                                                               "custom_id in a batch file must be unique: rename the "
                                                               "repeats and run again", line_nos[1]))
    return problems


def _shown(value: Any) -> str:
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= 80 else text[:77] + "..."


def custom_id_of(raw: str) -> str | None:
    return text_field(raw, "custom_id")


def text_field(raw: str, name: str) -> str | None:
    """A non-empty string field of a raw line, or None when the line is not a JSON object or lacks it."""
    try:
        data = parse_json(raw)
    except BadJson:
        return None
    value = data.get(name) if isinstance(data, dict) else None
    return value if isinstance(value, str) and value else None


def line_id(file_digest: str, line_no: int) -> str:
    """The output id of a line rejected before it became a job: unique within the file, stable across runs."""
    return "batch_req_" + hashlib.sha256(f"{file_digest}\n{line_no}".encode()).hexdigest()[:24]


def success_line(req: BatchRequest, results: list[Result], model: str | None = None) -> dict[str, Any]:
    """The answer of a line whose jobs are all done (results in input order); model: the model the serving worker
    reports, the requested one when that is unknown. The line is named by its first job."""
    result = results[0]
    if req.embeddings is not None:
        return {"id": f"batch_req_{result.job_id}", "custom_id": req.custom_id,
                "response": {"status_code": 200, "request_id": result.job_id,
                             "body": response_body(req.embeddings, results, model or req.model)}, "error": None}
    if len(results) != 1:
        raise ValueError(f"line {req.line_no} ({req.url}) runs one job, not {len(results)}")
    if req.translated is not None:
        body = req.translated.answer(result, model or req.model)
        return {"id": f"batch_req_{result.job_id}", "custom_id": req.custom_id,
                "response": {"status_code": 200, "request_id": result.job_id, "body": body}, "error": None}
    created = int(result.timings.finished or time.time())
    kind, prefix = ("chat.completion", "chatcmpl") if req.url == CHAT else ("text_completion", "cmpl")
    u = result.usage
    usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
             "total_tokens": u.prompt_tokens + u.completion_tokens,
             "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
    answer = choice(req.url == CHAT, 0, result.text, result.finish_reason, result.logprobs, result.tool_calls,
                    result.content)
    body = {"id": f"{prefix}-{result.job_id}", "object": kind, "created": created, "model": model or req.model,
            "choices": [answer], "usage": usage, "system_fingerprint": result.worker}
    return {"id": f"batch_req_{result.job_id}", "custom_id": req.custom_id,
            "response": {"status_code": 200, "request_id": result.job_id, "body": body}, "error": None}


def error_line(row_id: str, custom_id: str, code: str, message: str) -> dict[str, Any]:
    """A line's error; its message clipped, as an HTTP error's is, whatever built it."""
    return {"id": row_id, "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": clipped(message)}}


def failed_result_line(req: BatchRequest, part: int, result: Result) -> dict[str, Any]:
    """The error line of a line whose job `part` did not finish done: which input, and why."""
    message = result.error or f"job {result.status}"
    if len(req.jobs) > 1:
        message = (f"{req.input_name(part)} (input {part + 1} of {len(req.jobs)}, job {result.job_id}) ended "
                   f"{result.status}: {message}; the line has no answer for any input: fix that input and run the "
                   "line again")
    return error_line(f"batch_req_{result.job_id}", req.custom_id, result.status, message)


def invalid_request_line(req: BatchRequest, err: InvalidRequest | str, digest: str) -> dict[str, Any]:
    return error_line(line_id(digest, req.line_no), req.custom_id, "invalid_request", f"line {req.line_no}: {err}")


def plan_line(line_no: int, raw: str, seed: str, priority: str, keys: Keys, client_id: str,
              translators: Mapping[str, Translator] | None = None) -> BatchRequest | dict[str, Any]:
    """One input line of a file that passed file_problems as a request ready to submit, or its error line: the one
    per-line check `kvgate batch` and the gateway's /v1/batches share. `seed` makes the idempotency keys (the file
    digest, or the batch id); `translators`: as parse_line's."""
    custom_id = custom_id_of(raw)
    if custom_id is None:  # file_problems refuses such a file; naming the line here could take a real custom_id
        raise ValueError(f"line {line_no} has no usable custom_id: check the file with file_problems first")
    try:
        req = parse_line(line_no, raw, seed, translators)
    except BadLine as e:
        return error_line(line_id(seed, line_no), custom_id, e.code, str(e))
    for part, args in enumerate(req.jobs):
        args.setdefault("priority", priority)
        try:
            prepare(args, keys, client_id)  # every check submit would make
        except InvalidRequest as e:
            return invalid_request_line(req, e if len(req.jobs) == 1 else f"{req.input_name(part)}: {e}", seed)
    return req


def unknown_model_line(req: BatchRequest, message: str, seed: str) -> dict[str, Any]:
    """A line for a model nobody serves, knows or allows: OpenAI's model_not_found, not a job that waits forever."""
    return error_line(line_id(seed, req.line_no), req.custom_id, "model_not_found", f"line {req.line_no}: {message}")


UNRUN = {"cancelled": ("batch_cancelled", "the batch was cancelled (a cancel request, or its input file was deleted) "
                                          "before this request was answered"),
         "expired": ("batch_expired", "this request could not be executed before the completion window expired")}


def unrun_line(seed: str, custom_id: str, status: str) -> dict[str, Any]:
    """The error line of a request a cancelled or expired batch never answered, so the batch accounts for every line."""
    code, message = UNRUN[status]
    row_id = "batch_req_" + hashlib.sha256(f"{seed}\n{custom_id}\nunrun".encode()).hexdigest()[:24]
    return error_line(row_id, custom_id, code, message)


def answer_line(req: BatchRequest, results: list[Result], model: str | None = None) -> dict[str, Any]:
    """The output line of a line whose jobs are all final (results in input order): its answer, or an error line
    naming the first input that failed and why."""
    if len(results) != len(req.jobs):
        raise ValueError(f"line {req.line_no} runs {len(req.jobs)} jobs; {len(results)} results were given")
    failed = next(((part, r) for part, r in enumerate(results) if r.status != "done"), None)
    return success_line(req, results, model) if failed is None else failed_result_line(req, *failed)


def is_success(row: dict[str, Any]) -> bool:
    return row.get("error") is None and row.get("response") is not None


def request_lines(data: bytes) -> list[tuple[int, str]]:
    """The non-blank lines of a batch file with their 1-based line numbers."""
    return [(n, raw) for n, raw in enumerate(data.decode("utf-8", "replace").splitlines(), start=1) if raw.strip()]
