"""A batch's `completion_window`: OpenAI takes only "24h"; kvgate takes any whole number of seconds, minutes, hours or
days ("3600s", "90m", "36h", "7d") from 1 hour to 7 days. A fraction ("1.5h") is refused with the whole-number
spelling to use instead ("90m"), so a window means one thing to every reader of the batch object, which keeps the
string as given."""
from __future__ import annotations

import re

from kvgate.producer.quoting import shown

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
MIN_WINDOW_S = 3600
MAX_WINDOW_S = 7 * 86_400
WINDOW = re.compile(r"([0-9]{1,9})([smhd])", re.ASCII)  # 9 digits: past any window taken, short of a slow int()


class BadWindow(ValueError):
    """The message names the value given and the range taken."""


def window_seconds(value: object, min_s: int = MIN_WINDOW_S, max_s: int = MAX_WINDOW_S) -> int:
    """The window's length in seconds; BadWindow for a value not written as a number and a unit, or out of range.
    `min_s`: the shortest window taken (1 hour; shorter only where a test's gateway says so)."""
    span = f"from {spelled(min_s)} to {spelled(max_s)}"
    match = WINDOW.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise BadWindow(f"completion_window={shown(value)} is not a window kvgate takes: give a whole number and a "
                        f"unit s, m, h or d, such as '24h' (OpenAI's only window), '90m' or '7d', {span}")
    seconds = int(match[1]) * UNITS[match[2]]
    if not min_s <= seconds <= max_s:
        raise BadWindow(f"completion_window={value!r} is {spelled(seconds)}, outside the windows kvgate takes: "
                        f"give one {span}, such as '24h'")
    return seconds


def spelled(seconds: int) -> str:
    """The largest unit that writes `seconds` whole: 3600 -> '1h', 5400 -> '90m'."""
    if seconds == 0:
        return "0s"
    for unit, size in sorted(UNITS.items(), key=lambda u: -u[1]):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
