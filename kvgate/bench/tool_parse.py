"""W-TOOLS: what reading an answer for tool calls costs (producer/tool_calls.py), on the worker (one feed: the final)
and on the gateway (a stream's deltas, 4 characters at a time), for 1 MB answers: content with hermes calls among it,
a `required` array of calls, and one 1 MB hermes call. Run: python -m kvgate.bench.tool_parse"""
from __future__ import annotations

import json
import time

from kvgate.producer.tool_calls import Hermes, Required, collect

NAMES = {"get_weather"}


def timed(make, text: str, cut: int, repeats: int = 5) -> tuple[float, int]:
    """The best time of `repeats` reads of `text` in pieces of `cut` characters, and the calls found."""
    best, calls = float("inf"), 0
    for _ in range(repeats):
        parser, pieces, start = make(), [], time.perf_counter()
        for i in range(0, len(text), cut):
            pieces += parser.feed(text[i:i + cut])
        pieces += parser.close()
        best, calls = min(best, time.perf_counter() - start), len(collect(pieces).calls)
    return best, calls


def main() -> None:
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Paris " * 8, "days": list(range(20))}})
    block = "Some text. " * 20 + f"<tool_call>\n{call}\n</tool_call>\n"
    one = json.dumps({"name": "get_weather", "arguments": {"notes": "x" * 1_000_000}})
    cases = [("hermes: content and calls", lambda: Hermes(NAMES), block * (1_000_000 // len(block))),
             ("required: an array of calls", lambda: Required(NAMES),
              "[" + ", ".join([call] * (1_000_000 // (len(call) + 2))) + "]"),
             ("hermes: one 1 MB call", lambda: Hermes(NAMES), f"<tool_call>{one}</tool_call>")]
    print("| answer | MB | calls | one feed (the worker's final) | 4-character deltas (a gateway stream) |")
    print("|---|---|---|---|---|")
    for label, make, text in cases:
        whole, calls = timed(make, text, len(text))
        streamed, _ = timed(make, text, 4)
        print(f"| {label} | {len(text) / 1e6:.2f} | {calls:,} | {whole * 1e3:.0f} ms | {streamed * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
