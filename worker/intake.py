"""Turning a stream entry into engine input: decode strictly, tokenize, map sampling settings.

Every defect becomes a ValueError whose text names the problem, so the client gets an error result and
the worker keeps serving (invariant 3)."""
from __future__ import annotations

import msgspec

from engine.sampling_params import SamplingParams
from producer.protocol import FIELD, Job, Sampling

FIELD_BYTES = FIELD.encode()


def payload_of(fields: dict | None) -> bytes | None:
    if not fields:
        return None
    return fields.get(FIELD_BYTES, fields.get(FIELD))


def identify(payload: bytes | None) -> tuple[str, str, float] | None:
    """Best-effort (job_id, client_id, enqueued_at) of a payload that failed strict decoding, so its client
    can still be told why; None when there is nobody to answer."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except Exception:
        return None
    if not isinstance(raw, dict):
        return None
    job_id, client_id = raw.get("job_id"), raw.get("client_id")
    ok = all(isinstance(x, str) and 0 < len(x) <= 128 for x in (job_id, client_id))
    queued = raw.get("enqueued_at")
    return (job_id, client_id, float(queued) if isinstance(queued, (int, float)) else 0.0) if ok else None


def sampling_params(s: Sampling) -> SamplingParams:
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
                          stop=list(s.stop), stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
                          seed=s.seed, repetition_penalty=s.repetition_penalty)


def prompt_ids(engine, job: Job) -> list[int]:
    if job.prompt_token_ids is not None:
        return list(job.prompt_token_ids)
    if job.messages is not None:
        return list(engine.encode_chat([{"role": m.role, "content": m.content} for m in job.messages]))
    return list(engine.tokenizer.encode(job.prompt))
