"""Jobs in the engine: starting them, turning each step's outputs into token deltas and one final per job,
stopping them (cancelled, lease lost, publishing refused, drain).

Every engine goes through a detokenizer: one with a tokenizer decodes text on its own thread (a step's text
comes back a step later, while the next one runs); one without (the simulated engine) gets `IdsOnly`, which
passes the ids through at once. So deltas and finals have one path whatever the engine."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvgate.engine.detokenizer import TextDelta
from kvgate.engine.detokenizer_thread import DetokenizerThread, StepText
from kvgate.engine.outputs import RequestRejected, StepOutput
from kvgate.producer.limits import DEFAULT_TENANT
from kvgate.producer.protocol import PROTOCOL_VERSION, Delta, Final, Job, Timings, TokenLogprob, ToolCall, Usage
from kvgate.producer.tool_calls import call_id, parse, parser_for
from kvgate.worker.adapter_reads import AdapterReads
from kvgate.worker.admission import Ticket
from kvgate.worker.engine import Engine
from kvgate.worker.fair import Occupancy
from kvgate.worker.logprobs import TokenRenderer
from kvgate.worker.tokenizer_jobs import Tokenized
from kvgate.worker.tracing import JobTracing, NoTracing


@dataclass(slots=True)
class Flight:
    """A job the engine is running."""

    ticket: Ticket
    admitted_at: float
    first_token_at: float | None = None
    deltas: int = 0
    logprobs: list[TokenLogprob] | None = None  # every token's so far, when the job asked
    undecoded: list[TokenLogprob] = field(default_factory=list)  # rendered, their text not yet decoded
    ending: str | None = None  # cancelled in the engine; the status to answer once its last text is decoded
    prompt_logprobs: list[TokenLogprob] | None = None  # rendered when it finishes, when the job asked
    aside: bool = False  # stepped aside for a fair-share job (Room.make) and not stepped again since


@dataclass(slots=True)
class Ended:
    """A job to answer with its final event: how it ended, with what the engine made of it if it ran."""

    ticket: Ticket
    status: str
    out: StepOutput | None = None
    flight: Flight | None = None
    error: str | None = None
    dead_reason: str = ""
    tokenized: Tokenized | None = None  # a tokenizer job's answer (worker/tokenizer_jobs.py)


@dataclass(slots=True)
class Collected:
    """What one look at the decoded steps gave: deltas for the outbox (client id, delta, request key), in order,
    and the jobs that ended."""

    deltas: list[tuple[str, Delta, str]] = field(default_factory=list)
    ended: list[Ended] = field(default_factory=list)


def final_of(ended: Ended, *, worker: str, model: str, finished_at: float) -> Final:
    """The final event of a job."""
    job, flight, out = ended.ticket.job, ended.flight, ended.out
    timings = Timings(queued=job.enqueued_at, admitted=flight.admitted_at if flight else None,
                      first_token=flight.first_token_at if flight else None, finished=finished_at)
    final = Final(v=PROTOCOL_VERSION, job_id=job.job_id, status=ended.status, error=ended.error, worker=worker,
                  timings=timings, metadata=job.metadata, attempt=ended.ticket.attempt, model=model)
    if out is not None:
        final.text, final.token_ids = out.text or "", list(out.token_ids or [])
        final.finish_reason = out.finish_reason
        final.usage = Usage(out.prompt_tokens, out.output_tokens, out.cached_tokens)
        final.logprobs = flight.logprobs if flight is not None else None
        final.prompt_logprobs = flight.prompt_logprobs if flight is not None else None
        final.embedding = out.embedding
        if job.tools is not None and ended.status == "done":
            final.tool_calls, final.content = tool_calls_of(job, ended.ticket.tool_parser, final.text)
    if (answer := ended.tokenized) is not None:
        final.token_ids, final.text, final.max_model_len = answer.token_ids, answer.text, answer.max_model_len
    return final


def tool_calls_of(job: Job, parser: str | None, text: str) -> tuple[list[ToolCall] | None, str | None]:
    """The calls an answer of a job with tools makes, read as its tool choice says, and its text outside them."""
    tools = job.tools
    try:
        got = parse(parser_for(tools.choice, tools.function, [f.name for f in tools.functions], parser or "",
                               tools.parallel), text)
    except (ValueError, RecursionError):  # a model's text never stops the worker: unreadable calls stay content
        return None, None
    if not got.calls:
        return None, None
    return [ToolCall(call_id(job.job_id, i), name, args) for i, (name, args) in enumerate(got.calls)], got.content


def observe_finished(metrics: Any, final: Final, tenant: str | None = None) -> None:
    """A job's figures, once its final has answered the client; `tenant`: the job's, where it named one."""
    t = final.timings
    tpot = None
    if t.first_token and final.usage.completion_tokens > 1:
        tpot = (t.finished - t.first_token) / (final.usage.completion_tokens - 1)
    metrics.on_finished(final.status, max(0.0, t.finished - t.queued), tpot, final.usage.prompt_tokens,
                        final.usage.completion_tokens, final.usage.cached_tokens, tenant=tenant)


class IdsOnly:
    """The detokenizer of an engine without a tokenizer: each step's ids pass through at once, with no text (a
    job of such an engine cannot ask for stop strings: the engine rejects them). It has the interface of
    `DetokenizerThread`, and like an engine decoding inline its steps are ready as soon as they are submitted."""

    def __init__(self) -> None:
        self.steps: list[StepText] = []

    def add(self, request_id: str, stops: list[str] | None, incremental: bool,
            skip_special_tokens: bool = True) -> None:
        pass  # nothing to keep: the ids of an unknown job are ignored where they are collected

    def drop(self, request_ids) -> None:
        pass

    def submit(self, outputs: list[StepOutput], stamp: float) -> None:
        deltas = [TextDelta(o.request_id, o.new_token_ids, "", o.finished, output_ids=o.token_ids,
                            output_text=o.text or "" if o.finished else None) for o in outputs]
        self.steps.append(StepText(stamp, deltas, {o.request_id: o for o in outputs if o.finished}))

    @property
    def in_flight(self) -> int:
        return len(self.steps)

    def results(self, lag: int = 0) -> list[StepText]:
        steps, self.steps = self.steps, []
        return steps

    def close(self) -> None:
        pass


# a job whose LoRA adapter has no slot here waits this long in the local queue, the jobs behind it passing, before it
# goes to the engine to wait first in line for a slot (so it is never passed for ever)
SLOT_HOLD_S = 1.0


class Flights:
    """The jobs running in the engine, by request key (`stream|entry id`)."""

    def __init__(self, engine: Engine, metrics: Any, tracing: JobTracing | NoTracing | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.tracing = tracing or NoTracing()
        self.running: dict[str, Flight] = {}
        self.renderer = TokenRenderer(engine.tokenizer)
        # Text is decoded on its own thread while the engine steps.
        self.detok = DetokenizerThread(engine.tokenizer) if engine.tokenizer is not None else IdsOnly()
        self.adapter_reads = AdapterReads(engine.loras)  # LoRA adapters read from disk off the loop
        self.immediate = isinstance(self.detok, IdsOnly)

    def __len__(self) -> int:
        return len(self.running)

    def __bool__(self) -> bool:
        return bool(self.running)

    def __contains__(self, key: str) -> bool:
        return key in self.running

    @property
    def decoding(self) -> int:
        """Steps handed over whose text is not collected yet."""
        return self.detok.in_flight

    def tickets(self) -> list[Ticket]:
        return [f.ticket for f in self.running.values()]

    def occupancy(self, band_of: Callable[[str], str], weights: dict[str, float]) -> dict[str, Occupancy]:
        """Jobs running here by band (`band_of` a job's stream) and tenant, shares by the tenants' `weights`; not
        those stepped aside."""
        bands: dict[str, Occupancy] = {}
        for f in self.running.values():
            if not f.aside:
                here = bands.setdefault(band_of(f.ticket.stream), Occupancy(weights=weights))
                here.add(f.ticket.job.tenant or DEFAULT_TENANT, not f.ticket.may_preempt)
        return bands

    def youngest_first(self, tenants: tuple[str, ...], band: str, band_of: Callable[[str], str]) -> list[str]:
        """The running jobs of these tenants in this band, the latest admitted first: who steps aside for a
        fair-share job that waited (the youngest lose the least work to recomputation)."""
        theirs = [f for f in self.running.values() if (f.ticket.job.tenant or DEFAULT_TENANT) in tenants and
                  band_of(f.ticket.stream) == band and f.ending is None and not f.aside and f.ticket.pooling is None]
        return [f.ticket.key for f in sorted(theirs, key=lambda f: f.admitted_at, reverse=True)]

    def stepped_aside(self, keys: list[str]) -> None:
        """These jobs stepped aside (preempted on purpose): not counted as running here until they step again."""
        for key in keys:
            if (flight := self.running.get(key)) is not None:
                flight.aside = True

    def adapter_ready(self, ticket: Ticket) -> bool:
        """Whether the job may go to the engine as far as its LoRA adapter goes: the adapter is in host memory (its
        read started on a thread otherwise: adapter_reads.py), and has a slot now, or the job waited SLOT_HOLD_S here.
        Until then the jobs behind it in the local queue pass it: in the engine a job without a slot waits first in
        line and holds every admission behind it until a slot is idle (an aged adapter's job, read without room)."""
        if ticket.pooling is not None or ticket.lora is None:
            return True
        if not self.adapter_reads.ready(ticket.lora, ticket.lora_path, idle=not self.engine.has_unfinished()):
            return False
        return self.engine.loras.has_room(ticket.lora) or time.monotonic() - ticket.queued_at >= SLOT_HOLD_S

    def start(self, ticket: Ticket, ahead: bool = False) -> Ended | None:
        """Hand the job to the engine (`ahead`: at the head of its waiting queue, room having been made for it);
        an engine refusing it ends it with the reason."""
        try:
            if ticket.pooling is not None:
                self.engine.add_embedding_request(ticket.key, ticket.prompt_ids, ticket.pooling, ahead=ahead)
                self.detok.add(ticket.key, None, incremental=False)
            else:
                if ticket.lora is not None and ticket.lora not in self.engine.loras:  # LoraError: this job's error
                    self.engine.loras.add(ticket.lora, ticket.lora_path)
                adapter = {"lora": ticket.lora} if ticket.lora is not None else {}
                self.engine.add_request(ticket.key, ticket.prompt_ids, ticket.params, detokenize=False, ahead=ahead,
                                        **adapter)
                self.detok.add(ticket.key, ticket.params.stop, incremental=ticket.job.stream,
                               skip_special_tokens=ticket.params.skip_special_tokens)
        except (RequestRejected, ValueError) as e:
            return Ended(ticket, "error", error=f"rejected: {e}")
        now = time.time()
        self.running[ticket.key] = Flight(ticket, now, logprobs=None if ticket.params.logprobs is None else [])
        self.metrics.on_admitted(max(0.0, now - ticket.job.enqueued_at))
        read_at = now - (time.monotonic() - ticket.queued_at) if ticket.queued_at else now
        self.tracing.admitted(ticket.job, ticket.attempt, read_at, now)
        return None

    def submit(self, outputs: list[StepOutput], now: float) -> None:
        """A step's outputs, to be decoded. Logprobs are rendered as the tokens come (the engine's are per step);
        each text delta then takes those of its own tokens, in order."""
        for out in outputs:
            flight = self.running.get(out.request_id)
            if flight is not None:
                flight.aside = False  # it runs again
            if flight is not None and flight.logprobs is not None and out.logprobs:
                flight.undecoded += self.renderer.tokens(out.new_token_ids, out.logprobs,
                                                         flight.ticket.params.logprobs)
        self.detok.submit(outputs, now)

    def collect(self, lag: int) -> Collected:
        """The deltas and finals of the steps decoded so far, waiting until at most `lag` are still decoding."""
        got = Collected()
        for step in self.detok.results(lag):
            for delta in step.deltas:
                flight = self.running.get(delta.request_id)
                if flight is not None:
                    self._collect(flight, delta, step, got)
        return got

    def _collect(self, flight: Flight, d: TextDelta, step: StepText, got: Collected) -> None:
        """What the detokenizer made of a step. A stop string found there ends the job here and the engine drops
        the request; the ids it generated past the stop meanwhile are not part of the result."""
        job = flight.ticket.job
        if d.token_ids and flight.first_token_at is None:
            flight.first_token_at = step.stamp
            self.metrics.on_first_token(step.stamp - flight.admitted_at)
        logprobs = None
        if flight.logprobs is not None:
            logprobs, flight.undecoded = flight.undecoded[:len(d.token_ids)], flight.undecoded[len(d.token_ids):]
            flight.logprobs.extend(logprobs)
        if job.stream and (d.token_ids or d.text):
            delta = Delta(PROTOCOL_VERSION, job.job_id, flight.deltas, d.text, list(d.token_ids),
                          attempt=flight.ticket.attempt, logprobs=logprobs or None,
                          prompt_tokens=0 if flight.deltas else len(flight.ticket.prompt_ids),
                          tool_parser=flight.ticket.tool_parser)
            got.deltas.append((job.client_id, delta, flight.ticket.key))
            flight.deltas += 1
        if not d.finished:
            return
        if flight.logprobs is not None:  # a job that does not stream gets its ids in one piece at the end
            flight.logprobs += flight.undecoded
            del flight.logprobs[len(d.output_ids or ()):]  # none for ids generated past a stop string
        del self.running[d.request_id]
        out = step.outputs[d.request_id]
        if out.finish_reason == "error":  # its structured constraint did not compile, or failed as it generated
            got.ended.append(Ended(flight.ticket, "error", None, flight, error=f"rejected: {out.error}"))
            return
        if d.stopped:
            if not out.finished:
                self.engine.abort(d.request_id)
            status, reason = "done", "stop"
        else:
            reason = out.finish_reason
            status = flight.ending or ("cancelled" if reason == "abort" else "done")
        if out.prompt_logprobs is not None:
            flight.prompt_logprobs = self.renderer.prompt(flight.ticket.prompt_ids, out.prompt_logprobs,
                                                          flight.ticket.params.prompt_logprobs)
        final = StepOutput(d.request_id, [], "", True, reason, out.prompt_tokens, len(d.output_ids or ()),
                           out.cached_tokens, token_ids=d.output_ids, text=d.output_text, embedding=out.embedding)
        got.ended.append(Ended(flight.ticket, status, final, flight))

    def cancel(self, key: str) -> Collected | None:
        """Stop a running job its client cancelled (None: not running here). Its text ends with what the
        detokenizer still holds, so it is answered once that comes: at once where nothing decodes on a thread."""
        flight = self.running.pop(key, None)
        if flight is None:
            return None
        self.running[key] = flight  # last in the order of our jobs (cancel polls, leases), as it always went
        out = self.engine.abort(key)
        if out is not None:
            flight.ending = "cancelled"
            self.detok.submit([out], time.time())
            if self.immediate:
                return self.collect(0)
        return Collected()  # the engine finished it already; its final is being decoded

    def fail(self, key: str) -> Flight | None:
        """Stop a job here for good (its answer is the caller's); None: not running here."""
        flight = self.running.pop(key, None)
        if flight is not None:
            self.engine.abort(key)
            self.detok.drop([key])
        return flight

    def lose(self, keys: set[str]) -> None:
        """Leases lost: these jobs run elsewhere now; stop them and answer nothing."""
        self.detok.drop(keys)
        for key in keys:
            if self.running.pop(key, None) is not None:
                self.engine.abort(key)

    def stop_all(self) -> list[Ticket]:
        """Drain timeout: stop every job; their tickets, to hand back."""
        for key in self.running:
            self.engine.abort(key)
        self.detok.drop(list(self.running))
        tickets = self.tickets()
        self.running.clear()
        return tickets

    def close(self) -> None:
        self.detok.close()
        self.tracing.close()
        self.adapter_reads.close()
