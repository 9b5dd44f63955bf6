"""Turning a stream entry into engine input: decode strictly, tokenize, map sampling settings.

Every defect becomes a ValueError whose text names the problem, so the client gets an error result and
the worker keeps serving (invariant 3)."""
from __future__ import annotations

from typing import Any

import msgspec

from kvgate.engine.sampling_params import SamplingParams
from kvgate.producer.protocol import FIELD, SAMPLING_FIELDS, Job, Sampling

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


def sampling_params(s: Sampling) -> SamplingParams:
    """The engine's settings for a decoded (and validated) job: every wire sampling field by its name, which the
    engine's SamplingParams shares (tests/producer/test_field_agreement.py)."""
    return SamplingParams(**{spec.name: getattr(s, spec.name) for spec in SAMPLING_FIELDS})


def prompt_ids(engine, job: Job) -> list[int]:
    if job.prompt_token_ids is not None:
        return list(job.prompt_token_ids)
    if job.messages is not None:
        return list(engine.encode_chat([{"role": m.role, "content": m.content} for m in job.messages]))
    return list(engine.tokenizer.encode(job.prompt))
