"""Iteration-level scheduling: each step decides which sequences run and how many tokens each computes.

Continuous: running sequences first (decodes before prefill chunks, so decode never starves), then new ones
from the waiting queue while the token budget, the sequence cap and free blocks allow. When blocks run out
the newest running sequence is preempted by recompute (its blocks freed; the prefix cache usually keeps them).
`step_aside` preempts chosen sequences on purpose, to start a request put at the head of the waiting queue now
(fair share's newcomer, engine.make_room); it is not a shortage, so it is counted apart.
Static: the baseline; a batch is filled only when the previous one has completely finished.
LoRA: a sequence starts only when its adapter has a device slot (engine/lora_slots.py says when); otherwise it waits
at the head of the queue, as for blocks. Starting pins the adapter; finishing or preemption unpins it."""
from __future__ import annotations

from collections import deque

from kvgate.engine.block_manager import BlockManager
from kvgate.engine.lora_slots import LoraSlots
from kvgate.engine.sequence import Sequence, SequenceStatus

ScheduledBatch = list[tuple[Sequence, int]]  # (sequence, number of new tokens to compute this step)


class AllDecode(list):
    """A ScheduledBatch in which every sequence computes exactly its last token; `seqs` lists them in order, so
    a runner need not check."""
    seqs: list[Sequence]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "continuous", loras: LoraSlots | None = None) -> None:
        self.block_manager = block_manager
        self.loras = loras if loras is not None else LoraSlots(0, 0)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_stepped_aside = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.pooling = 0  # embedding requests running: while any is, no step takes the all-decode path

    def add(self, seq: Sequence) -> None:
        """Queue a sequence: at the end of the waiting queue, or at its head when room was made for it."""
        seq.status = SequenceStatus.WAITING
        self.loras.enqueue(seq)
        if seq.ahead:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = self.schedule_decode()
        if batch is not None:
            return batch
        budget = self.max_num_batched_tokens
        if self.policy == "static" and not self.running:
            while self.waiting and len(self.running) < self.max_num_seqs and self.loras.can_acquire(self.waiting[0]):
                self._start(self.waiting.popleft())
        scheduled, budget, preempted = self._schedule_running(budget)
        if self.policy == "continuous" and not preempted:
            budget = self._admit(scheduled, budget)
        return list(scheduled.items())

    def schedule_decode(self) -> AllDecode | None:
        """The step `schedule` takes when it can: every running sequence decodes one token (none waits to be
        admitted, none is short of a block). None, with nothing changed, when this step must take the general path."""
        admits = self.policy == "continuous" and self.waiting and len(self.running) < self.max_num_seqs
        return self._decode_all() if self.running and not admits else None

    def _decode_all(self) -> AllDecode | None:
        """The common step, without the general path's per-sequence bookkeeping: every running sequence decodes
        one token and the free blocks cover those that need a new one. None when that is not the case."""
        running, bm = self.running, self.block_manager
        if len(running) > self.max_num_batched_tokens or self.pooling:
            return None
        bs, need = bm.block_size, []
        for seq in running:
            num_tokens = len(seq.token_ids)
            if num_tokens - seq.num_computed_tokens != 1:
                return None
            if len(seq.block_table) * bs < num_tokens:
                need.append(seq)
        if len(need) > bm.num_free:
            return None
        for seq in need:
            bm.append(seq, len(seq.token_ids))
        batch = AllDecode((seq, 1) for seq in running)
        batch.seqs = list(running)
        return batch

    def _schedule_running(self, budget: int) -> tuple[dict[Sequence, int], int, bool]:
        scheduled: dict[Sequence, int] = {}
        preempted = False
        for seq in sorted(self.running, key=lambda s: s.is_prefilling):  # stable: decodes first
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._grow(seq, budget)
            while n is None:
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                budget += scheduled.pop(victim, 0)
                if victim is seq:
                    break
                n = self._grow(seq, budget)
            if n:
                scheduled[seq] = n
                budget -= n
        return scheduled, budget, preempted

    def _admit(self, scheduled: dict[Sequence, int], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.loras.can_acquire(seq):
                break  # its adapter has no slot: it waits, first in line
            n = self._grow(seq, budget)
            if n is None:
                break
            self.waiting.popleft()
            self._start(seq)
            scheduled[seq] = n
            budget -= n
        return budget

    def _start(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.loras.acquire(seq)
        self.running.append(seq)
        self.pooling += seq.pooling is not None

    def _grow(self, seq: Sequence, budget: int) -> int | None:
        """Reserve blocks for this sequence's next chunk; the chunk size, or None when blocks are short."""
        bm = self.block_manager
        if not seq.block_table:
            hits = bm.match_prefix(seq) if seq.pooling is None else []  # an embedding needs every token computed
            start = len(hits) * bm.block_size
            n = min(seq.num_tokens - start, budget)
            if not bm.can_allocate(hits, start + n):
                return None
            bm.allocate(seq, hits, start + n)
            if not seq.admitted:  # count real prompts once, not recomputation after preemption
                seq.admitted = True
                seq.num_cached_tokens = start
                self.prefix_hit_tokens += start
                self.prefix_query_tokens += seq.num_tokens
            return n
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if not bm.can_append(seq, seq.num_computed_tokens + n):
            return None
        bm.append(seq, seq.num_computed_tokens + n)
        return n

    def preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        self.num_preemptions += 1

    def step_aside(self, seq: Sequence) -> None:
        """Preempt on purpose (not for lack of blocks): it resumes first once room frees."""
        self._requeue(seq)
        seq.stepped_aside += 1
        self.num_stepped_aside += 1

    def _requeue(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pooling -= seq.pooling is not None
        self.loras.release(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (finished or aborted) wherever it is and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.pooling -= seq.pooling is not None
            self.loras.release(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if seq.status is not SequenceStatus.FINISHED:
            self.loras.dequeue(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
