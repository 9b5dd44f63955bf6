"""Untrusted JSON (request bodies, batch file lines, and the schema text a job carries: a structured output's JSON
schema and a tool's parameters, which every worker and the SDK check) parsed so that no input can crash a handler or
hold it for long: msgspec's decoder, whose limits turn a hostile document into an error naming the problem instead of an
exception nobody expects (the standard library's parser raises RecursionError for 100,000 nested brackets and ValueError
for a 5,000-digit integer, both of which became 500s), behind a budget on what a document may hold.

The budget exists because msgspec holds the GIL for a whole document: its time grows with the values it creates
(5.7 s for 8 MiB of `[]` on a loaded two-core machine, most of it the garbage collector chasing millions of new
lists), so a thread alone does not keep a gateway's event loop free. A document counts its values and its arrays
and objects before it is decoded: at once from its separators when it is small or plainly within the budget, else
by a scan that skips strings (Python-level, so a caller running it in a thread gives the GIL back between steps).
"""
from __future__ import annotations

from typing import Any

import msgspec

# Twice the longest prompt of token ids a job may hold (producer.limits.MAX_PROMPT_CHARS, 512,000): 2^20 numbers
# decode in about 20 ms on a loaded machine.
MAX_VALUES = 1 << 20
# Arrays and objects cost more (the garbage collector tracks each) and every one is walked again by the request's
# checks; 16,384 is far more than a request holds (a message is one object, a prompt one array).
MAX_CONTAINERS = 1 << 14
SMALL = 64 * 1024  # a document this short decodes in about a millisecond whatever it holds: not counted
# Arrays and objects inside one another. msgspec's own limit follows the interpreter's recursion limit, so 5,000 deep
# was refused on 3.11 and decoded on 3.13, where the request's checks (recursive, as the standard library's json is)
# could then fail with a RecursionError; one limit on every Python, far above a chat request's or a schema's depth.
MAX_DEPTH = 256


class BadJson(ValueError):
    """The text is not JSON we take; the message says why (malformed at which byte, nested too deep, a number
    out of range, more values than the budget)."""


def parse_json(data: bytes | str) -> Any:
    """Decode an untrusted document; a document over SMALL bytes is checked against the budget first (which may
    take Python-level time: call this in a thread for large documents)."""
    if len(data) > SMALL:
        check_budget(data.encode() if isinstance(data, str) else data)
    try:
        doc = msgspec.json.decode(data)
    except msgspec.DecodeError as e:  # malformed, not UTF-8, or a number past what a JSON number may hold here
        raise BadJson(str(e)) from None
    except RecursionError:
        raise _too_deep() from None
    _check_depth(doc, data)
    return doc


def _check_depth(doc: Any, data: bytes | str) -> None:
    """BadJson past MAX_DEPTH. Walked without recursion, and only when the document holds more arrays and objects
    than the limit (a prompt of token ids is one array: nothing to walk)."""
    opening = (b"[", b"{") if isinstance(data, bytes) else ("[", "{")
    if data.count(opening[0]) + data.count(opening[1]) <= MAX_DEPTH:
        return
    check_depth(doc)


def check_depth(doc: Any) -> None:
    """BadJson when a decoded document (or a caller's dicts and lists, before they are encoded) nests past MAX_DEPTH,
    walked without recursion: the same answer on every Python, where msgspec's own limit follows the interpreter's
    (a 1,000-deep dict encodes on 3.12 and raises RecursionError on 3.11)."""
    stack = [(doc, 1)] if isinstance(doc, (list, dict)) else []
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _too_deep()
        stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node)
                     if isinstance(child, (list, dict)))


def _too_deep() -> BadJson:
    return BadJson(f"nested too deeply: more than {MAX_DEPTH} arrays or objects inside one another")


def check_budget(data: bytes) -> None:
    """Raise BadJson when the document holds more than MAX_VALUES values or MAX_CONTAINERS arrays and objects.

    A value other than the first follows a `,`, `[` or `:`, so those bytes bound the values; counted over the whole
    document they include those inside strings, so only a document over the budget by that count is scanned again
    with its strings skipped."""
    containers, values = data.count(b"[") + data.count(b"{"), data.count(b",") + data.count(b":")
    if containers <= MAX_CONTAINERS and values + containers <= MAX_VALUES:
        return
    containers = values = at = 0
    for start, end in _strings(data):  # one step per string: a thread running this yields between steps
        containers += data.count(b"[", at, start) + data.count(b"{", at, start)
        values += data.count(b",", at, start) + data.count(b":", at, start)
        _within(containers, values)
        at = end
    containers += data.count(b"[", at) + data.count(b"{", at)
    values += data.count(b",", at) + data.count(b":", at)
    _within(containers, values)


def _strings(data: bytes):
    """(start, end) of each string; bytes.find, not a regular expression: an 8 MiB stretch without one is a memchr,
    where `re` held the GIL for over 100 ms."""
    start = data.find(b'"')
    while start != -1:
        end = data.find(b'"', start + 1)
        while end != -1 and _escaped(data, end):
            end = data.find(b'"', end + 1)
        if end == -1:
            return  # unterminated: the rest is counted as structure, and the decoder names the error
        yield start, end + 1
        start = data.find(b'"', end + 1)


def _escaped(data: bytes, quote: int) -> bool:
    """Whether the quote at `quote` is escaped: an odd run of backslashes before it."""
    at = quote
    while at > 0 and data[at - 1] == 0x5C:
        at -= 1
    return (quote - at) % 2 == 1


def _within(containers: int, values: int) -> None:
    if containers > MAX_CONTAINERS:
        raise BadJson(f"holds more than {MAX_CONTAINERS:,} arrays or objects (a request needs a few); send a "
                      "smaller document")
    if values + containers > MAX_VALUES:
        raise BadJson(f"holds more than {MAX_VALUES:,} values (numbers, strings, arrays, objects); a prompt holds "
                      f"at most 512,000 token ids: send fewer")
