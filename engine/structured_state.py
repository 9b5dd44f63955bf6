"""Structured output's part of the engine, in one object: a constrained request waits here, holding no KV block,
while its grammar compiles off the engine thread; once it runs, its matcher takes each sampled token, the tokens the
grammar forces next join the sequence at once (jump-forward), and a matcher the grammar engine put in error ends the
request with an error naming the grammar engine's message.

The engine reaches it through `start`/`compiled` (the wait) and `advance`/`error` (generation); the sampler masks
with the same matchers through its own `start_mask`/`mask`. A preemption recomputes a sequence's tokens and keeps
them, so its matcher, which has consumed exactly those, stays valid: nothing is rolled back."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from kvgate.engine.config import EngineConfig
from kvgate.engine.constraints import GrammarError, Grammars, forced_tokens, matcher_error
from kvgate.engine.outputs import StepOutput
from kvgate.engine.sequence import Sequence, SequenceStatus


class StructuredRequests:
    """The engine's structured-output requests: those waiting for their grammar, and the matchers of those running
    (each on its sequence, `seq.matcher`, where the sampler reads it)."""

    def __init__(self, runner: Any, config: EngineConfig) -> None:
        self.grammars = Grammars(runner.tokenizer, runner.vocab_size, runner.eos_token_ids,
                                 threads=config.grammar_threads, timeout_s=config.grammar_compile_timeout_s)
        self.config = config  # read at each token, not copied: jump_forward may be switched on a live engine
        self.compiling: dict[Sequence, Future] = {}  # sequence -> the future of its compiled grammar

    def __len__(self) -> int:
        """Requests waiting for their grammar: each holds its seat already."""
        return len(self.compiling)

    def start(self, seq: Sequence) -> bool:
        """Compile seq's constraint: True when its matcher is ready now (the scheduler takes it at once), False when
        it waits here until `compiled` hands it over, or answers it with the compile's error. A constraint that fails
        is answered there whether its compile failed before this call returned (known bad from an earlier request,
        or a compile thread quicker than this one) or after: which one came first is the threads' timing, and a
        request's answer must not depend on it (it was a RequestRejected from add_request in the first case)."""
        future = self.grammars.compile(seq.params.structured)
        try:
            seq.matcher = self.grammars.ready(future)
        except GrammarError:
            seq.matcher = None
        if seq.matcher is None:
            self.compiling[seq] = future
        return seq.matcher is not None

    def compiled(self) -> tuple[list[Sequence], list[StepOutput]]:
        """The waiting requests whose grammar is now compiled, for the scheduler, and the final outputs of those whose
        compile failed (finish_reason "error", naming the problem); both leave the wait."""
        ready, failed = [], []
        for seq, future in list(self.compiling.items()):
            try:
                seq.matcher = self.grammars.ready(future)
            except GrammarError as e:
                del self.compiling[seq]
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
                failed.append(StepOutput(seq.request_id, [], "", True, "error", seq.num_prompt_tokens, 0, 0,
                                         token_ids=[], text="", error=str(e)))
                continue
            if seq.matcher is not None:
                del self.compiling[seq]
                ready.append(seq)
        return ready, failed

    def abort(self, seq: Sequence) -> bool:
        """Finish seq ("abort") if it still waits for its grammar (it was never scheduled); whether it did."""
        if self.compiling.pop(seq, None) is None:
            return False
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        return True

    def advance(self, seq: Sequence, token: int) -> tuple[list[int], str | None]:
        """`token`, just appended to `seq` (its mask allowed it, so the grammar accepts it), goes through its matcher;
        with jump-forward the tokens the grammar forces next are appended too (not with logprobs: a forced token has
        none), for the next step to compute with the token after them. The tokens added, `token` first, and why the
        sequence ends with them: "stop" as soon as the grammar is complete (no step spent drawing its EOS)."""
        matcher, new_ids = seq.matcher, [token]
        matcher.consume_token(token)
        reason = "stop" if matcher.is_stopped() else seq.stop_reason(token)
        if reason is None and self.config.jump_forward and seq.params.logprobs is None:
            forced = forced_tokens(matcher, seq.remaining_tokens)
            for k, forced_token in enumerate(forced):
                seq.token_ids.append(forced_token)
                new_ids.append(forced_token)
                # the matcher has consumed them all, so it may be complete (stopped) before the last is appended
                last = k == len(forced) - 1
                if reason := "stop" if last and matcher.is_stopped() else seq.stop_reason(forced_token):
                    break
        if matcher.is_error():
            # the grammar engine gave up (its parser limits, while it masked or consumed): it no longer vouches for
            # the output. Its matcher reads as stopped and its mask allows only EOS, so this overrides that "stop"
            reason = "error"
        return new_ids, reason

    @staticmethod
    def error(seq: Sequence) -> str | None:
        """A finished sequence's error: its matcher's, where the grammar engine ended it ("error") as it generated."""
        if seq.finish_reason != "error":
            return None
        return matcher_error(seq.matcher, seq.params.structured, seq.num_output_tokens)
