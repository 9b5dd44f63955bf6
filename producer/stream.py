"""What `stream()` yields, and how the text it yields always reconstructs the final result (invariant 7).

A job can be generated more than once: a worker is SIGKILLed, hands the job back on drain, or stalls
(a zombie) and another worker takes the job over. Without a seed and with temperature > 0 each attempt
writes different text. Every Delta carries the attempt (the entry's delivery count) that produced it, so
the SDK keeps one attempt at a time:

- a Delta of a newer attempt ends the current one: `stream()` yields a `Restart`, then the new attempt's
  deltas from its start;
- a Delta of an older attempt (a zombie resuming after its job was taken over) is dropped;
- at the final event, if the result is not a continuation of the current attempt's text (another attempt
  won the race to finish, or deltas were lost), `stream()` yields a `Restart` and the whole result text.

Read as documented, the text is the deltas' texts joined since the last `Restart`, and it always equals
the result's text once the stream ends.
"""
from __future__ import annotations

from dataclasses import dataclass

from .protocol import Delta, Final

@dataclass(slots=True, frozen=True)
class Restart:
    """Throw away the text streamed so far: the deltas after this one start the job's text anew."""

    job_id: str
    attempt: int  # the attempt whose text follows
    reason: str
    text: str = ""  # so code that joins `.text` does not crash; it must still restart at this item
    token_ids: tuple[int, ...] = ()


StreamItem = Delta | Restart


def current_text(items: list) -> tuple[str, list[int], int, int]:
    """The text and token ids streamed since the last Restart, the last delta index and the attempt."""
    text, ids, index, attempt = [], [], -1, 1
    for item in items:
        if isinstance(item, Restart):
            text, ids, index, attempt = [], [], -1, item.attempt
        else:
            text.append(item.text)
            ids += item.token_ids
            index, attempt = item.index, item.attempt
    return "".join(text), ids, index, attempt


def closing_items(items: list, final: Final) -> list:
    """What to yield after the last delta so that the stream's text equals the final text."""
    text, ids, index, attempt = current_text(items)
    continues = final.text.startswith(text) and list(final.token_ids[:len(ids)]) == ids
    if not continues:
        restart = Restart(final.job_id, final.attempt, f"the result (attempt {final.attempt}) is not a continuation "
                          f"of the streamed attempt {attempt}: here is its whole text")
        whole = Delta(v=final.v, job_id=final.job_id, index=0, text=final.text, token_ids=list(final.token_ids),
                      attempt=final.attempt, logprobs=final.logprobs)
        return [restart, whole] if final.text or final.token_ids else [restart]
    if len(final.text) == len(text) and len(final.token_ids) == len(ids):
        return []
    return [Delta(v=final.v, job_id=final.job_id, index=index + 1, text=final.text[len(text):],
                  token_ids=list(final.token_ids[len(ids):]), attempt=attempt,
                  logprobs=None if final.logprobs is None else final.logprobs[len(ids):])]


@dataclass(slots=True)
class AttemptFilter:
    """Per job: which deltas to keep, in arrival order, and where a Restart goes."""

    attempt: int = 0  # the attempt being streamed; 0 before any delta
    last_index: int = -1

    def admit(self, delta: Delta) -> list | None:
        """The items this delta adds to the stream, or None when it adds nothing."""
        attempt = max(1, delta.attempt)
        if attempt < self.attempt:
            return None  # a superseded attempt, e.g. a zombie worker's late deltas
        out: list = []
        if attempt > self.attempt:
            if self.attempt:
                out.append(Restart(delta.job_id, attempt, f"the job was redelivered: attempt {attempt} replaces "
                                   f"attempt {self.attempt}"))
            self.attempt, self.last_index = attempt, -1
        if delta.index <= self.last_index:
            return out or None  # a duplicate within the attempt
        self.last_index = delta.index
        out.append(delta)
        return out
