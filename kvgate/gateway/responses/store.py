"""Stored responses (`store: true`, OpenAI's default) in Redis, so any gateway replica answers GET /v1/responses/{id},
cancel and previous_response_id: `{ns}:response:<response id>`, a JSON record in its job's shard, with a TTL
(--responses-ttl).

A record is written when its job is submitted and again, once, with its final Response body when the job's end is
known: by the replica that waited for it, or by whichever replica is asked next (from the job's result key). It
holds the conversation the job answered (without `instructions`), so a later response continues it honestly: the
same messages, then this answer as the assistant's.
"""
from __future__ import annotations

from typing import Any

import msgspec

from kvgate.producer.keys import Keys


class Record(msgspec.Struct, omit_defaults=True):
    id: str
    job_id: str
    tenant: str
    created_at: float
    model: str
    echo: dict[str, Any]  # what the Response repeats of its request
    conversation: list[dict[str, Any]]  # the messages answered (chat's shape), instructions left out
    stream: str = ""  # the job's stream and entry id: its exact state (queued, running, lost) from any replica
    entry: str = ""
    final: dict[str, Any] | None = None  # the Response body once the job ended
    answer: str | None = None  # its output text, the assistant turn previous_response_id continues with
    inputs: int = 0  # the conversation's last `inputs` messages are the request's own `input` (its input items)

    def input_items(self) -> list[dict[str, Any]]:
        """The request's own `input` as OpenAI's input items, oldest first: messages, an assistant's calls as
        function_call items, a tool's answer as a function_call_output item."""
        own = self.conversation[len(self.conversation) - self.inputs:] if self.inputs else []
        out: list[dict[str, Any]] = []
        for i, m in enumerate(own):
            at = {"id": f"msg_{self.job_id}_{i}", "status": "completed"}
            if m["role"] == "tool":
                out.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]}
                           | at | {"id": f"fco_{self.job_id}_{i}"})
                continue
            if m["content"] or not m.get("tool_calls"):
                part = {"type": "output_text" if m["role"] == "assistant" else "input_text", "text": m["content"]}
                out.append({"type": "message", "role": m["role"],
                            "content": [part | ({"annotations": []} if m["role"] == "assistant" else {})]} | at)
            out += [{"type": "function_call", "id": f"fc_{self.job_id}_{i}_{j}", "call_id": c["id"],
                     "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}
                    for j, c in enumerate(m.get("tool_calls") or ())]
        return out

    def conversation_after(self) -> list[dict[str, Any]]:
        """The messages a response continuing this one starts with: the answer as the assistant's turn, its calls
        (function_call output items) as that turn's tool_calls and its text outside them as its content."""
        output = (self.final or {}).get("output") or []
        calls = [item for item in output if item.get("type") == "function_call"]
        if not calls:
            return [*self.conversation, {"role": "assistant", "content": self.answer or ""}]
        text = "".join(part["text"] for item in output if item.get("type") == "message" for part in item["content"])
        return [*self.conversation, {"role": "assistant", "content": text, "tool_calls": [
            {"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]}]


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Record)


def record_key(keys: Keys, response_id: str, job_id: str) -> str:
    """In the job's shard: a record and its job's result, cancel flag and stream entry share one slot."""
    return f"{keys.at(keys.shard_of(job_id)).prefix}:response:{response_id}"


class ResponseStore:
    def __init__(self, redis: Any, keys: Keys, ttl_s: int):
        self.redis, self.keys, self.ttl_s = redis, keys, ttl_s

    async def put(self, record: Record) -> None:
        await self.redis.set(record_key(self.keys, record.id, record.job_id), _encoder.encode(record), ex=self.ttl_s)

    async def finish(self, record: Record, body: dict[str, Any], answer: str | None) -> None:
        """Record the final body; a record deleted meanwhile stays deleted (XX), its TTL is kept."""
        record.final, record.answer = body, answer
        await self.redis.set(record_key(self.keys, record.id, record.job_id), _encoder.encode(record), xx=True,
                             keepttl=True)

    async def get(self, response_id: str, job_id: str) -> Record | None:
        raw = await self.redis.get(record_key(self.keys, response_id, job_id))
        return None if raw is None else _decoder.decode(raw)

    async def delete(self, record: Record) -> None:
        await self.redis.delete(record_key(self.keys, record.id, record.job_id))
