"""A /v1/responses line of a managed batch: its body read by the Responses parser POST /v1/responses uses (body.take),
run as the chat line it becomes, and answered with the Response object POST /v1/responses would return
(ResponseView.finished).

A batch runs each line on its own, answered in the output file, so a line may not ask for what only a request of
its own has: `stream: true` (the answer is written whole), `background: true` (the batch is already asynchronous),
`previous_response_id` (no line continues another: the conversation goes in `input`) or `store: true` (a line's
Response is kept in the output file, not stored for GET /v1/responses/{id}). Each is refused as that line's
error, naming the field; the batch's other lines run. A line's Response repeats store=false and background=false.
"""
from __future__ import annotations

import time
from typing import Any

from kvgate.openai.batch import RESPONSES, BadLine, Translated, Translator
from kvgate.producer import Result

from ..errors import ApiError
from .body import take
from .response_object import ResponseView, response_id

# field -> (the values a batch line may give it, why others cannot work in a batch)
NOT_IN_BATCH: dict[str, tuple[tuple[Any, ...], str]] = {
    "stream": ((None, False), "a batch line's answer is written whole to the output file"),
    "background": ((None, False), "a batch already runs in the background"),
    "previous_response_id": ((None,), "each batch line runs on its own: put the conversation in input"),
    "store": ((None, False), "a batch line's Response is kept in the output file, not stored for "
                             "GET /v1/responses/{id}"),
}


def translate(body: dict[str, Any]) -> Translated:
    """A /v1/responses line's body as its chat body and its Response maker; BadLine names the field refused."""
    for name, (allowed, why) in NOT_IN_BATCH.items():
        value = body.get(name)
        if not any(value is a for a in allowed):  # None and False themselves: not 0, not ""
            raise BadLine("unsupported_parameter", f"body.{name}={value!r} is not supported in a batch: {why}; "
                                                   "leave it out")
    try:
        asked = take({**body, "store": False})
    except ApiError as e:
        code = "unsupported_parameter" if e.code == "unsupported_parameter" else "invalid_request"
        raise BadLine(code, f"body.{e.param}: {e.message}" if e.param else e.message) from None
    echo = asked.echo

    def answer(result: Result, model: str) -> dict[str, Any]:
        view = ResponseView(response_id(result.job_id), int(result.timings.finished or time.time()), model, echo)
        return view.finished(result)

    return Translated(asked.chat, answer)


TRANSLATORS: dict[str, Translator] = {RESPONSES: translate}  # what the gateway's batches take beside chat & co.
