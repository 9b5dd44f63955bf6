"""How an error (the SDK's, and the gateway's answers) quotes what it refuses: a short prefix of the value and how long
the value was, never the whole of it (issue 45.7: a 7.7 MB body was refused with a 7.7 MB 400 that quoted it back).
`shown` is for the code that quotes a value; `clipped` is the net that every error message and param passes through on
its way out (the gateway's ApiError, a batch's error lines), so a message built anywhere, quoting anything, stays
short."""
from __future__ import annotations

import reprlib

VALUE_CHARS = 80  # of a quoted value
# of a whole message: room for a field, a quoted value, the reason and what to do; the longest message the gateway
# builds on purpose (a schema's problem, a list of declared tools) is well under it
MESSAGE_CHARS = 1000
TAIL_CHARS = 250  # of a clipped message kept from its end, where it says what to do
MARKER_CHARS = 40  # room for the marker of how much was cut, so a clipped text is at most its limit

_BOUNDED = reprlib.Repr()  # builds a container's repr from a bounded part of it, however large or deep it is
_BOUNDED.maxlevel, _BOUNDED.maxstring, _BOUNDED.maxother, _BOUNDED.maxlong = 3, VALUE_CHARS - 3, VALUE_CHARS - 3, 40
_BOUNDED.maxlist = _BOUNDED.maxtuple = _BOUNDED.maxdict = _BOUNDED.maxset = 8


def shown(value: object, limit: int = VALUE_CHARS) -> str:
    """repr(value) when short; else its first `limit` characters and how long the value is."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value):,} characters)"
    try:
        text = _BOUNDED.repr(value)
    except Exception:  # a caller's object whose __repr__ fails: its type names it
        return f"<{type(value).__name__}>"
    if isinstance(value, (list, tuple, dict)) and len(value) > _BOUNDED.maxlist:
        text += f" ({len(value):,} items)"
    return text if len(text) <= 2 * limit else clipped(text, 2 * limit)


def clipped(text: str, limit: int = MESSAGE_CHARS) -> str:
    """`text` when at most `limit` characters; else its start and end around a marker of how much was cut."""
    if len(text) <= limit:
        return text
    tail = min(TAIL_CHARS, limit // 4)
    head = limit - tail - MARKER_CHARS
    return f"{text[:head]}...({len(text) - head - tail:,} characters cut)...{text[-tail:]}"
