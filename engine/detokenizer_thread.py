"""A Detokenizer on its own thread, so the engine thread's step never decodes text.

The engine thread hands over each step's outputs with one queue put and takes the text back later (normally a
step later, while it computes the next step). Requests must be added with `LLMEngine.add_request(...,
detokenize=False)`: the engine then emits token ids only, and a stop string found here comes back as a
finished, `stopped` increment, on which the caller aborts the request in the engine. The tokenizer's batch decode
runs in Rust without the GIL, so on a second core it overlaps the step instead of only moving its cost."""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any

from kvgate.engine.detokenizer import Detokenizer, TextDelta
from kvgate.engine.outputs import StepOutput


@dataclass(slots=True)
class StepText:
    """The text of one engine step."""
    stamp: float  # what the caller handed over with the step (the worker: the step's wall-clock time)
    deltas: list[TextDelta]
    outputs: dict[str, StepOutput]  # the step's engine output for each finished delta, by request id


class DetokenizerThread:
    def __init__(self, tokenizer: Any, name: str = "kvgate-detokenizer") -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.submitted = self.returned = 0
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def add(self, request_id: str, stops: list[str] | None, incremental: bool,
            skip_special_tokens: bool = True) -> None:
        self.inbox.put((self.detokenizer.add, (request_id, stops, incremental, skip_special_tokens)))

    def drop(self, request_ids) -> None:
        """Forget requests (aborted, handed back): their later ids, if any, are ignored."""
        for rid in request_ids:
            self.inbox.put((self.detokenizer.drop, (rid,)))

    def submit(self, outputs: list[StepOutput], stamp: float) -> None:
        self.submitted += 1
        self.inbox.put((None, (outputs, stamp)))

    @property
    def in_flight(self) -> int:
        return self.submitted - self.returned

    def results(self, lag: int = 0) -> list[StepText]:
        """The text of the steps decoded so far, in step order, waiting until at most `lag` are still being
        decoded."""
        out = []
        while self.in_flight:
            try:
                item = self.outbox.get(block=self.in_flight > lag, timeout=60)
            except queue.Empty:
                if self.in_flight > lag:
                    raise RuntimeError("the detokenizer thread answered no step in 60 s") from None
                break
            if isinstance(item, BaseException):
                raise RuntimeError(f"the detokenizer thread failed: {item!r}") from item
            self.returned += 1
            out.append(item)
        return out

    def close(self) -> None:
        self.inbox.put(None)
        self.thread.join(timeout=5)

    def _serve(self) -> None:
        while (item := self.inbox.get()) is not None:
            fn, args = item
            if fn is not None:
                fn(*args)
                continue
            outputs, stamp = args
            try:
                deltas = self.detokenizer.step([(o.request_id, o.new_token_ids, o.finished) for o in outputs])
                ends = {d.request_id for d in deltas if d.finished}
                self.outbox.put(StepText(stamp, deltas, {o.request_id: o for o in outputs if o.request_id in ends}))
            except BaseException as e:  # a tokenizer bug must reach the engine thread, not hang it
                self.outbox.put(e)
