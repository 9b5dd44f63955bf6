"""Prefix-affinity lanes: which lane a job goes to, and which live worker owns each lane.

Producers and workers must compute the same answers, so these are pure functions of their arguments (no process
state, no salted `hash()`), shared by the SDK and the worker (tests/test_layering.py lets the worker import this
module besides protocol.py).

The routing key is the caller's `prefix_key` when given; otherwise a digest of the leading part of the prompt:
the first ROUTING_TOKENS token ids, or the first ROUTING_CHARS characters of the text (the SDK has no tokenizer;
at about four characters a token that is the same ~128 tokens). A prefix cache pays off only for long shared
prefixes, which almost always start with a system prompt, a document or a chat's first turns, so the window
sits inside them. Shorter shared prefixes (under ~8 KV blocks) scatter, and save little prefill anyway; longer
prefixes that agree on their first 512 characters share a lane and those blocks.

Ownership is weighted rendezvous hashing over the live workers: lane L belongs to the worker with the highest
score w / -ln(u(worker, L)), so a worker's share of lanes follows its weight (its KV blocks), and a join or
leave moves only the lanes the newcomer wins or the leaver held.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence

from .protocol import Message

ROUTING_CHARS = 512
ROUTING_TOKENS = 128
MAX_LANES = 1024
LANES_TTL_MS = 10_000  # a member missing from the lane ring this long has left it


def digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def routing_key(*, prompt: str | None = None, messages: Sequence[Message] | None = None,
                prompt_token_ids: Sequence[int] | None = None, prefix_key: str | None = None) -> str:
    """The key a job routes by: the explicit `prefix_key`, else the leading part of the prompt (see above)."""
    if prefix_key:
        return "k:" + prefix_key
    if prompt_token_ids is not None:
        return "t:" + ",".join(map(str, prompt_token_ids[:ROUTING_TOKENS]))
    if messages is not None:
        text = "".join(f"{m.role}\x00{m.content}\x00" for m in messages)
        return "m:" + text[:ROUTING_CHARS]
    return "p:" + (prompt or "")[:ROUTING_CHARS]


def lane_of(key: str, lanes: int) -> int:
    return digest(key.encode()) % lanes


def _score(member: str, weight: float, lane: int) -> float:
    u = (digest(f"{member}\x00{lane}".encode()) + 1) / (2**64 + 1)  # in (0, 1)
    return weight / -math.log(u)


def owners(members: dict[str, float], lanes: int) -> list[str | None]:
    """The owner of every lane: weighted rendezvous over `members` (worker id -> weight)."""
    if not members:
        return [None] * lanes
    return [max(members, key=lambda m: (_score(m, members[m], lane), m)) for lane in range(lanes)]


def owned(members: dict[str, float], me: str, lanes: int) -> list[int]:
    return [lane for lane, owner in enumerate(owners(members, lanes)) if owner == me]


def read_order(own: Iterable[int], lanes: int) -> list[int]:
    """Own lanes first, then the others: the others are read only when ours came back short (stealing)."""
    mine = sorted(set(own))
    return mine + [lane for lane in range(lanes) if lane not in set(mine)]


def check_lanes(lanes: int) -> int:
    if not 1 <= lanes <= MAX_LANES:
        raise ValueError(f"lanes={lanes} must be between 1 and {MAX_LANES}")
    return lanes


def parse_lanes(raw) -> int:
    """The stored count of `{ns}:lanes`; anything else (absent, garbage, out of range) means no lanes."""
    if raw is None:
        return 0
    try:
        lanes = int(raw.decode() if isinstance(raw, bytes) else str(raw))
    except (ValueError, UnicodeDecodeError):
        return 0
    return lanes if 1 <= lanes <= MAX_LANES else 0


def encode_member(worker_id: str, weight: float) -> str:
    return f"{weight:g}|{worker_id}"


def decode_members(raw: Iterable) -> dict[str, float]:
    """`weight|worker_id` members of the lane ring; malformed ones are skipped, not fatal."""
    out: dict[str, float] = {}
    for item in raw:
        text = item.decode() if isinstance(item, bytes) else str(item)
        weight, _, worker_id = text.partition("|")
        try:
            w = float(weight)
        except ValueError:
            continue
        if worker_id and math.isfinite(w) and w > 0:
            out[worker_id] = w
    return out
