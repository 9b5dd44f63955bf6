"""Turning a stream entry into engine input: decode strictly, tokenize, map sampling settings.

Every defect becomes a rejection whose text names the problem, so the client gets an error result and
the worker keeps serving (invariant 3)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvgate.engine.pooling_params import PoolingParams
from kvgate.engine.constraints import StructuredOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.producer.limits import MAX_STRUCTURED_CHARS
from kvgate.producer.protocol import FIELD, SAMPLING_FIELDS, Job, ProtocolError, Sampling, decode_job
from kvgate.worker.admission import Ticket
from kvgate.worker.affinity import Affinity
from kvgate.worker.clock import ServerClock
from kvgate.worker.engine import Engine
from kvgate.worker.lane_prefixes import LanePrefixes
from kvgate.worker.read_reply import Entry
from kvgate.worker.tokenizer_jobs import Tokenized, answer
from kvgate.worker.tool_prompt import ToolPrompts, required_constraint

FIELD_BYTES = FIELD.encode()


def payload_of(fields: dict | None) -> bytes | None:
    if not fields:
        return None
    return fields.get(FIELD_BYTES, fields.get(FIELD))


class _Ident(msgspec.Struct):
    """Only the fields needed to answer; the rest of the payload is skipped, not validated (an invalid UTF-8
    prompt or a wrong type elsewhere must not hide who to tell)."""

    job_id: str
    client_id: str
    enqueued_at: Any = 0.0  # a mistyped timestamp must not hide who to tell either


def identify(payload: bytes | None) -> tuple[str, str, float] | None:
    """Best-effort (job_id, client_id, enqueued_at) of a payload that failed strict decoding, so its client
    can still be told why; None when there is nobody to answer."""
    try:
        ident = msgspec.msgpack.decode(payload, type=_Ident)
    except Exception:  # not a map, those fields missing or mistyped, nesting too deep: nobody to answer
        return None
    ok = all(0 < len(x) <= 128 for x in (ident.job_id, ident.client_id))
    queued = ident.enqueued_at
    queued = float(queued) if isinstance(queued, (int, float)) and queued == queued else 0.0  # NaN -> unknown
    return (ident.job_id, ident.client_id, queued) if ok else None


def _undecodable(payload: bytes | None, error: Exception) -> str:
    if payload is None:
        return "entry has no payload (deleted or malformed stream fields)"
    if isinstance(error, ProtocolError):
        return str(error)
    return f"malformed job payload: {type(error).__name__}: {str(error)[:200]}"


def sampling_params(s: Sampling) -> SamplingParams:
    """The engine's settings for a decoded (and validated) job: every wire sampling field by its name, which the
    engine's SamplingParams shares (tests/producer/test_field_agreement.py)."""
    return SamplingParams(**{spec.name: getattr(s, spec.name) for spec in SAMPLING_FIELDS})


def prompt_ids(engine, job: Job) -> list[int]:
    if job.prompt_token_ids is not None:
        return list(job.prompt_token_ids)
    if job.messages is not None:
        return list(engine.encode_chat([{"role": m.role, "content": m.content} for m in job.messages],
                                       job.add_generation_prompt, job.chat_template_kwargs))
    if job.suffix is not None:
        return list(engine.encode_fim(job.prompt, job.suffix))
    return list(engine.tokenizer.encode(job.prompt))


def pooling_params(job: Job) -> PoolingParams:
    """The engine's settings for an embedding job's (decoded, validated) wire settings."""
    e = job.embedding
    return PoolingParams() if e is None else PoolingParams(e.pooling, e.normalize, e.dimensions)


@dataclass(slots=True)
class Rejection:
    """An entry answered at once instead of run: the status and the error to answer with, or (status done) a
    tokenizer job's answer."""

    stream: str
    entry_id: str
    status: str  # error, expired or cancelled
    error: str
    ticket: Ticket | None = None  # None: the payload did not decode; whoever `identify` finds in it is told
    payload: bytes | None = None
    dead_reason: str = ""  # also dead-lettered, with this reason
    dead_label: str = "invalid"  # the dead letter's metric label when the payload is not decoded (ticket None)
    tokenized: Tokenized | None = None


@dataclass(slots=True)
class Intake:
    """Stream entries -> tickets ready for the engine, and rejections for those that can never run."""

    engine: Engine
    clock: ServerClock
    affinity: Affinity
    lane_prefixes: LanePrefixes
    max_deliveries: int
    metrics: Any
    embeddings: str = "on"  # on | off | only (worker settings)
    tool_call_parser: str = "auto"  # the format `auto` tool calls are read in; auto: the chat template's
    adapters: Any = None  # worker/adapters.py: which LoRA adapter a job's model names; None: no adapters
    tool_prompts: ToolPrompts = field(init=False)

    def __post_init__(self) -> None:
        self.tool_prompts = ToolPrompts(self.engine, self.tool_call_parser)

    def tickets(self, entries: list[Entry]) -> tuple[list[Ticket], list[Rejection]]:
        tickets, rejections = [], []
        for e in entries:
            got = self._ticket(e)
            (tickets if isinstance(got, Ticket) else rejections).append(got)
        return tickets, rejections

    def _ticket(self, e: Entry) -> Ticket | Rejection:
        payload = payload_of(e.fields)
        if e.deliveries > 1:
            self.metrics.on_redelivery()
        if e.deliveries > self.max_deliveries:
            # Before decoding: Redis counted this delivery when it handed the entry over, so an entry whose decoding
            # ever took a worker down is dead-lettered here, undecoded, instead of taking down every worker it reaches.
            reason = f"delivered {e.deliveries} times, over max_deliveries={self.max_deliveries}"
            return Rejection(e.stream, e.entry_id, "error", reason, payload=payload, dead_reason=reason,
                             dead_label="max_deliveries")
        try:
            job = decode_job(payload)
        except Exception as error:  # ProtocolError names the defect; anything else is still this entry's, not ours
            reason = _undecodable(payload, error)
            return Rejection(e.stream, e.entry_id, "error", reason, payload=payload, dead_reason=reason)
        ticket = Ticket(job, e.stream, e.entry_id, [], None, payload, attempt=max(1, e.deliveries),
                        may_preempt=e.may_preempt)
        if self.clock.expired(job, e.entry_id):
            return Rejection(e.stream, e.entry_id, "expired", "deadline passed before the job started", ticket)
        if self.adapters is not None:
            ticket.lora, removed = self.adapters.of_job(job.model)
            if removed is not None:
                return Rejection(e.stream, e.entry_id, "error", removed, ticket)
            ticket.lora_path = self.adapters.paths.get(ticket.lora)
        if job.task in ("tokenize", "detokenize"):
            return self._tokenizer_answer(e, ticket)
        if (refusal := self._refusal(job.task)) is not None:
            return Rejection(e.stream, e.entry_id, "error", refusal, ticket)
        try:
            ticket.params = sampling_params(job.sampling)
            if job.tools is not None or any(m.tool_calls or m.role == "tool" for m in job.messages or ()):
                self._tool_use(ticket)
            else:
                ticket.prompt_ids = prompt_ids(self.engine, job)
            if job.task == "embed":
                ticket.pooling = pooling_params(job)
                return ticket  # an embedding neither reads nor fills the prefix cache: nothing shared, no lane prefix
            self._clamp_budget(ticket)
            if ticket.params.prompt_logprobs is None:  # one asking for them shares no cached prefix
                ticket.shared = self.engine.shared_prefix_tokens(ticket.prompt_ids, ticket.hashes)  # sizes reads
            if (lane := self.affinity.lane_of(e.stream)) is not None:
                self.lane_prefixes.observe(lane, ticket.prompt_ids, ticket.tokens)
        except Exception as error:  # a tokenizer or chat template refusing this input is bad input, not a crash
            return Rejection(e.stream, e.entry_id, "error", f"invalid job: {error}", ticket)
        return ticket

    def _refusal(self, task: str) -> str | None:
        """Why this worker does not run a job of this task, or None."""
        if task == "embed" and self.embeddings == "off":
            return f"rejected: model {self.engine.model_name!r} is not served for embeddings (worker --embeddings off)"
        if task == "generate" and self.embeddings == "only":
            return (f"rejected: model {self.engine.model_name!r} is served for embeddings only (worker --embeddings "
                    "only): send embedding jobs, or generation jobs to a model served for them")
        return None

    def _tool_use(self, ticket: Ticket) -> None:
        """A chat job with tools (or a history of calls): its prompt with the tools rendered, the constraint of a
        required or named call, and the parser an `auto` answer is read with."""
        job = ticket.job
        ticket.prompt_ids = self.tool_prompts.prompt_ids(job)
        if job.tools is None:
            return
        ticket.tool_parser = self.tool_prompts.parser() if job.tools.choice == "auto" else None
        if (constraint := required_constraint(job.tools)) is not None:
            if (problem := constraint.problem(2 * MAX_STRUCTURED_CHARS)) is not None:
                raise ValueError(problem)
            ticket.params.structured = StructuredOutput.of(constraint)

    def _tokenizer_answer(self, e: Entry, ticket: Ticket) -> Rejection:
        try:
            return Rejection(e.stream, e.entry_id, "done", "", ticket,
                             tokenized=answer(self.engine, ticket.job, self.tool_prompts.prompt_ids))
        except Exception as error:  # as for a generation job: bad input, not a crash
            return Rejection(e.stream, e.entry_id, "error", f"invalid job: {ticket.job.task}: {error}", ticket)

    def _clamp_budget(self, ticket: Ticket) -> None:
        """The budget is clamped here, once, by the engine's own rule (output_budget): a max_tokens beyond
        max_model_len (1,000,000) would only skew the admission estimate and the fit check. A prompt with no room
        left keeps 1, so that add_request rejects it naming its length."""
        ticket.params.max_tokens = max(1, self.engine.output_budget(len(ticket.prompt_ids), ticket.params.max_tokens))
