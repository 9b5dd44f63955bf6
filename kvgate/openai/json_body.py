"""Untrusted JSON (request bodies, batch file lines) parsed so that no input can crash a handler: msgspec's decoder,
whose limits turn a hostile document into an error naming the problem instead of an exception nobody expects (the
standard library's parser raises RecursionError for 100,000 nested brackets and ValueError for a 5,000-digit
integer, both of which became 500s)."""
from __future__ import annotations

from typing import Any

import msgspec


class BadJson(ValueError):
    """The text is not JSON we take; the message says why (malformed at which byte, nested too deep, a number
    out of range)."""


def parse_json(data: bytes | str) -> Any:
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError as e:  # malformed, not UTF-8, or a number past what a JSON number may hold here
        raise BadJson(str(e)) from None
    except RecursionError:
        raise BadJson("nested too deeply (arrays or objects inside one another past the parser's depth limit)") from None
