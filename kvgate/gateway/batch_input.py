"""Whole-file checks of a batch's input, before any job is submitted: what fails a batch as OpenAI's does.

A line that is wrong on its own (not JSON, an unsupported parameter) does not fail the batch: it gets an
error line, exactly as `kvgate batch` writes it. What fails the whole batch is what makes the file as a whole
unusable: no requests, repeated custom_ids, or requests for another endpoint than the batch's.
"""
from __future__ import annotations

from kvgate.openai.batch import duplicate_custom_id, request_lines, text_field

MAX_LINES = 50_000  # OpenAI's limit per batch
MAX_ERRORS = 20  # errors listed; the message says how many more there are


def input_errors(data: bytes, endpoint: str) -> list[dict]:
    """OpenAI's `errors.data` entries ({code, message, param, line}); empty when the file may run."""
    lines = request_lines(data)
    if not lines:
        return [_error("empty_file", "the input file has no request lines")]
    if len(lines) > MAX_LINES:
        return [_error("too_many_requests", f"the input file has {len(lines)} requests; a batch takes at most "
                                            f"{MAX_LINES}: split the file")]
    duplicate = duplicate_custom_id([raw for _, raw in lines])
    if duplicate:
        return [_error("duplicate_custom_id", duplicate, param="custom_id")]
    wrong = [(n, url) for n, url in ((n, text_field(raw, "url")) for n, raw in lines) if url is not None and url != endpoint]
    errors = [_error("mismatched_endpoint", f"line {n}: url {url!r} differs from the batch's endpoint {endpoint!r}; "
                                            "every line of a batch must use its endpoint", "url", n)
              for n, url in wrong[:MAX_ERRORS]]
    if len(wrong) > MAX_ERRORS:
        errors.append(_error("mismatched_endpoint", f"{len(wrong) - MAX_ERRORS} more lines use another endpoint",
                             "url"))
    return errors


def _error(code: str, message: str, param: str | None = None, line: int | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}
