"""User-facing validation of a submit call, and its translation into a wire Job.

pydantic checks every argument first and names the field and value of each defect; the wire-level
checks of protocol.py (shared with the worker) then run on the built Job as a second net.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import operator
import time
import types
import typing
import uuid
from typing import Annotated, Any, Literal

import msgspec
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, ValidationError,
                      create_model, model_validator)

from . import constraints, limits, protocol as wire
from .errors import FieldError, InvalidRequest
from .fields import NEWER, NOT_DIGESTED, Checked, Entries, Items, Range, Shape, Spec
from .request_structured import (Structured, Text, Tools, call_arguments, is_model_class, schema_dict, structured_of,
                                 tool_choice_of)
from .tracing import current_traceparent

MAX_TTL_S = 30 * 24 * 3600.0
MAX_IDEMPOTENCY_KEY_CHARS = 200
MAX_TOKEN_ID = 2**31 - 1
EMBEDDING_DEFAULTS = {spec.name: spec.default for spec in wire.EMBEDDING_FIELDS}
# what an embedding job refuses to be given other than at its default: every sampling field, and streaming
GENERATION_FIELDS = (*(spec.name for spec in wire.SAMPLING_FIELDS), "stream")


TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


def _total_chars(messages: list) -> list:
    total = sum(m.to_wire().size() for m in messages)
    if total > limits.MAX_PROMPT_CHARS:
        raise ValueError(f"hold {total} characters together, over the limit of {limits.MAX_PROMPT_CHARS}")
    return messages


def _one_or_many(stop: object) -> object:
    return [stop] if isinstance(stop, str) else stop


def _idempotency_key(key: str) -> str:
    if not key.isprintable() or any(c.isspace() for c in key):
        raise ValueError("must be printable with no whitespace")
    return key


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
    name: Annotated[str, Field(pattern=limits.TOOL_NAME.pattern)]
    arguments: Annotated[Text, BeforeValidator(call_arguments), Field(max_length=limits.MAX_PROMPT_CHARS)] = "{}"


class MessageToolCall(BaseModel):
    """An assistant message's call in OpenAI's shape: {"id", "type": "function", "function": {"name", "arguments"}}."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
    id: Annotated[str, Field(min_length=1, max_length=128)]
    type: Literal["function"] = "function"
    function: FunctionCall


def _no_content(value: Any) -> Any:
    return "" if value is None else value  # an assistant message of tool calls alone has content None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: Annotated[Text, BeforeValidator(_no_content), Field(max_length=limits.MAX_PROMPT_CHARS)]
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=limits.MAX_TOOL_CALLS)] | None = None
    tool_call_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    name: Annotated[Text, Field(min_length=1, max_length=64)] | None = None

    def to_wire(self) -> wire.Message:
        calls = None if self.tool_calls is None else [wire.ToolCall(c.id, c.function.name, c.function.arguments)
                                                     for c in self.tool_calls]
        message = wire.Message(self.role, self.content, calls, self.tool_call_id, self.name)
        if (problem := wire.message_problem(message)) is not None:
            raise ValueError(problem)
        return message




# Job's fields a caller gives, each as Job declares it: all but what the SDK fills in (the version, ids and enqueue
# time), the prompt (_Prompt's, in the SDK's input types) and the Structs its flat arguments build (sampling, embedding)
JOB_ARGUMENTS = tuple(spec for spec in wire.JOB_FIELDS if spec.name not in {
    "v", "job_id", "client_id", "enqueued_at", "prompt", "messages", "prompt_token_ids", "sampling", "embedding"})
# The job fields a caller gives in a form of the SDK's own (the type without None, replacing the wire's): stricter
# input, or OpenAI's shape (tools; wire_tools makes the wire's Tools with tool_choice). The name, default, the wire's
# check and the digest markers stay Job's.
SDK_INPUT = {
    "idempotency_key": Annotated[str, Field(min_length=1, max_length=MAX_IDEMPOTENCY_KEY_CHARS),
                                 AfterValidator(_idempotency_key)],
    "metadata": dict[Annotated[Text, Field(max_length=256)], Text],
    "suffix": Annotated[Text, Field(max_length=limits.MAX_PROMPT_CHARS)],  # fill-in-the-middle: the text after the hole
    "tools": Tools,
}


def _sdk_field(spec: Spec) -> tuple[Any, Any]:
    """A wire field as a submit argument: the wire's type, default, bounds and digest markers, and the SDK's
    conveniences: a list may be left out (None, sent as the empty list), `stop` may be one string, and the fields of
    SDK_INPUT take their own input form."""
    annotation, default = _sdk_type(spec)
    return (Annotated[(annotation, *spec.markers)] if spec.markers else annotation), default


def _sdk_type(spec: Spec) -> tuple[Any, Any]:
    b = spec.bounds
    if isinstance(b, Shape):
        return Structured, spec.default
    if isinstance(b, Entries):  # a mapping that may be left out too (None, sent as the empty mapping)
        key = Annotated[int, Field(ge=b.key.ge)]
        value = Annotated[float, Field(ge=b.value.ge, le=b.value.le, allow_inf_nan=False)]
        return Annotated[dict[key, value], Field(max_length=b.max_items)] | None, None
    if typing.get_origin(spec.type) is Literal:
        return spec.type, spec.default
    if isinstance(b, Items):
        item = Annotated[Text, Field(min_length=b.chars[0], max_length=b.chars[1])] if b.chars else TokenId
        before = [BeforeValidator(_one_or_many)] if spec.name == "stop" else []
        # a tuple, not a starred subscript: `X[a, *b]` is Python 3.11 syntax, and the SDK claims 3.10
        return Annotated[(list[item], Field(max_length=b.max_items), *before)] | None, None
    base = SDK_INPUT.get(spec.name) or next(t for t in typing.get_args(spec.type) or (spec.type,)
                                            if t is not type(None))
    if isinstance(b, Checked):  # the wire's own check, its message without the field and value the SDK names apart
        base = Annotated[base, AfterValidator(lambda v, b=b: _checked(v, b))]
    elif isinstance(b, Range):
        if b.off is not None:  # a value outside the range that disables: one message for both
            base = Annotated[base, AfterValidator(lambda v, b=b: _within(v, b))]
        else:
            base = Annotated[base, Field(ge=b.ge, gt=b.gt, le=b.le, lt=b.lt,
                                         **({"allow_inf_nan": False} if base is float else {}))]
    return (base | None if spec.optional else base), spec.default


def _within(value: Any, bounds: Range) -> Any:
    if not bounds.holds(value):
        raise ValueError(f"must {bounds.rule()}")
    return value


def _checked(value: Any, bounds: Checked) -> Any:
    try:
        return bounds.check(value)
    except ValueError as e:
        raise ValueError(bounds.reason(str(e), value)) from None


class _Prompt(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    prompt: Annotated[Text, Field(min_length=1, max_length=limits.MAX_PROMPT_CHARS)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=limits.MAX_MESSAGES),
                        AfterValidator(_total_chars)] | None = None
    prompt_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=limits.MAX_PROMPT_CHARS)] | None = None


# The sampling arguments are wire.Sampling's fields, an embedding's are wire.Embedding's and the job's own are
# wire.Job's (JOB_ARGUMENTS), made once from them.
_Arguments = create_model("_Arguments", __base__=_Prompt, __module__=__name__,
                          **{spec.name: _sdk_field(spec)
                             for spec in wire.SAMPLING_FIELDS + wire.EMBEDDING_FIELDS + JOB_ARGUMENTS})


class SubmitRequest(_Arguments):
    """Every argument of Client.submit; strict, so True is not a number and '1' is not an int. The fields declared
    here are the SDK's alone: the job carries what they make (a deadline, a constraint, tools' choice), or nothing.
    Their digest markers (fields.py): NEWER on those added after digests were first stored, NOT_DIGESTED on those a
    digest leaves out."""

    ttl_s: Annotated[float, Field(gt=0.0, le=MAX_TTL_S, allow_inf_nan=False)] | None = None
    prefix_key: Annotated[Annotated[str, Field(min_length=1, max_length=MAX_IDEMPOTENCY_KEY_CHARS)] | None,
                          NOT_DIGESTED] = None
    # the conveniences that make `structured` (structured_of); a pydantic model class also makes Result.parsed
    response_format: Annotated[Any, AfterValidator(schema_dict),
                               PlainSerializer(lambda v: v.model_json_schema() if is_model_class(v) else v)] = None
    regex: Annotated[Text, Field(min_length=1, max_length=limits.MAX_STRUCTURED_CHARS)] | None = None
    choice: Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1, max_length=limits.MAX_CHOICES)] \
        | None = None
    grammar: Annotated[Text, Field(min_length=1, max_length=limits.MAX_STRUCTURED_CHARS)] | None = None
    # functions the model may call (chat messages only): OpenAI's tools, tool_choice and parallel_tool_calls
    tool_choice: Annotated[Any, BeforeValidator(tool_choice_of), NEWER] = None  # None: auto with tools
    parallel_tool_calls: Annotated[bool, NEWER] = True

    def wire_tools(self) -> constraints.Tools | None:
        """The job's tools; None where none are given or tool_choice is 'none' (the model is not shown them)."""
        if not self.tools or self.tool_choice == "none":
            return None
        named = self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else ""
        choice = "function" if named else self.tool_choice or "auto"
        return constraints.Tools(list(self.tools), choice, named, self.parallel_tool_calls)

    @model_validator(mode="after")
    def _one_constraint(self) -> "SubmitRequest":
        made = structured_of(self.response_format, self.regex, self.choice, self.grammar)
        if made is not None:
            if self.structured is not None:
                raise ValueError("give structured= or one of response_format, regex, choice, grammar, not both")
            if problem := made.problem():
                raise ValueError(problem)
            object.__setattr__(self, "structured", made)
        return self

    @property
    def parse_as(self) -> type[BaseModel] | None:
        """The pydantic model class the answer is validated into (Result.parsed), when response_format is one."""
        return self.response_format if is_model_class(self.response_format) else None

    def embedding(self) -> wire.Embedding | None:
        """An embedding job's settings (None: the defaults, or not an embedding job)."""
        given = {s.name: getattr(self, s.name) for s in wire.EMBEDDING_FIELDS}
        return None if self.task != "embed" or given == EMBEDDING_DEFAULTS else wire.Embedding(**given)

    def sampling(self) -> wire.Sampling:
        given = {s.name: getattr(self, s.name) for s in wire.SAMPLING_FIELDS}
        return wire.Sampling(**{name: value for name, value in given.items() if value is not None})  # None: default

    def digest(self) -> str:
        """What makes two submits 'the same request' for idempotency: the body, not its timing, key or tenant (who
        sent it: a batch line resubmitted with its tenant by an upgraded gateway replica reattaches to the job a
        replica from before tenants submitted, and every digest stays what it was before tenants existed)."""
        body = self.model_dump(exclude={*NOT_DIGESTED_FIELDS, *self._defaults()}, mode="json")
        return hashlib.sha256(msgspec.json.encode(body, order="sorted")).hexdigest()[:32]

    def _defaults(self) -> set[str]:
        """Fields newer than digests that hold their default: left out, so a generation job's digest stays."""
        fields = type(self).model_fields
        return {name for name in NEWER_THAN_DIGESTS if getattr(self, name) in (fields[name].default, {})}


def _marked(marker: object) -> tuple[str, ...]:
    return tuple(name for name, f in SubmitRequest.model_fields.items() if marker in f.metadata)


# the fields marked NEWER (fields.NewerThanDigests): left out of a digest while at their default
NEWER_THAN_DIGESTS = _marked(NEWER)
# the fields marked NOT_DIGESTED (fields.NotDigested): always left out of a digest
NOT_DIGESTED_FIELDS = _marked(NOT_DIGESTED)


def _submit_signature() -> inspect.Signature:
    kw = inspect.Parameter.KEYWORD_ONLY
    shown = {"messages": list[dict | wire.Message] | None, "stop": str | list[str] | None}  # what the SDK also takes
    return inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
         inspect.Parameter("prompt", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=str | None)] +
        [inspect.Parameter(name, kw, default=f.default, annotation=shown.get(name, _plain(f.annotation)))
         for name, f in SubmitRequest.model_fields.items() if name != "prompt"])


def _plain(annotation: Any) -> Any:
    """A type without its Annotated bounds, as a signature shows it: list[int] | None."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _plain(args[0])
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, map(_plain, args))
    if origin in (list, dict):
        return origin[tuple(map(_plain, args))] if origin is dict else list[_plain(args[0])]
    return annotation


SUBMIT_SIGNATURE = _submit_signature()


def takes_submit_arguments(method):
    """`submit(self, prompt=None, **arguments)` shown (help(), IDEs that read __signature__) with every submit
    argument, read from SubmitRequest: a new field of wire.Sampling is a keyword of both clients at once."""
    method.__signature__ = SUBMIT_SIGNATURE.replace(return_annotation=inspect.signature(method).return_annotation)
    return method


def submit_arguments(client: object, prompt: object, arguments: dict[str, Any]) -> dict[str, Any]:
    """The arguments of one submit call as validate_request takes them; an unknown keyword is a TypeError, as it
    is for any Python function."""
    bound = SUBMIT_SIGNATURE.bind(client, prompt, **arguments).arguments
    del bound["self"]
    return plain_messages(bound)


def plain_messages(request: Any) -> Any:
    """Submit arguments whose Message objects are given as the dicts validation takes."""
    messages = request.get("messages") if isinstance(request, dict) else None
    if not isinstance(messages, (list, tuple)):  # None, or a wrong type that validation names as a whole
        return request
    return {**request, "messages": [message_dict(m) if isinstance(m, wire.Message) else m for m in messages]}


def message_dict(m: wire.Message) -> dict[str, Any]:
    """A wire message as the dict submit takes (OpenAI's shape)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls is not None:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    out |= {k: getattr(m, k) for k in ("tool_call_id", "name") if getattr(m, k) is not None}
    return out


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


def _check_tools(req: SubmitRequest, where: str) -> None:
    """tools and tool_choice together, named as the field at fault (a model validator's error names no field)."""
    if req.tool_choice not in (None, "none") and not req.tools:
        raise InvalidRequest([FieldError(f"{where}tool_choice", req.tool_choice, "needs tools")])
    if (tools := req.wire_tools()) is None:
        return
    names = [f.name for f in tools.functions]
    if req.messages is None:
        raise InvalidRequest([FieldError(f"{where}tools", names, "tools go with chat messages, not a prompt or "
                                                                 "token ids")])
    if problem := tools.problem():
        field = "tool_choice" if problem.startswith("tool choice") else "tools"
        raise InvalidRequest([FieldError(f"{where}{field}", req.tool_choice if field == "tool_choice" else names,
                                         problem)])
    if tools.choice != "auto" and req.structured is not None:  # the wire refuses it too, naming no field (45.11)
        raise InvalidRequest([FieldError(f"{where}tool_choice", req.tool_choice,
                                         f"constrains the answer to a tool call (choice {tools.choice!r}), so it "
                                         "cannot also follow response_format (or structured, regex, choice, "
                                         "grammar): give one of them, or tool_choice 'auto'")])


def _check_combination(req: SubmitRequest, where: str) -> None:
    _check_tools(req, where)
    given = [n for n in ("prompt", "messages", "prompt_token_ids") if getattr(req, n) is not None]
    if len(given) != 1:
        raise InvalidRequest([FieldError(f"{where}{'/'.join(given) or 'prompt'}", len(given),
                                         "give exactly one of prompt, messages, prompt_token_ids")])
    if req.task != "embed" and (changed := next((n for n, d in EMBEDDING_DEFAULTS.items() if getattr(req, n) != d),
                                                None)):
        raise InvalidRequest([FieldError(f"{where}{changed}", getattr(req, changed), "is for embedding jobs only "
                                         "(task='embed', or Client.embed)")])
    fields = type(req).model_fields
    if req.task == "embed" and (changed := next((n for n in GENERATION_FIELDS if getattr(req, n) != fields[n].default),
                                                None)):
        raise InvalidRequest([FieldError(f"{where}{changed}", getattr(req, changed), "is a generation setting; an "
                                         "embedding job generates nothing (it takes pooling, normalize, dimensions)")])
    if req.ttl_s is not None and req.deadline is not None:
        raise InvalidRequest([FieldError(f"{where}deadline", req.deadline, "give ttl_s or deadline, not both")])
    if req.messages is None and (req.chat_template_kwargs is not None or not req.add_generation_prompt):
        name = "chat_template_kwargs" if req.chat_template_kwargs is not None else "add_generation_prompt"
        raise InvalidRequest([FieldError(f"{where}{name}", getattr(req, name), "applies to messages only (the chat "
                                         "template); leave it out with a prompt or prompt_token_ids")])
    if req.suffix is not None and (req.prompt is None or req.task != "generate"):
        raise InvalidRequest([FieldError(f"{where}suffix", req.suffix, "is for fill-in-the-middle of a text "
                                         "prompt in a generation job; give it with prompt, not messages, "
                                         "prompt_token_ids or another task")])
    if req.task in ("tokenize", "detokenize") and (req.task == "detokenize") != (req.prompt_token_ids is not None):
        raise InvalidRequest([FieldError(f"{where}task", req.task, "detokenize takes prompt_token_ids; tokenize "
                                         "takes a prompt or messages")])
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
    messages = [m.to_wire() for m in req.messages] if req.messages else None
    given = {spec.name: getattr(req, spec.name) for spec in JOB_ARGUMENTS}
    job = wire.Job(v=wire.JOB_VERSION, job_id=job_id or new_job_id(), client_id=client_id, enqueued_at=now,
                   prompt=req.prompt, messages=messages, prompt_token_ids=req.prompt_token_ids,
                   sampling=req.sampling(), embedding=req.embedding(),
                   **{**given, "deadline": deadline, "tools": req.wire_tools(),
                      "traceparent": req.traceparent or current_traceparent()})
    try:
        wire.validate_job(job)
    except wire.ProtocolError as e:
        raise InvalidRequest([FieldError(f"{where}request", job.job_id, str(e))]) from None
    return job


def encode_job(job: wire.Job, where: str = "") -> bytes:
    payload = wire.encode(job)
    if len(payload) > limits.MAX_PAYLOAD_BYTES:
        raise InvalidRequest([FieldError(f"{where}request", f"{len(payload)} bytes",
                                         f"encodes to more than the {limits.MAX_PAYLOAD_BYTES}-byte payload limit; "
                                         "shorten the prompt")])
    return payload
