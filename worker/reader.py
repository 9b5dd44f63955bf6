"""Reading new jobs in priority order in one round trip.

Separate XREADGROUP calls per priority cost up to three round trips per look, most of them on empty
streams; a script reads high, then normal, then low, until `count` entries are taken, and never more.
"""
from __future__ import annotations

from dataclasses import dataclass

import redis

from kvgate.producer.protocol import Keys

# KEYS: job streams, highest priority first; ARGV: group, consumer, count
READ_LUA = """
local want = tonumber(ARGV[3])
local out = {}
for _, key in ipairs(KEYS) do
  if want <= 0 then break end
  local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', want, 'STREAMS', key, '>')
  if reply then
    local entries = reply[1][2]
    want = want - #entries
    table.insert(out, {key, entries})
  end
end
return out
"""


@dataclass(slots=True)
class Reader:
    client: redis.Redis
    consumer: str
    streams: list[str]
    script: object = None

    def __post_init__(self) -> None:
        self.script = self.client.register_script(READ_LUA)

    def read(self, count: int, pipe=None) -> list[tuple[str, str, dict]] | None:
        """Up to `count` new entries, all of a higher priority before any of a lower one. With `pipe`, only
        queue the read there and hand its reply to `parse` later."""
        reply = self.script(keys=self.streams, args=[Keys.GROUP, self.consumer, count], client=pipe or self.client)
        return None if pipe is not None else self.parse(reply)

    @staticmethod
    def parse(reply) -> list[tuple[str, str, dict]]:
        return [(as_str(stream), as_str(entry_id), _pairs(fields)) for stream, entries in reply for entry_id, fields in entries]


def _pairs(flat: list) -> dict:
    return dict(zip(flat[::2], flat[1::2]))


def as_str(value) -> str:
    """Redis replies are bytes unless the client decodes them."""
    return value.decode() if isinstance(value, bytes) else str(value)
