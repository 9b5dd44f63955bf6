"""The wire protocol between producers and workers: msgspec Structs, msgpack in one stream field.

Every payload carries a version. Decoding is strict about types and sizes, so a hostile or
malformed payload becomes a ProtocolError (and an error result), never a crash or a pickle.
"""
from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

from .constraints import Structured, Tools
from .fields import NEWER, NOT_DIGESTED, Checked, Entries, Items, Range, Shape, specs
from .job_checks import (ProtocolError, TemplateValue, check_metadata, check_model_name, check_template_kwargs,
                         check_tenant_name, check_traceparent)
from .limits import (MAX_EMBEDDING_DIMENSIONS, MAX_EVENT_BYTES, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_MESSAGES,
                     MAX_PAYLOAD_BYTES, MAX_PROMPT_CHARS, MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, MAX_STRUCTURED_CHARS,
                     MAX_TOKENS_LIMIT, MAX_TOOL_CALLS, TOOL_NAME)

# Version 2 added `attempt` to Delta and Final (which delivery of the job produced them; see stream.py).
# Readers accept every version from MIN_PROTOCOL_VERSION on: a version-1 message reads as attempt 1. The
# SDK still writes jobs at JOB_VERSION 1, whose schema did not change, so version-1 workers keep reading
# them during a rolling upgrade; upgrade the SDKs first (a version-1 SDK skips version-2 reply events and
# then finds its finals only by polling the result keys).
# Sampling's frequency_penalty, presence_penalty and logprobs, and the events' logprobs, came without a version
# bump: a job that does not use them encodes as before (omit_defaults), and readers of events ignore fields they
# do not know. A worker from before them keeps forbid_unknown_fields on Sampling, so a job that asks for them
# gets an error result naming the field from it instead of an answer that silently lacks them.
# Job's `tenant` came the same way: a job without one encodes as before, so new workers serve old producers' jobs;
# a worker from before it answers a job that carries one with an error result naming the field: upgrade workers
# before the gateways and producers that set it.
# Sampling's logit_bias, min_p, min_tokens, prompt_logprobs and skip_special_tokens, and Final's prompt_logprobs, came
# the same way: an old worker answers a job that uses one with an error result naming it.
# Job's chat_template_kwargs and add_generation_prompt came the same way.
# Job's `task` and `add_special_tokens` and Final's `max_model_len` came the same way: a generation job encodes as
# before; a worker from before them answers a tokenizer job with an error result naming the field.
# Task `embed`, Job's `embedding` and Final's `embedding` came the same way: a worker from before them answers an
# embedding job with an error result naming the task.
# Job's `suffix` (fill-in-the-middle) came the same way: a worker from before it answers a job that carries one with an
# error result naming the field.
# Tool calling came the same way: Job's `tools`, Message's `tool_calls`, `tool_call_id` and `name`, Final's
# `tool_calls` and `content`, Delta's `tool_parser`; a job without them encodes as before, and a worker from before
# them answers one that carries them with an error result naming the field.
PROTOCOL_VERSION = 2
MIN_PROTOCOL_VERSION = 1
JOB_VERSION = 1
FIELD = "p"  # the single stream field that holds a msgpack payload
# A job with a deadline also carries its length in ms (deadline - enqueued_at, both the producer's clock, so its offset
# cancels: invariant 9) in this field, which the read script orders by without decoding the payload (worker/due.py).
DUE_FIELD = "d"

Priority = Literal["high", "normal", "low"]
Status = Literal["done", "error", "expired", "cancelled"]
Role = Literal["system", "user", "assistant", "tool"]  # the SDK's roles; a raw job with another is bad input
FinishReason = Literal["stop", "length", "abort", "tool_calls"]  # tool_calls: the SDK's reading of a stop
# What a job asks of a worker: generate (the engine runs it), embed (the engine computes its prompt and pools the
# final hidden states into one vector, generating nothing), or tokenize / detokenize (the worker answers from its
# own tokenizer at once, without the engine or its KV cache: worker/tokenizer_jobs.py)
Task = Literal["generate", "tokenize", "detokenize", "embed"]
Pooling = Literal["model", "last", "mean", "cls"]  # model: the model's own (sentence-transformers config), else last
UNIX_TIME = Range(gt=-math.inf, lt=math.inf, says="be a finite number of unix seconds")


class ToolCall(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One call of a function: in an assistant message of the history, and in a final answer (Final.tool_calls)."""

    id: str
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI's (a model may write invalid JSON: the caller validates it)


class Message(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    role: Role
    content: str
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: the call it answers
    name: str | None = None  # OpenAI's participant name (a tool's answer: the function's)

    def size(self) -> int:
        return len(self.content) + sum(len(c.arguments) + len(c.name) for c in self.tool_calls or ())


class Sampling(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """How to generate: the one declaration of every sampling field's name, type, default and bounds (fields.py).
    The SDK's submit arguments, its validation, the worker's check of decoded jobs and the gateway's body fields
    are derived from it; a new field is added here and in the code that honours it. The engine's own
    SamplingParams (it may not import the SDK) is held to it by tests/producer/test_field_agreement.py."""

    max_tokens: Annotated[int, Range(ge=1, le=MAX_TOKENS_LIMIT, says=f"be between 1 and {MAX_TOKENS_LIMIT}")] = 256
    temperature: Annotated[float, Range(ge=0.0, le=100.0, says="be a number in [0, 100]")] = 1.0
    top_p: Annotated[float, Range(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Range(ge=1, off=-1, says="be -1 (disabled) or a positive integer")] = -1
    repetition_penalty: Annotated[float, Range(gt=0.0, le=10.0)] = 1.0
    stop: Annotated[list[str], Items(MAX_STOP_STRINGS, "{n} stop strings given; at most {max} are allowed",
                                     f"stop string {{item}} must have 1 to {MAX_STOP_STRING_CHARS} characters",
                                     chars=(1, MAX_STOP_STRING_CHARS))] = []
    stop_token_ids: Annotated[list[int], Items(MAX_STOP_STRINGS * 4, *[f"stop_token_ids={{head}} must be at most "
                                                                      f"{MAX_STOP_STRINGS * 4} non-negative ids"] * 2,
                                               item=Range(ge=0))] = []
    ignore_eos: bool = False
    seed: Annotated[int | None, Range(ge=0, lt=2**63, says="be in [0, 2**63)")] = None
    # OpenAI's, in [-2, 2]: minus this times the count of the token in the output
    frequency_penalty: Annotated[float, Range(ge=-2.0, le=2.0, says="be in [-2, 2] (0 disables it)")] = 0.0
    # OpenAI's, in [-2, 2]: minus this once the token is in the output
    presence_penalty: Annotated[float, Range(ge=-2.0, le=2.0, says="be in [-2, 2] (0 disables it)")] = 0.0
    # None: no logprobs; N: the chosen token's logprob and the N most likely
    logprobs: Annotated[int | None, Range(ge=0, le=MAX_LOGPROBS, says=f"be None (no logprobs) or 0 to {MAX_LOGPROBS} "
                                                                       "top alternatives per token")] = None
    # None: free text; else the one constraint its output follows (JSON schema, any JSON, regex, choice, grammar)
    structured: Annotated[Structured | None, Shape(MAX_STRUCTURED_CHARS)] = None
    # OpenAI's: token id -> a number in [-100, 100] added to its logit before penalties and temperature (vLLM's
    # order); -100 bans a token in practice, 100 all but forces it. A token id past the model's vocabulary is an
    # error result from the worker, which alone knows the vocabulary.
    logit_bias: Annotated[dict[int, float], Entries(
        MAX_LOGIT_BIAS, f"logit_bias has {{n}} entries; at most {MAX_LOGIT_BIAS} are allowed",
        "logit_bias entry {item} must map a token id >= 0 to a bias in [-100, 100]",
        key=Range(ge=0), value=Range(ge=-100.0, le=100.0)), NEWER] = {}
    # vLLM's: drop tokens whose probability is below min_p times the most likely one's (after temperature)
    min_p: Annotated[float, Range(ge=0.0, le=1.0, says="be in [0, 1] (0 disables it)"), NEWER] = 0.0
    # vLLM's: EOS and stop_token_ids are masked until this many tokens are out (a stop string still ends the output)
    min_tokens: Annotated[int, Range(ge=0, le=MAX_TOKENS_LIMIT, says=f"be between 0 and {MAX_TOKENS_LIMIT}"), NEWER] = 0
    # None: none; N: each prompt token's logprob given the tokens before it (the first has none) and the N most
    # likely there (completions' echo with logprobs, vLLM's prompt_logprobs), on the Final's prompt_logprobs
    prompt_logprobs: Annotated[int | None, Range(ge=0, le=MAX_LOGPROBS, says=f"be None (no prompt logprobs) or 0 to "
                                                                             f"{MAX_LOGPROBS} top alternatives"),
                               NEWER] = None
    # vLLM's: False keeps special tokens (<|im_end|>...) in the answer's text
    skip_special_tokens: Annotated[bool, NEWER] = True


SAMPLING_FIELDS = specs(Sampling)


class Embedding(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """How an embedding job (task `embed`) makes its vector: the one declaration of these fields, as Sampling is of
    the generation fields. `dimensions` keeps the first N values (then scales to unit length again when normalizing),
    for any model: a Matryoshka-trained model keeps its quality there, for others it is the caller's choice."""

    pooling: Annotated[Pooling, NEWER] = "model"
    normalize: Annotated[bool, NEWER] = True
    dimensions: Annotated[int | None, NEWER, Range(
        ge=1, le=MAX_EMBEDDING_DIMENSIONS, says=f"be None (every dimension) or 1 to {MAX_EMBEDDING_DIMENSIONS}")] = None


EMBEDDING_FIELDS = specs(Embedding)


class Job(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One job as it sits in `{ns}:jobs:<model>:<priority>`; as Sampling is of its fields, the one declaration of the
    job's own: types, defaults, bounds and digest markers (fields.py). validate_job checks the bounds, and the SDK's
    submit arguments for the fields a caller gives are built from it (request.py)."""

    v: int
    job_id: str
    client_id: str
    enqueued_at: Annotated[float, UNIX_TIME]
    prompt: str | None = None
    messages: list[Message] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    priority: Priority = "normal"
    deadline: Annotated[float | None, UNIX_TIME, NOT_DIGESTED] = None  # past it the job is answered "expired"
    stream: bool = False
    idempotency_key: Annotated[str | None, NOT_DIGESTED] = None
    metadata: Annotated[dict[str, str] | None, Checked(check_metadata, "metadata ")] = None
    model: Annotated[str | None, Checked(check_model_name, "model name {value!r} ")] = None  # None: `default`'s stream
    # who submitted it (the gateway: its API key's tenant); None: a producer that names none
    tenant: Annotated[str | None, Checked(check_tenant_name, "tenant {value!r} "), NOT_DIGESTED] = None
    task: Annotated[Task, NEWER] = "generate"
    # tokenize: the tokenizer's special tokens (BOS...) around a prompt, as tokenizer.encode(prompt,
    # add_special_tokens=...); messages go through the chat template exactly as a generation job's do
    add_special_tokens: Annotated[bool, NEWER] = True
    # messages only (vLLM's): extra variables the chat template reads (Qwen3's enable_thinking...), and whether it
    # ends with the assistant turn's header; the worker renders the template with them (engine.encode_chat)
    chat_template_kwargs: Annotated[dict[str, TemplateValue] | None,
                                    Checked(check_template_kwargs, "chat_template_kwargs "), NEWER] = None
    add_generation_prompt: Annotated[bool, NEWER] = True
    embedding: Embedding | None = None  # task embed: how to pool (None: the defaults); no other task takes it
    tools: Annotated[Tools | None, NEWER] = None  # functions a chat job may call, rendered by the chat template
    # fill-in-the-middle (a prompt job only): the text after the hole; the worker renders prompt and suffix with its
    # model's FIM tokens (engine/fim.py), and answers a model without them with an error result
    suffix: Annotated[str | None, NEWER] = None
    # the W3C trace context the job's spans join (producer/tracing.py; the SDK fills it from the caller's current
    # OpenTelemetry span): how the job is watched, not what it asks
    traceparent: Annotated[str | None, Checked(check_traceparent, "traceparent {value!r} "), NOT_DIGESTED] = None


JOB_FIELDS = specs(Job)


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Timings(msgspec.Struct, omit_defaults=True):
    queued: float = 0.0  # unix seconds for each event
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None


class TopLogprob(msgspec.Struct, array_like=True):
    """One of the most likely tokens at a position. array_like: top-20 logprobs over a long answer add up."""

    id: int
    text: str  # the token as the tokenizer decodes it alone (U+FFFD where it holds part of a character)
    utf8: bytes  # the token's own bytes: a byte-level token can be part of a multi-byte character
    logprob: float


class TokenLogprob(msgspec.Struct, array_like=True):
    """The logprob of one generated token (before penalties, as OpenAI and vLLM report it) and the
    alternatives the job asked for, most likely first."""

    id: int
    text: str
    utf8: bytes
    logprob: float
    top: list[TopLogprob] = []


class Delta(msgspec.Struct, tag="delta", omit_defaults=True):
    """Incremental tokens of a streaming job, in order (`index` counts deltas within one attempt).

    `attempt` is the delivery count of the job entry that produced it: a redelivered job streams again
    from index 0 under a higher attempt, and its text replaces, not extends, the earlier attempt's."""

    v: int
    job_id: str
    index: int
    text: str
    token_ids: list[int]
    attempt: int = 1
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the job asked
    prompt_tokens: int = 0  # on an attempt's first delta: the prompt's length in tokens (streamed usage); else 0
    # a job with tools of choice auto: the format the serving worker reads calls in (tool_calls.PARSERS), so a stream
    # reader parses the text as the worker parses the final
    tool_parser: str | None = None


class Final(msgspec.Struct, tag="final", omit_defaults=True):
    """The one final event of a job; also what `{ns}:result:<job_id>` holds."""

    v: int
    job_id: str
    status: Status
    text: str = ""
    token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    error: str | None = None
    usage: Usage = msgspec.field(default_factory=Usage)
    worker: str | None = None
    timings: Timings = msgspec.field(default_factory=Timings)
    metadata: dict[str, str] | None = None
    attempt: int = 1  # the delivery that produced this result
    model: str | None = None  # the canonical name of the model that served it (None: answered without a model)
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the job asked
    max_model_len: int | None = None  # tokenize: the serving worker's longest prompt plus output, in tokens
    # sampling.prompt_logprobs: one per prompt token; the first, which nothing comes before, has logprob NaN and no
    # alternatives (OpenAI's echo shows null there)
    prompt_logprobs: list[TokenLogprob] | None = None
    # embed: the vector, float32 little-endian (4 bytes a dimension: 4 KiB for 1,024; msgpack bin, no float list)
    embedding: bytes | None = None
    # a job with tools: the calls its text makes, read by the worker (tool_calls.py), and the text outside them
    # (None: only calls). `text` stays the whole answer, as its stream reconstructs it.
    tool_calls: list[ToolCall] | None = None
    content: str | None = None


Event = Delta | Final

_job_decoder = msgspec.msgpack.Decoder(Job)
_event_decoder = msgspec.msgpack.Decoder(Event)
_final_decoder = msgspec.msgpack.Decoder(Final)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: Job | Delta | Final) -> bytes:
    return _encoder.encode(msg)


def _check_size(data: bytes, limit: int = MAX_PAYLOAD_BYTES) -> None:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"payload must be bytes, got {type(data).__name__}")
    if len(data) > limit:
        raise ProtocolError(f"payload is {len(data)} bytes, over the limit of {limit}")


def _check_version(v: int) -> None:
    if not MIN_PROTOCOL_VERSION <= v <= PROTOCOL_VERSION:
        raise ProtocolError(f"unknown protocol version {v}; this build reads versions {MIN_PROTOCOL_VERSION} "
                            f"to {PROTOCOL_VERSION}")


def decode_job(data: bytes) -> Job:
    """Decode and validate a job payload; any defect raises ProtocolError naming it."""
    _check_size(data)
    try:
        job = _job_decoder.decode(data)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"malformed job payload: {e}") from None
    except RecursionError:
        raise ProtocolError("malformed job payload: nested too deeply") from None
    _check_version(job.v)
    try:
        validate_job(job)
    except ProtocolError:
        raise
    except Exception as e:  # total: whatever a check trips on in a producer's job is that job's error, not the worker's
        raise ProtocolError(f"invalid job: {type(e).__name__}: {str(e)[:200]}") from None
    return job


def decode_event(data: bytes) -> Delta | Final:
    _check_size(data, MAX_EVENT_BYTES)
    try:
        event = _event_decoder.decode(data)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"malformed reply event: {e}") from None
    _check_version(event.v)
    return event


def decode_final(data: bytes) -> Final:
    try:
        return _final_decoder.decode(data)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"malformed stored result: {e}") from None


def validate_sampling(s: Sampling) -> None:
    """Range checks shared by the SDK (before enqueueing) and the worker (after decoding), read from Sampling."""
    for spec in SAMPLING_FIELDS:
        if (problem := spec.problem(getattr(s, spec.name))) is not None:
            raise ProtocolError(problem)


def validate_job(job: Job) -> None:
    given = [name for name in ("prompt", "messages", "prompt_token_ids") if getattr(job, name) is not None]
    if len(given) != 1:
        raise ProtocolError(f"a job needs exactly one of prompt, messages, prompt_token_ids; got {given or 'none'}")
    if not job.job_id or len(job.job_id) > 128 or not job.client_id or len(job.client_id) > 128:
        raise ProtocolError("job_id and client_id must be non-empty strings of at most 128 characters")
    if job.prompt is not None and not 0 < len(job.prompt) <= MAX_PROMPT_CHARS:
        raise ProtocolError(f"prompt has {len(job.prompt)} characters; it must have 1 to {MAX_PROMPT_CHARS}")
    if job.messages is not None:
        if not 0 < len(job.messages) <= MAX_MESSAGES:
            raise ProtocolError(f"messages has {len(job.messages)} entries; it must have 1 to {MAX_MESSAGES}")
        if sum(m.size() for m in job.messages) > MAX_PROMPT_CHARS:
            raise ProtocolError(f"messages hold more than {MAX_PROMPT_CHARS} characters")
        for i, m in enumerate(job.messages):
            if (problem := message_problem(m)) is not None:
                raise ProtocolError(f"messages[{i}] {problem}")
    if job.tools is not None:
        if job.messages is None or job.task != "generate":
            raise ProtocolError("tools go with chat messages of a generation job, not a prompt or token ids")
        if (problem := job.tools.problem()) is not None:
            raise ProtocolError(problem)
        if job.tools.choice != "auto" and job.sampling.structured is not None:
            raise ProtocolError(f"tool choice {job.tools.choice} constrains the answer to a call; give it or "
                                "structured, not both")
    if job.suffix is not None:
        if job.prompt is None or job.task != "generate":
            raise ProtocolError("suffix goes with a text prompt of a generation job (fill-in-the-middle), not messages "
                                "or prompt_token_ids")
        if len(job.prompt) + len(job.suffix) > MAX_PROMPT_CHARS:
            raise ProtocolError(f"prompt and suffix hold more than {MAX_PROMPT_CHARS} characters together")
    if job.task == "tokenize" and job.prompt_token_ids is not None:
        raise ProtocolError("a tokenize job takes a prompt or messages, not prompt_token_ids")
    if job.task == "detokenize" and job.prompt_token_ids is None:
        raise ProtocolError("a detokenize job takes prompt_token_ids, not a prompt or messages")
    if job.embedding is not None and job.task != "embed":
        raise ProtocolError(f"embedding settings are for task 'embed', not {job.task!r}")
    if job.prompt_token_ids is not None:
        if not 0 < len(job.prompt_token_ids) <= MAX_PROMPT_CHARS or min(job.prompt_token_ids) < 0:
            raise ProtocolError("prompt_token_ids must be a non-empty list of non-negative token ids")
    if job.messages is None and (job.chat_template_kwargs is not None or not job.add_generation_prompt):
        raise ProtocolError("chat_template_kwargs and add_generation_prompt apply to messages only (the chat "
                            "template); a prompt or prompt_token_ids job takes neither")
    for spec in JOB_FIELDS:  # times, metadata, model, tenant, chat_template_kwargs: their bounds on Job
        if (problem := spec.problem(getattr(job, spec.name))) is not None:
            raise ProtocolError(problem)
    validate_sampling(job.sampling)
    if job.embedding is not None:
        for spec in EMBEDDING_FIELDS:
            if (problem := spec.problem(getattr(job.embedding, spec.name))) is not None:
                raise ProtocolError(problem)


def message_problem(m: Message) -> str | None:
    """What makes a message's tool fields unusable, or None."""
    if m.tool_calls is not None:
        if m.role != "assistant" or len(m.tool_calls) > MAX_TOOL_CALLS:
            return f"tool_calls go on an assistant message, at most {MAX_TOOL_CALLS}; got role {m.role}"
        for c in m.tool_calls:
            if not TOOL_NAME.fullmatch(c.name) or not 0 < len(c.id) <= 128:
                return (f"tool call {c.name[:80]!r} needs a function name of 1 to 64 letters, digits, '_' or '-' and "
                        "an id of 1 to 128 characters")
    if m.tool_call_id is not None and (m.role != "tool" or not 0 < len(m.tool_call_id) <= 128):
        return "tool_call_id goes on a tool message and has 1 to 128 characters"
    if m.name is not None and not 0 < len(m.name) <= 64:
        return "name must have 1 to 64 characters"
    return None


def due_fields(job: Job) -> dict[str, str]:
    """The stream fields a job's entry carries beside its payload: DUE_FIELD where it has a deadline (at least 0 ms)."""
    if job.deadline is None:
        return {}
    return {DUE_FIELD: str(max(0, round((job.deadline - job.enqueued_at) * 1000)))}
