"""The engine the worker drives: add_request, step, abort, and the admission question (how many more tokens
can come in now without expecting a preemption).

The engine schedules, accounts KV blocks, caches prefixes and admits; its runner computes the scheduled tokens:
the torch ModelRunner for a real model, a CostModelRunner for the simulated fleet. Torch loads only when a
ModelRunner is built, so everything here imports without it."""
from __future__ import annotations

import gc
import math
import time
from typing import Any

from kvgate.engine.block_manager import BlockManager
from kvgate.engine.config import EngineConfig
from kvgate.engine.detokenizer import find_stop, held_back, take_increment
from kvgate.engine.fim import FimFormat
from kvgate.engine.lora_slots import LoraSlots
from kvgate.engine.outputs import Admission, EngineStats, RequestRejected, StepOutput
from kvgate.engine.overlap import Overlap, drop_pending, overlapped
from kvgate.engine.pooling_params import PoolingParams
from kvgate.engine.prompts import Prompts
from kvgate.engine.runner import Runner
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.scheduler import AllDecode, ScheduledBatch, Scheduler
from kvgate.engine.sequence import Sequence
from kvgate.engine.structured_state import StructuredRequests

EMBEDDING_PARAMS = SamplingParams(max_tokens=1)  # what an embedding request's sequence carries: it samples nothing
RESERVE_RATIO_START, RESERVE_RATIO_FLOOR, RESERVE_RATIO_BUMP, RESERVE_RATIO_DECAY = 0.5, 0.25, 0.25, 0.995
GC_GEN0_THRESHOLD = 100_000  # allocations between young collections; CPython's default is 700


def quiet_gc() -> None:
    """A step allocates a few objects per sequence (outputs, lists), so at CPython's default thresholds the
    collector runs several times a step: +0.9 ms a step at batch 256 in W-HOST (1.7 vs 0.8 ms post-processing).
    A larger young generation collects as surely, far less often; the engine makes few reference cycles."""
    if gc.get_threshold()[0] < GC_GEN0_THRESHOLD:
        gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])


class LLMEngine:
    def __init__(self, model: Any = None, *, runner: Runner | None = None, **kwargs: Any) -> None:
        """Serve `model` (a name, path or ModelSource) with the torch ModelRunner, or serve through the given
        `runner` instead; `kwargs` are EngineConfig fields."""
        self.config = config = EngineConfig(**kwargs)
        if (model is None) == (runner is None):
            raise ValueError("pass either a model to load or a runner, not both or neither")
        if runner is None:
            from kvgate.engine.model_runner import ModelRunner  # torch loads here
            runner = ModelRunner.load(model, config)
        self.runner = runner
        self.model_name: str = runner.model_name
        self.tokenizer = runner.tokenizer
        self.prompts = Prompts(runner.model_name, runner.tokenizer, runner.vocab_size, runner.max_model_len)
        self.fim: FimFormat | None = self.prompts.fim
        self.vocab_size: int = runner.vocab_size
        self.max_model_len: int = runner.max_model_len
        self.eos_token_ids = runner.eos_token_ids
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.embedding_size: int = runner.embedding_size
        self.block_manager = BlockManager(runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.loras = LoraSlots(config.max_loras, config.max_cpu_loras, runner.lora)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.scheduling, self.loras)
        self.seqs: dict[str, Sequence] = {}
        self.structured = StructuredRequests(runner, config)  # structured output: compile wait, matchers
        self.grammars = self.structured.grammars  # its compile cache, whose counts tell hits from compiles
        self.reserve_ratio = RESERVE_RATIO_START
        self.steps = self.prompt_tokens = self.generation_tokens = 0
        self._seen_preemptions = 0
        self.overlap = Overlap(self) if overlapped(config, runner) else None  # decode steps launched ahead
        quiet_gc()

    # ---- requests -------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    arrival_time: float | None = None, stream_text: bool = True, detokenize: bool = True,
                    ahead: bool = False, lora: str | None = None) -> int:
        """Queue a request; returns its prompt length. `ahead`: at the head of the waiting queue (make_room made
        room for it). `lora`: an adapter's name, as `loras.add` named it. `stream_text=False` skips incremental
        detokenization (the text is decoded once at the end) unless stop strings need it. `detokenize=False` leaves
        all text to the caller (an engine.detokenizer.Detokenizer off this thread): outputs carry token ids only,
        stop strings are not looked for here, and the caller aborts the request when it finds one."""
        if request_id in self.seqs:
            raise RequestRejected(f"request_id {request_id!r} is already in the engine: use a unique id")
        if not isinstance(params, SamplingParams):
            raise RequestRejected(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise RequestRejected(f"stop strings {params.stop!r} need a tokenizer and model {self.model_name!r} "
                                  "has none: use stop_token_ids")
        token_ids = self.prompts.ids(prompt)
        n = len(token_ids)
        bad = next((t for t in params.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise RequestRejected(f"logit_bias token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        max_tokens = self.output_budget(n, params.max_tokens)
        if max_tokens < 1:
            raise RequestRejected(f"prompt of {n} tokens leaves no room to generate within "
                                  f"max_model_len={self.max_model_len}")
        needed = self.block_manager.blocks_for(n + max_tokens)
        if needed > self.block_manager.num_blocks:
            raise RequestRejected(f"prompt of {n} tokens plus max_tokens={max_tokens} needs {needed} KV blocks but the "
                                  f"whole cache has {self.block_manager.num_blocks}: lower max_tokens or enlarge the cache")
        seq = Sequence(request_id, list(token_ids), params, max_tokens,
                       arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                       stream_text=detokenize and (stream_text or bool(params.stop)) and self.tokenizer is not None,
                       detokenize=detokenize, ahead=ahead, lora=lora, lora_seed=self.loras.seed(lora))
        seq.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * n
        if params.structured is not None and self.tokenizer is None:
            raise RequestRejected(f"structured output needs a tokenizer and model {self.model_name!r} has none")
        if params.structured is None or self.structured.start(seq):  # else it waits for its grammar to compile
            self.scheduler.add(seq)
        if self.overlap:
            self.overlap.add(seq)
        self.seqs[request_id] = seq
        return n

    def add_embedding_request(self, request_id: str, prompt: str | list[int], pooling: PoolingParams, *,
                              arrival_time: float | None = None, ahead: bool = False) -> int:
        """Queue an embedding request (engine/pooling_params.py); returns its prompt length. Its one output, in the
        step that computes its last prompt token, carries the vector in `embedding`."""
        if request_id in self.seqs:
            raise RequestRejected(f"request_id {request_id!r} is already in the engine: use a unique id")
        if not isinstance(pooling, PoolingParams):
            raise RequestRejected(f"pooling must be a PoolingParams, got {type(pooling).__name__}")
        if pooling.dimensions is not None and pooling.dimensions > self.embedding_size:
            raise RequestRejected(f"dimensions={pooling.dimensions} is more than model {self.model_name!r} has: its "
                                  f"embeddings have {self.embedding_size}")
        token_ids = self.prompts.ids(prompt)
        needed = self.block_manager.blocks_for(len(token_ids))
        if needed > self.block_manager.num_blocks:
            raise RequestRejected(f"prompt of {len(token_ids)} tokens needs {needed} KV blocks but the whole cache has "
                                  f"{self.block_manager.num_blocks}: shorten it or enlarge the cache")
        seq = Sequence(request_id, token_ids, EMBEDDING_PARAMS, 0,
                       arrival_time=time.monotonic() if arrival_time is None else arrival_time, stream_text=False,
                       detokenize=False, ahead=ahead)
        seq.pooling = pooling.resolved(self.runner.pooling)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        return len(token_ids)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None
                    ) -> list[int]:
        """The messages through the model's chat template (engine/prompts.py)."""
        return self.prompts.chat(messages, add_generation_prompt, template_kwargs, tools)

    def encode_fim(self, prompt: str, suffix: str) -> list[int]:
        """A fill-in-the-middle prompt with the model's FIM tokens (engine/prompts.py)."""
        return self.prompts.fill_in_middle(prompt, suffix)

    def abort(self, request_id: str) -> StepOutput | None:
        seq = self.seqs.get(request_id)
        if seq is None or seq.is_finished:
            return None
        drop_pending(seq)
        if not self.structured.abort(seq):  # one still waiting for its grammar was never scheduled
            self.scheduler.finish(seq, "abort")
        return self._finish_output(seq, [], None)

    def has_unfinished(self) -> bool:
        return bool(self.structured) or self.scheduler.has_unfinished()

    # ---- the loop -------------------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One scheduler iteration; outputs only for requests that produced something. With overlap, a decode step
        is launched ahead and its outputs come with the next step (engine/overlap.py)."""
        failed = self._compiled() if self.structured else []
        ahead, read = self.overlap.step() if self.overlap else (False, [])
        batch = None if ahead else self.scheduler.schedule()
        self.steps += 1
        self._adapt_reserve()
        failed += read
        if not batch:  # launched ahead, or nothing to run
            if self.structured and not failed and not ahead:
                time.sleep(0.001)  # nothing to run until a grammar compiles: do not spin a core the compiler needs
            return failed
        seqs, tokens, logprobs = self.runner.run(batch)
        if isinstance(batch, AllDecode) and len(seqs) == len(batch.seqs):
            return failed + self._step_decode(batch.seqs, tokens, logprobs)
        return failed + self._step_chunks(batch, seqs, tokens, logprobs)

    def _compiled(self) -> list[StepOutput]:
        """Requests whose grammar is now compiled join the scheduler's queue; those whose compile failed leave with
        their final output."""
        ready, failed = self.structured.compiled()
        for seq in ready:
            self.scheduler.add(seq)
        for out in failed:
            self.seqs.pop(out.request_id, None)
        return failed

    def _step_chunks(self, batch: ScheduledBatch, seqs: list[Sequence], tokens: list[int], logprobs: list
                     ) -> list[StepOutput]:
        """The general step (prefill chunks, embeddings): each chunk accounted, then each sampled token appended."""
        bs, commit, outputs = self.block_size, self.block_manager.commit, []
        for seq, n in batch:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.prompt_tokens += seq.prefilled(n)
            seq.num_computed_tokens += n
            if seq.pooling is not None:  # an embedding: its blocks never enter the prefix cache
                if seq.num_computed_tokens == seq.num_prompt_tokens:
                    outputs.append(self._embedded(seq))
            elif seq.num_computed_tokens // bs > seq.num_committed_blocks:  # a block just filled up
                commit(seq)
        now = time.monotonic()
        for seq, token, lp in zip(seqs, tokens, logprobs):
            seq.first_token_time = seq.first_token_time or now
            outputs.append(self._append_token(seq, token, lp))
        self.generation_tokens += len(tokens)
        return outputs

    def _step_decode(self, seqs: list[Sequence], tokens: list[int], logprobs: list) -> list[StepOutput]:
        """The pure-decode step: every sequence computed its last token and takes one more."""
        self._computed(seqs)
        return self._appended(seqs, tokens, logprobs)

    def _computed(self, seqs: list[Sequence]) -> None:
        """Each sequence's last token computed (a step launched ahead: as it is launched): counted, and a block
        it filled published in the prefix cache."""
        bs, commit = self.block_size, self.block_manager.commit
        for seq in seqs:
            if seq.num_computed_tokens < seq.num_prompt_tokens:  # a prompt's last token, after a cache hit
                self.prompt_tokens += seq.prefilled(1)
            computed = seq.num_computed_tokens = seq.num_computed_tokens + 1
            if computed // bs > seq.num_committed_blocks:
                commit(seq)

    def _appended(self, seqs: list[Sequence], tokens: list[int], logprobs: list) -> list[StepOutput]:
        """Each decode step's token appended. A token that may end its sequence, one with logprobs and a sequence
        streaming text go through `_append_token`; the rest need only the new id and the counts."""
        now, outputs = time.monotonic(), []
        for seq, token, lp in zip(seqs, tokens, logprobs):
            if seq.first_token_time is None:
                seq.first_token_time = now
            ids, prompt = seq.token_ids, seq.num_prompt_tokens
            if (seq.stream_text or lp is not None or token in seq.stop_ids or len(ids) + 1 - prompt >= seq.max_tokens
                    or seq.matcher is not None):
                outputs.append(self._append_token(seq, token, lp))
                continue
            ids.append(token)
            outputs.append(StepOutput(seq.request_id, [token], "", False, None, prompt, len(ids) - prompt,
                                      seq.num_cached_tokens))
        self.generation_tokens += len(tokens)
        return outputs

    def _embedded(self, seq: Sequence) -> StepOutput:
        """An embedding request whose prompt is computed: its blocks go back at once, its vector goes out."""
        self.scheduler.finish(seq, "stop")
        self.seqs.pop(seq.request_id, None)
        return StepOutput(seq.request_id, [], "", True, "stop", seq.num_prompt_tokens, 0, 0, token_ids=[], text="",
                          embedding=seq.embedding)

    def _append_token(self, seq: Sequence, token: int, logprob: dict[int, float] | None) -> StepOutput:
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        # a structured sequence's grammar may end it too, and force more tokens (jump-forward), counted as generated
        new_ids, reason = self.structured.advance(seq, token) if seq.matcher is not None else \
            ([token], seq.stop_reason(token))
        self.generation_tokens += len(new_ids) - 1
        p, new_text = seq.params, ""
        if seq.stream_text:
            seq.text += detokenize_increment(self.tokenizer, seq, final=reason is not None)
            if reason != "error" and p.stop and find_stop(seq, p.stop):
                reason = "stop"
            end = len(seq.text) if reason else len(seq.text) - held_back(seq.text, p.stop)
            new_text, seq.emitted = seq.text[seq.emitted:end], max(seq.emitted, end)
        lps = [logprob] if logprob is not None else None
        if reason:
            self.scheduler.finish(seq, reason)
            return self._finish_output(seq, new_ids, lps, new_text)
        return StepOutput(seq.request_id, new_ids, new_text, False, None, seq.num_prompt_tokens,
                          len(seq.token_ids) - seq.num_prompt_tokens, seq.num_cached_tokens, None, None, lps)

    def _finish_output(self, seq: Sequence, new_ids: list[int], lps, new_text: str = "") -> StepOutput:
        self.seqs.pop(seq.request_id, None)
        if seq.stream_text:
            new_text += seq.text[seq.emitted:]  # an abort flushes what was held back
            text = seq.text
        else:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens) \
                if self.tokenizer and seq.detokenize else ""
        return StepOutput(seq.request_id, new_ids, new_text, True, seq.finish_reason, seq.num_prompt_tokens,
                          seq.num_output_tokens, seq.num_cached_tokens, token_ids=seq.output_token_ids, text=text,
                          logprobs=lps, error=self.structured.error(seq), prompt_logprobs=seq.prompt_logprobs)

    # ---- admission and stats --------------------------------------------------------------------------------

    def _adapt_reserve(self) -> None:
        preemptions = self.scheduler.num_preemptions
        if preemptions > self._seen_preemptions:
            self.reserve_ratio = min(1.0, self.reserve_ratio + RESERVE_RATIO_BUMP)
            self._seen_preemptions = preemptions
        else:
            self.reserve_ratio = max(RESERVE_RATIO_FLOOR, self.reserve_ratio * RESERVE_RATIO_DECAY)

    def _reserved_tokens(self) -> int:
        """Tokens the sequences already inside will still claim: unallocated context in full, expected output
        growth times the adaptive ratio."""
        return math.ceil(sum(self._reserve_of(seq) for seq in (*self.scheduler.running, *self.scheduler.waiting)))

    def _reserve_of(self, seq: Sequence) -> float:
        bs, bm = self.block_size, self.block_manager
        held = 0 if seq.block_table or seq.pooling is not None else \
            bm.held_prefix(seq.token_ids, seq.block_hashes, seq.lora_seed)  # shared, not claimed (embeddings: none)
        return max(0, seq.num_tokens - (len(seq.block_table) + held) * bs) + self.reserve_ratio * seq.remaining_tokens

    def admission(self) -> Admission:
        s = self.scheduler
        free_tokens = self.block_manager.num_free * self.block_size
        held = len(s.running) + len(s.waiting) + len(self.structured)  # a compiling request takes its seat already
        return Admission(free_seqs=max(0, self.config.max_num_seqs - held),
                         admissible_tokens=max(0, free_tokens - self._reserved_tokens()), block_size=self.block_size)

    def shared_prefix_tokens(self, prompt_ids: list[int], hashes: list[int] | None = None) -> int:
        """Leading prompt tokens in KV blocks that running sequences hold now: a request with this prompt shares
        them rather than taking free blocks, so admission does not count them. `hashes` caches the prompt's
        block hashes between calls (a candidate is checked again on each step until it fits)."""
        return self.block_manager.held_prefix(prompt_ids, [] if hashes is None else hashes) * self.block_size

    def output_budget(self, prompt_len: int, max_tokens: int) -> int:
        """The tokens a request may generate: its max_tokens, cut where prompt plus output would pass max_model_len
        (0: no room). The one place the budget is clamped: add_request applies it, and the worker applies it once
        when it makes a job's ticket, so the admission estimate and `fits` see the budget the sequence will have."""
        return max(0, min(max_tokens, self.max_model_len - prompt_len))

    def fits(self, prompt_len: int, max_tokens: int, shared: int = 0) -> bool:
        """Could this candidate be admitted now without expecting a preemption? `max_tokens`: its budget as
        output_budget gives it. `shared`: its leading prompt tokens already held (shared_prefix_tokens), which cost
        no free block. An idle engine takes anything that fits the whole cache, so a big job is never starved."""
        if not 0 < prompt_len < self.max_model_len + (max_tokens == 0):  # 0: an embedding, which generates nothing
            return False
        if self.block_manager.blocks_for(prompt_len + max_tokens) > self.block_manager.num_blocks:
            return False
        if not self.has_unfinished():
            return True
        a = self.admission()
        need = prompt_len - shared + math.ceil(self.reserve_ratio * max_tokens)
        return a.free_seqs > 0 and need <= a.admissible_tokens

    def make_room(self, prompt_len: int, max_tokens: int, shared: int, victims: list[str]) -> list[str] | None:
        """Preempt running requests among `victims`, in that order, until a request of this size (as `fits` takes
        it) could start now ahead of the waiting queue (add it with `ahead=True`): a fair-share job that waited
        while others hold more than their share of a full worker. The ids preempted ([]: it fits already), or None,
        with nothing preempted, when all of them would not make room or the request can never fit. Those that
        stepped aside least often go first (in `victims`' order among equals); they resume first once room frees
        (after the requests made room for), and are not counted as preemptions (the admission reserve stays)."""
        s, bm = self.scheduler, self.block_manager
        if not 0 < prompt_len < self.max_model_len + (max_tokens == 0):
            return None
        if bm.blocks_for(prompt_len + max_tokens) > bm.num_blocks:
            return None
        need = prompt_len - shared + math.ceil(self.reserve_ratio * max_tokens)
        running = {seq.request_id for seq in s.running}
        candidates = sorted((self.seqs[r] for r in victims if r in running and self.seqs[r].pooling is None),
                            key=lambda seq: seq.stepped_aside)
        chosen: list[Sequence] = []
        seats = self.config.max_num_seqs - len(s.running)
        first = (*s.running, *(seq for seq in s.waiting if seq.ahead))  # the rest of the waiting queue comes after it
        room = bm.num_free * self.block_size - sum(self._reserve_of(seq) for seq in first)
        for seq in [None, *candidates]:
            if seq is not None:
                chosen.append(seq)
                seats += 1
                room += sum(bm.blocks[b].ref_count == 1 for b in seq.block_table) * self.block_size
                room += self._reserve_of(seq)
            if seats > 0 and need <= room:
                for victim in chosen:
                    s.step_aside(victim)
                return [victim.request_id for victim in chosen]
        return None

    @property
    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        return EngineStats(steps=self.steps, running=len(s.running), waiting=len(s.waiting), free_blocks=bm.num_free,
                           total_blocks=bm.num_blocks, block_size=self.block_size,
                           kv_usage=1.0 - bm.num_free / bm.num_blocks, preemptions=s.num_preemptions,
                           stepped_aside=s.num_stepped_aside,
                           prefix_hit_tokens=s.prefix_hit_tokens, prefix_query_tokens=s.prefix_query_tokens,
                           prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens)


# ---- incremental detokenization (batched, off the engine thread: engine.detokenizer) ----------------------

def detokenize_increment(tokenizer: Any, seq: Sequence, final: bool = False) -> str:
    """New text since the last call. Decoding a short window of tokens keeps it cheap; a window ending in an
    incomplete UTF-8 character (U+FFFD) waits for the next token, unless this is the last one."""
    ids, skip = seq.token_ids, seq.params.skip_special_tokens
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
    return take_increment(seq, prefix, full, final, len(ids))
