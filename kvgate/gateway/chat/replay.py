"""What a streamed choice may still send after its job restarted (a worker died, a drain handed it back).

An HTTP client cannot take back text it was sent. The new attempt's text is matched against what was sent:
while it repeats that text nothing goes out, once it grows past it only the growth does, so a deterministic
job (greedy, or seeded) streams on seamlessly. An attempt that says something else cannot be mended, and the
choice fails with an error that says so.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvgate.producer import Delta, Restart

from ..errors import ApiError


@dataclass(slots=True)
class Replay:
    sent_text: str = ""
    sent_tokens: int = 0
    text: str = ""  # of the attempt streaming now
    tokens: int = 0

    def take(self, item: Delta | Restart) -> tuple[str, list | None] | None:
        """The text and logprobs of `item` not yet sent, or None when it adds nothing."""
        if isinstance(item, Restart):
            self.text, self.tokens = "", 0
            return None
        before = self.tokens
        self.text += item.text
        self.tokens += len(item.token_ids)
        if not self.text.startswith(self.sent_text):
            if self.sent_text.startswith(self.text):
                return None  # still repeating what the client has
            raise ApiError(502, f"the job restarted (attempt {item.attempt}) after streaming "
                                f"{len(self.sent_text)} characters, and the new attempt's text differs from what "
                                "was sent; retry the request (a seed or temperature 0 makes restarts seamless)",
                           type="server_error", code="stream_restarted")
        text = self.text[len(self.sent_text):]
        logprobs = item.logprobs[max(0, self.sent_tokens - before):] if item.logprobs else None
        self.sent_text, self.sent_tokens = self.text, max(self.sent_tokens, self.tokens)
        return (text, logprobs) if text or logprobs else None
