"""User-facing validation of a submit call, and its translation into a wire Job.

pydantic checks every argument first and names the field and value of each defect; the wire-level
checks of protocol.py (shared with the worker) then run on the built Job as a second net.
"""
from __future__ import annotations

import hashlib
import time
import uuid
from typing import Annotated, Any, Literal

import msgspec
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from . import protocol as wire
from .errors import FieldError, InvalidRequest

MAX_TTL_S = 30 * 24 * 3600.0
MAX_IDEMPOTENCY_KEY_CHARS = 200
MAX_TOKEN_ID = 2**31 - 1


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"is not valid UTF-8 text (lone surrogate {text[e.start]!r} at position {e.start})") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


def _metadata_size(metadata: dict[str, str]) -> dict[str, str]:
    size = len(wire.encode_metadata(metadata))
    if size > wire.MAX_METADATA_BYTES:
        raise ValueError(f"is {size} bytes encoded, over the limit of {wire.MAX_METADATA_BYTES}")
    return metadata


def _total_chars(messages: list) -> list:
    total = sum(len(m.content) for m in messages)
    if total > wire.MAX_PROMPT_CHARS:
        raise ValueError(f"hold {total} characters together, over the limit of {wire.MAX_PROMPT_CHARS}")
    return messages


def _top_k(k: int) -> int:
    if k == 0 or k < -1:
        raise ValueError("must be -1 (disabled) or a positive integer")
    return k


def _one_or_many(stop: object) -> object:
    return [stop] if isinstance(stop, str) else stop


def _model_name(name: str) -> str:
    try:
        return wire.check_model_name(name)
    except wire.ProtocolError as e:
        raise ValueError(str(e).removeprefix(f"model name {name!r} ")) from None


def _idempotency_key(key: str) -> str:
    if not key.isprintable() or any(c.isspace() for c in key):
        raise ValueError("must be printable with no whitespace")
    return key


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: Annotated[Text, Field(max_length=wire.MAX_PROMPT_CHARS)]


class SubmitRequest(BaseModel):
    """Every argument of Client.submit; strict, so True is not a number and '1' is not an int."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    prompt: Annotated[Text, Field(min_length=1, max_length=wire.MAX_PROMPT_CHARS)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=wire.MAX_MESSAGES),
                        AfterValidator(_total_chars)] | None = None
    prompt_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=wire.MAX_PROMPT_CHARS)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=wire.MAX_TOKENS_LIMIT)] = 256
    temperature: Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, AfterValidator(_top_k)] = -1
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)] = 1.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] = 0.0
    logprobs: Annotated[int, Field(ge=0, le=wire.MAX_LOGPROBS)] | None = None
    stop: Annotated[list[Annotated[Text, Field(min_length=1, max_length=wire.MAX_STOP_STRING_CHARS)]],
                    Field(max_length=wire.MAX_STOP_STRINGS), BeforeValidator(_one_or_many)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=wire.MAX_STOP_STRINGS * 4)] | None = None
    ignore_eos: bool = False
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    priority: Literal["high", "normal", "low"] = "normal"
    ttl_s: Annotated[float, Field(gt=0.0, le=MAX_TTL_S, allow_inf_nan=False)] | None = None
    deadline: Annotated[float, Field(allow_inf_nan=False)] | None = None
    idempotency_key: Annotated[str, Field(min_length=1, max_length=MAX_IDEMPOTENCY_KEY_CHARS),
                               AfterValidator(_idempotency_key)] | None = None
    stream: bool = False
    prefix_key: Annotated[str, Field(min_length=1, max_length=MAX_IDEMPOTENCY_KEY_CHARS)] | None = None
    model: Annotated[str, AfterValidator(_model_name)] | None = None  # None: the `default` model
    metadata: Annotated[dict[Annotated[Text, Field(max_length=256)], Text],
                        AfterValidator(_metadata_size)] | None = None

    def sampling(self) -> wire.Sampling:
        stop = list(self.stop or [])
        return wire.Sampling(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                             top_k=self.top_k, repetition_penalty=self.repetition_penalty, stop=stop,
                             stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                             seed=self.seed, frequency_penalty=self.frequency_penalty,
                             presence_penalty=self.presence_penalty, logprobs=self.logprobs)

    def digest(self) -> str:
        """What makes two submits 'the same request' for idempotency: the body, not its timing or key."""
        body = self.model_dump(exclude={"idempotency_key", "deadline", "prefix_key"}, mode="json")
        return hashlib.sha256(msgspec.json.encode(body, order="sorted")).hexdigest()[:32]


def validate_request(kwargs: dict[str, Any], where: str = "") -> SubmitRequest:
    """Validate submit arguments; any defect raises InvalidRequest naming each field and value."""
    if not isinstance(kwargs, dict):
        raise InvalidRequest([FieldError(where.rstrip(".") or "request", kwargs, "must be a dict of submit arguments")])
    try:
        req = SubmitRequest(**kwargs)
    except ValidationError as e:
        raise InvalidRequest([_field_error(err, where) for err in e.errors()]) from None
    except TypeError as e:  # e.g. a keyword that is not a string
        raise InvalidRequest([FieldError(where or "request", kwargs, str(e))]) from None
    _check_combination(req, where)
    return req


def _check_combination(req: SubmitRequest, where: str) -> None:
    given = [n for n in ("prompt", "messages", "prompt_token_ids") if getattr(req, n) is not None]
    if len(given) != 1:
        raise InvalidRequest([FieldError(f"{where}{'/'.join(given) or 'prompt'}", len(given),
                                         "give exactly one of prompt, messages, prompt_token_ids")])
    if req.ttl_s is not None and req.deadline is not None:
        raise InvalidRequest([FieldError(f"{where}deadline", req.deadline, "give ttl_s or deadline, not both")])
    if req.deadline is not None and req.deadline <= time.time():
        raise InvalidRequest([FieldError(f"{where}deadline", req.deadline,
                                         f"is in the past (now is {time.time():.3f}); give a future unix time "
                                         "or a positive ttl_s")])


def _field_error(err: dict, where: str) -> FieldError:
    loc = [str(p) for p in err["loc"] if not _is_union_tag(p)]
    name = ".".join(loc) or "request"
    value = err.get("input")
    reason = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        reason = "is not a submit argument (check the spelling)"
    return FieldError(f"{where}{name}", value, reason)


def _is_union_tag(part: object) -> bool:
    # pydantic puts union member names like 'list[...]' or 'function-after[...]' into error locations
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict"))


def new_job_id() -> str:
    return uuid.uuid4().hex


def build_job(req: SubmitRequest, client_id: str, job_id: str | None = None, where: str = "") -> wire.Job:
    now = time.time()
    deadline = now + req.ttl_s if req.ttl_s is not None else req.deadline
    messages = [wire.Message(m.role, m.content) for m in req.messages] if req.messages else None
    job = wire.Job(v=wire.JOB_VERSION, job_id=job_id or new_job_id(), client_id=client_id, enqueued_at=now,
                   prompt=req.prompt, messages=messages, prompt_token_ids=req.prompt_token_ids,
                   sampling=req.sampling(), priority=req.priority, deadline=deadline, stream=req.stream,
                   idempotency_key=req.idempotency_key, metadata=req.metadata, model=req.model)
    try:
        wire.validate_job(job)
    except wire.ProtocolError as e:
        raise InvalidRequest([FieldError(f"{where}request", job.job_id, str(e))]) from None
    return job


def encode_job(job: wire.Job, where: str = "") -> bytes:
    payload = wire.encode(job)
    if len(payload) > wire.MAX_PAYLOAD_BYTES:
        raise InvalidRequest([FieldError(f"{where}request", f"{len(payload)} bytes",
                                         f"encodes to more than the {wire.MAX_PAYLOAD_BYTES}-byte payload limit; "
                                         "shorten the prompt")])
    return payload
