"""Same idempotency key -> the same job: claim the key and enqueue in one atomic script.

The claim stores "job_id digest owner", where owner is a hash of the claiming client's id: any producer may
read a claim whose key it can guess, and the client id itself would name that client's reply stream. One
script both claims and XADDs, so a crash can never leave a claimed key with no job behind it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .errors import IdempotencyConflict

IDEMPOTENCY_TTL_S = 24 * 3600

CLAIM_AND_ENQUEUE = """
local held = redis.call('GET', KEYS[1])
if held then return held end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('XADD', KEYS[2], '*', ARGV[3], ARGV[4])
return false
"""


def owner_tag(client_id: str) -> str:
    """Tells 'my job' from 'another client's job' without revealing the client id (and so its reply stream)."""
    return hashlib.sha256(client_id.encode()).hexdigest()[:32]


@dataclass(slots=True, frozen=True)
class Claim:
    job_id: str
    digest: str
    owner: str  # owner_tag of the client that enqueued the job

    def encode(self) -> str:
        return f"{self.job_id} {self.digest} {self.owner}"

    @classmethod
    def decode(cls, raw: bytes | str) -> "Claim":
        text = raw.decode() if isinstance(raw, bytes) else raw
        job_id, digest, owner = (text.split(" ") + ["", ""])[:3]
        return cls(job_id, digest, owner)


def resolve(key: str, mine: Claim, held: bytes | str | None) -> Claim:
    """The claim that owns the key after the script ran: ours if it was free, else the earlier one."""
    if held is None:
        return mine
    earlier = Claim.decode(held)
    if earlier.digest != mine.digest:
        raise IdempotencyConflict(key, earlier.job_id)
    return earlier
