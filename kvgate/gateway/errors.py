"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with their HTTP status."""
from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

import math
import re

from kvgate.producer.quoting import clipped, shown
from kvgate.producer import Backpressure, ConnectionFailed, InvalidRequest, QuotaExceeded, Result, ResultTimeout

INVALID = "invalid_request_error"
PARAM_CHARS = 200  # a param names a field; a longer one is a caller's key quoted back
# the SDK's place of a request in a submit_many call: the gateway sends one body's choices, so it names no body field
SUBMIT_MANY_PLACE = re.compile(r"^requests\[\d+\]\.")


class ApiError(Exception):
    """What a route raises to answer with an error; the handler below renders it. Its message and param are clipped
    whenever they are set: whatever built them and whatever they quote, an error stays short on its way out (an HTTP
    answer, a stream's error event, a batch's error line)."""

    def __init__(self, status: int, message: str, *, type: str = INVALID, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(clipped(message))
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    @property
    def message(self) -> str:
        return self._message

    @message.setter
    def message(self, text: str) -> None:
        self._message = clipped(text)

    @property
    def param(self) -> str | None:
        return self._param

    @param.setter
    def param(self, name: str | None) -> None:
        self._param = None if name is None else clipped(name, PARAM_CHARS)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, value: object, what: str = "") -> ApiError:
    return ApiError(400, f"{param}={shown(value)} is not supported by this kvgate gateway{what}; leave it out",
                    param=param, code="unsupported_parameter")


def from_sdk(e: Exception, names: dict[str, str], retry_after_s: int) -> ApiError:
    """An SDK error as the HTTP error a client expects; `names` maps SDK argument names back to body fields."""
    if isinstance(e, InvalidRequest):
        field = SUBMIT_MANY_PLACE.sub("", e.field, count=1).split(".", 1)
        param = ".".join([names.get(field[0], field[0]), *field[1:]])
        return ApiError(400, f"{param}: {e.reason} (got {shown(e.value)})", param=param, code="invalid_value")
    if isinstance(e, QuotaExceeded):
        return rate_limited(e, retry_after_s)
    if isinstance(e, Backpressure):
        adds = "" if e.requested <= 1 else f" and this request adds {e.requested}"
        return ApiError(429, f"the queue holds {e.backlog} waiting jobs{adds}, at or over this gateway's limit of "
                             f"{e.max_backlog}; retry after {retry_after_s} s", type="rate_limit_error",
                        code="queue_full", headers={"Retry-After": str(retry_after_s)})
    if isinstance(e, ResultTimeout):
        return ApiError(504, f"no answer within {e.timeout:g} s; the job was cancelled, retry later or raise "
                             "the gateway's --request-timeout", type="timeout_error", code="timeout")
    if isinstance(e, ConnectionFailed):
        return ApiError(503, "the job queue is unreachable; retry later", type="server_error",
                        code="queue_unavailable")
    raise e


def rate_limited(e: QuotaExceeded, retry_after_s: int) -> ApiError:
    """A tenant over its quota, in OpenAI's rate-limit shape and headers: `requests` for its jobs in flight (the
    ceiling on jobs queued or running), `tokens` for its tokens per minute."""
    kind = "requests" if e.ceiling == "max_jobs" else "tokens"
    wait = max(retry_after_s, math.ceil(e.retry_after_s))
    headers = {"Retry-After": str(wait), f"x-ratelimit-limit-{kind}": str(e.limit),
               f"x-ratelimit-remaining-{kind}": str(max(0, e.limit - e.used)), f"x-ratelimit-reset-{kind}": f"{wait}s"}
    return ApiError(429, f"{e}", type=kind, code="rate_limit_exceeded", headers=headers)


async def api_error_handler(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def http_error_handler(request: Request, exc: HTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = exc.detail if exc.status_code != 404 else f"no route {request.method} {request.url.path}"
    return JSONResponse(ApiError(exc.status_code, message, code=code).body(), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error", code="internal_error")
    return JSONResponse(error.body(), status_code=500)


def failure(r: Result) -> ApiError | None:
    """A final result that is not an answer, as the error the request gets; None for a done job."""
    if r.status == "done":
        return None
    if r.status == "expired":
        return ApiError(504, f"job {r.job_id} expired before a worker answered it", type="timeout_error",
                        code="job_expired")
    if r.status == "cancelled":
        return ApiError(409, f"job {r.job_id} was cancelled", code="job_cancelled")
    message = r.error or "the worker reported an error without a reason"
    if message.startswith(("rejected:", "invalid job:")):  # the worker refused the input: the client can fix it
        return ApiError(400, f"job {r.job_id}: {message}", code="rejected_by_worker")
    return ApiError(500, f"job {r.job_id} failed on worker {r.worker}: {message}", type="server_error",
                    code="worker_error")
