"""Whole-file checks of a batch's input, before any job is submitted: what fails a batch as OpenAI's does.

A line that is wrong on its own (an unsupported parameter, a bad value) does not fail the batch: it gets an
error line, exactly as `kvgate batch` writes it. What fails the whole batch is what makes the file as a whole
unusable: no requests, too many, a line without its own custom_id (missing, not a non-empty string, or repeated:
a line named any other way could take a real custom_id's place), or requests for another endpoint than the batch's.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvgate.openai.batch import custom_id_of, file_problems, request_lines

MAX_LINES = 50_000  # OpenAI's limit per batch
MAX_ERRORS = 20  # errors listed; the message says how many more there are


@dataclass(slots=True)
class CheckedInput:
    errors: list[dict]  # OpenAI's `errors.data` entries ({code, message, param, line}); empty when the file may run
    custom_ids: list[str]  # in input order, once the file may run: every line the batch must account for


def check_input(data: bytes, endpoint: str) -> CheckedInput:
    lines = request_lines(data)
    if not lines:
        return CheckedInput([_error("empty_file", "the input file has no request lines")], [])
    if len(lines) > MAX_LINES:
        return CheckedInput([_error("too_many_requests", f"the input file has {len(lines)} requests; a batch takes "
                                                         f"at most {MAX_LINES}: split the file")], [])
    problems = file_problems(lines, endpoint)
    errors = [_error(p.code, p.message, p.param, p.line) for p in problems[:MAX_ERRORS]]
    if len(problems) > MAX_ERRORS:
        errors.append(_error("too_many_errors", f"{len(problems) - MAX_ERRORS} more problems like these; fix them "
                                                "and upload the file again"))
    return CheckedInput(errors, [] if errors else [custom_id_of(raw) for _, raw in lines])


def _error(code: str, message: str, param: str | None = None, line: int | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}
