"""A torch-free engine with the LLMEngine interface whose step time follows a cost model.

It keeps real paged-KV block accounting (allocate on prefill, grow on decode, preempt by recompute
when blocks run out), so admission and preemption behave like the real engine while a step costs
only `step_overhead_s + per_token_s * tokens`. Serves the W-FLEET simulation and fast queue tests.
"""
from __future__ import annotations

import time
import zlib
from collections import deque
from dataclasses import dataclass, field

from kvgate.engine.outputs import Admission, EngineStats, RequestRejected, StepOutput
from kvgate.engine.sampling_params import SamplingParams


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SimulatedTokenizer:
    """Deterministic words -> ids and ids -> ' t<id>' text; enough to count tokens and render output."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [zlib.crc32(word.encode()) % self.vocab_size for word in text.split()]

    def decode(self, ids: list[int]) -> str:
        return "".join(f" t{i}" for i in ids)


@dataclass(slots=True)
class _Seq:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    output: list[int] = field(default_factory=list)
    blocks: int = 0  # KV blocks held
    prefilled: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.output)


class SimulatedEngine:
    def __init__(self, num_blocks: int, block_size: int = 16, max_num_seqs: int = 32, step_overhead_s: float = 0.002,
                 per_token_s: float = 0.0001, seed: int = 0, *, max_model_len: int = 4096,
                 max_num_batched_tokens: int = 8192, vocab_size: int = 32000, model_name: str = "simulated",
                 sleep: bool = True):
        if num_blocks < 1 or block_size < 1 or max_num_seqs < 1:
            raise ValueError("num_blocks, block_size and max_num_seqs must be positive")
        self.num_blocks, self.block_size, self.max_num_seqs = num_blocks, block_size, max_num_seqs
        self.step_overhead_s, self.per_token_s, self.seed = step_overhead_s, per_token_s, seed
        self.max_model_len, self.max_num_batched_tokens = max_model_len, max_num_batched_tokens
        self.model_name, self.sleep = model_name, sleep
        self.tokenizer = SimulatedTokenizer(vocab_size)
        self.free_blocks = num_blocks
        self.running: list[_Seq] = []
        self.waiting: deque[_Seq] = deque()
        self.ids: set[str] = set()
        self.reserve_ratio = 1.0  # share of remaining output tokens reserved; rises on preemption
        self._stats = EngineStats(total_blocks=num_blocks, block_size=block_size)

    # ---- the LLMEngine interface -------------------------------------------------------------
    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode(" ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    arrival_time: float | None = None) -> int:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check(request_id, ids)
        max_tokens = min(params.max_tokens, self.max_model_len - len(ids))
        if self._blocks_for(len(ids) + max_tokens) > self.num_blocks:
            raise RequestRejected(f"request {request_id} needs {self._blocks_for(len(ids) + max_tokens)} KV blocks, "
                                  f"more than the whole cache of {self.num_blocks}")
        self.ids.add(request_id)
        self.waiting.append(_Seq(request_id, ids, params, max_tokens, arrival_time or time.time()))
        return len(ids)

    def abort(self, request_id: str) -> StepOutput | None:
        for seq in [*self.running, *self.waiting]:
            if seq.request_id == request_id:
                self._remove(seq)
                return self._output(seq, [], "abort")
        return None

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def admission(self) -> Admission:
        free_seqs = max(0, self.max_num_seqs - len(self.running) - len(self.waiting))
        spare = self.free_blocks - self._reserved_blocks()
        return Admission(free_seqs, max(0, spare) * self.block_size, self.block_size)

    def fits(self, prompt_len: int, max_tokens: int) -> bool:
        need = self._blocks_for(prompt_len + max(1, int(max_tokens * self.reserve_ratio)))
        return self.admission().free_seqs > 0 and need <= self.free_blocks - self._reserved_blocks()

    @property
    def stats(self) -> EngineStats:
        s = self._stats
        s.running, s.waiting, s.free_blocks = len(self.running), len(self.waiting), self.free_blocks
        s.kv_usage = 1.0 - self.free_blocks / self.num_blocks
        return s

    def step(self) -> list[StepOutput]:
        scheduled, tokens = self._schedule()
        if self.sleep:
            time.sleep(self.step_overhead_s + self.per_token_s * tokens)
        self._stats.steps += 1
        return [out for seq in scheduled if (out := self._advance(seq)) is not None]

    # ---- scheduling and block accounting -----------------------------------------------------
    def _check(self, request_id: str, ids: list[int]) -> None:
        if request_id in self.ids:
            raise RequestRejected(f"duplicate request id {request_id}")
        if not ids:
            raise RequestRejected("empty prompt")
        if len(ids) >= self.max_model_len:
            raise RequestRejected(f"prompt of {len(ids)} tokens is too long for max_model_len={self.max_model_len}")
        bad = next((t for t in ids if not 0 <= t < self.tokenizer.vocab_size), None)
        if bad is not None:  # as the real engine: an id outside the vocabulary would index past the embedding
            raise RequestRejected(f"prompt token id {bad!r} is outside the vocabulary [0, {self.tokenizer.vocab_size})")

    def _blocks_for(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    def _reserved_blocks(self) -> int:
        """Blocks the admitted sequences are expected to still need (the adaptive share of their outputs)."""
        need = 0
        for seq in [*self.running, *self.waiting]:
            expected = seq.num_tokens + int(seq.remaining * self.reserve_ratio)
            need += max(0, self._blocks_for(expected) - seq.blocks)
        return need

    def _schedule(self) -> tuple[list[_Seq], int]:
        """Running sequences first (decode never starves), then waiting ones whose prefill fits."""
        scheduled, tokens = [], 0
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted while making room for an earlier one
            while not self._grow(seq, seq.num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(seq)
                tokens += 1
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if tokens + seq.num_tokens > self.max_num_batched_tokens and scheduled:
                break
            if not self._grow(seq, seq.num_tokens):
                break
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
            tokens += seq.num_tokens
        if not self._stats.preemptions or scheduled:
            self.reserve_ratio = max(0.3, self.reserve_ratio * 0.995)
        return scheduled, tokens

    def _grow(self, seq: _Seq, num_tokens: int) -> bool:
        extra = self._blocks_for(num_tokens) - seq.blocks
        if extra > self.free_blocks:
            return False
        self.free_blocks -= max(0, extra)
        seq.blocks += max(0, extra)
        return True

    def _preempt(self, seq: _Seq) -> None:
        self.running.remove(seq)
        self.free_blocks += seq.blocks
        seq.blocks = 0
        self.waiting.appendleft(seq)
        self._stats.preemptions += 1
        self.reserve_ratio = min(1.0, self.reserve_ratio + 0.2)

    def _remove(self, seq: _Seq) -> None:
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.free_blocks += seq.blocks
        seq.blocks = 0
        self.ids.discard(seq.request_id)

    def _next_token(self, seq: _Seq) -> int:
        key = f"{self.seed}:{seq.request_id if seq.params.seed is None else seq.params.seed}:{len(seq.output)}"
        return zlib.crc32(key.encode() + str(seq.prompt[:8]).encode()) % self.tokenizer.vocab_size

    def _advance(self, seq: _Seq) -> StepOutput | None:
        if not seq.prefilled:
            self._stats.prompt_tokens += len(seq.prompt)
            seq.prefilled = True
        token = self._next_token(seq)
        seq.output.append(token)
        self._stats.generation_tokens += 1
        reason = "stop" if token in seq.params.stop_token_ids else "length" if seq.remaining <= 0 else None
        if reason:
            self._remove(seq)
        return self._output(seq, [token], reason)

    def _output(self, seq: _Seq, new: list[int], reason: str | None) -> StepOutput:
        done = reason is not None
        render = self.tokenizer.decode
        return StepOutput(seq.request_id, new, render(new), done, reason, len(seq.prompt), len(seq.output), 0,
                          token_ids=list(seq.output) if done else None, text=render(seq.output) if done else None)
