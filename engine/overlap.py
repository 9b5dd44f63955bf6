"""Host and device overlapped (issue 41), as SGLang's overlap scheduler and vLLM's async scheduling do: decode step
N+1 is launched before step N's tokens are read, so the host post-processes step N (stop checks, text, outputs)
and schedules while the device computes N+1.

Step N's sampled tokens stay on the device and feed step N+1's inputs there (ModelRunner.launch). On the host, a
sequence in a launched step holds `PENDING` as its last token until the step is read: its length, its positions and
its KV blocks are right for scheduling the next step, and nothing reads the token's value before then. A sequence
that stops is therefore found one step late: it is already in the step launched next, whose token for it is
dropped (never emitted, counted or streamed), and its blocks are freed then, when it is found. An abort drops a
token still on the device the same way: the output is what was emitted.

The rule, in one place (`Overlap.decode_batch`): a step is launched ahead only when the scheduler's step is
decode-only and no running sequence needs its last token on the host before the next forward: a structured-output
sequence (its grammar masks the next token and may force tokens after it: jump-forward), one with a repetition,
frequency or presence penalty (read from its tokens) and one asking for logprobs (they come back with its token).
Any other step is a sync point: the launched step is read first, and the engine takes its plain step."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from kvgate.engine.config import EngineConfig
from kvgate.engine.outputs import StepOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.scheduler import AllDecode
from kvgate.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from kvgate.engine.llm_engine import LLMEngine

PENDING = -1  # a sequence's last token while it is still on the device: a token id is never negative
RUNNING, FINISHED = SequenceStatus.RUNNING, SequenceStatus.FINISHED


class Launched(Protocol):
    """A step launched ahead: its sequences, and its tokens once the device has them."""
    seqs: list[Sequence]

    def tokens(self) -> list[int]:
        """The sampled tokens, in `seqs`' order; waits for the device."""
        ...


def overlapped(config: EngineConfig, runner: Any) -> bool:
    """Whether an engine over `runner` launches decode steps ahead. "auto": on CUDA, where the GPU computes while
    the host works; off on a CPU, whose forward runs on the cores the host work needs (one thread, the engine's
    own: another one would get an OpenMP pool of its own), so nothing overlaps and a finished sequence would
    cost a wasted row a step."""
    launches = runner.launch_device is not None
    if config.overlap == "on" and not launches:
        raise ValueError(f"overlap='on' needs a runner that launches a decode step ahead (ModelRunner); "
                         f"{type(runner).__name__} does not: set overlap to 'auto' or 'off'")
    if config.overlap == "auto":
        return runner.launch_device == "cuda"
    return config.overlap == "on"


def needs_host(p: SamplingParams) -> bool:
    """Whether a request's every next step needs its last token on the host (the module's rule)."""
    return p.structured is not None or p.logprobs is not None or p.penalized


def drop_pending(seq: Sequence) -> None:
    """Forget seq's token still on the device (it is aborted): never emitted, so never in its output."""
    if seq.token_ids and seq.token_ids[-1] == PENDING:
        seq.token_ids.pop()


class Overlap:
    """The engine's step launched ahead and not yet read (`pending`), and what reads it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.pending: Launched | None = None
        self.launched = 0  # steps launched ahead
        self.host_bound: set[Sequence] = set()  # unfinished requests that need their tokens on the host

    def add(self, seq: Sequence) -> None:
        """A new request: one that needs its tokens on the host keeps every step plain while it runs."""
        if needs_host(seq.params):
            self.host_bound.add(seq)

    def decode_batch(self) -> AllDecode | None:
        """The rule: this step's batch when it may be launched ahead, else None (and nothing scheduled)."""
        if self.host_bound:
            self.host_bound = {seq for seq in self.host_bound if seq.status is not FINISHED}
            if any(seq.status is RUNNING for seq in self.host_bound):
                return None
        return self.engine.scheduler.schedule_decode()

    def step(self) -> tuple[bool, list[StepOutput]]:
        """Launch this step ahead when the rule allows, then read the previous launched step while it runs: (True,
        the previous step's outputs). Where it does not, the launched step is read now: (False, its outputs), and
        the engine takes its plain step."""
        batch = self.decode_batch()
        previous, self.pending = self.pending, None
        if batch is None:
            return False, self.read(previous)
        launched = self.engine.runner.launch(batch)
        outputs = self.read(previous)  # the host's work of step N while the device computes N + 1
        live = [seq for seq in launched.seqs if seq.status is not FINISHED]  # found finished in `previous`: out
        self.engine._computed(live)
        for seq in live:
            seq.token_ids.append(PENDING)
        self.pending, self.launched = launched, self.launched + 1
        return True, outputs

    def read(self, launched: Launched | None) -> list[StepOutput]:
        """A launched step's tokens taken as a plain decode step's are, but for the sequences finished (or aborted)
        since it was launched: their token is dropped."""
        if launched is None:
            return []
        seqs, tokens = [], []
        for seq, token in zip(launched.seqs, launched.tokens()):
            if seq.status is FINISHED:
                continue
            seq.token_ids.pop()  # PENDING, as the launch left it (a sequence preempted since keeps its tokens)
            seqs.append(seq)
            tokens.append(token)
        return self.engine._appended(seqs, tokens, [None] * len(seqs))
