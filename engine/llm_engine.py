"""The engine the worker drives: add_request, step, abort, and the admission question (how many more tokens
can come in now without expecting a preemption).

The engine schedules, accounts KV blocks, caches prefixes and admits; its runner computes the scheduled tokens:
the torch ModelRunner for a real model, a CostModelRunner for the simulated fleet. Torch loads only when a
ModelRunner is built, so everything here imports without it."""
from __future__ import annotations

import gc
import math
import time
from typing import Any, Protocol

from kvgate.engine.block_manager import BlockManager
from kvgate.engine.constraints import GrammarError, Grammars, forced_tokens
from kvgate.engine.config import EngineConfig
from kvgate.engine.detokenizer import find_stop, held_back, take_increment
from kvgate.engine.fim import FimFormat, fim_format, known_formats
from kvgate.engine.outputs import Admission, EngineStats, RequestRejected, StepOutput
from kvgate.engine.pooling_params import PoolingParams
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.scheduler import AllDecode, ScheduledBatch, Scheduler
from kvgate.engine.sequence import Sequence, SequenceStatus

EMBEDDING_PARAMS = SamplingParams(max_tokens=1)  # what an embedding request's sequence carries: it samples nothing
RESERVE_RATIO_START, RESERVE_RATIO_FLOOR, RESERVE_RATIO_BUMP, RESERVE_RATIO_DECAY = 0.5, 0.25, 0.25, 0.995
GC_GEN0_THRESHOLD = 100_000  # allocations between young collections; CPython's default is 700


def quiet_gc() -> None:
    """A step allocates a few objects per sequence (outputs, lists), so at CPython's default thresholds the
    collector runs several times a step: +0.9 ms a step at batch 256 in W-HOST (1.7 vs 0.8 ms post-processing).
    A larger young generation collects as surely, far less often; the engine makes few reference cycles."""
    if gc.get_threshold()[0] < GC_GEN0_THRESHOLD:
        gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])


class Runner(Protocol):
    """What computes a scheduled batch, and the facts about its model the engine needs."""
    model_name: str
    tokenizer: Any  # None: the engine takes token ids only
    vocab_size: int
    max_model_len: int
    eos_token_ids: set[int]
    num_blocks: int  # KV cache blocks of the engine's block_size
    embedding_size: int  # the length of an embedding request's vector before `dimensions` cuts it
    pooling: str  # the model's own pooling (last, mean, cls): what an embedding request's `model` pooling means

    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list[dict[int, float] | None]]:
        """Compute each (sequence, n) chunk; a next token (and logprobs) for each sequence now fully computed."""
        ...


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
        self.fim: FimFormat | None = fim_format(self.tokenizer)  # found once: the tokenizer does not change
        self.vocab_size: int = runner.vocab_size
        self.max_model_len: int = runner.max_model_len
        self.eos_token_ids = runner.eos_token_ids
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.embedding_size: int = runner.embedding_size
        self.block_manager = BlockManager(runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.scheduling)
        self.seqs: dict[str, Sequence] = {}
        # structured output: compiled off this thread; a request waits here, holding no KV block, until it is
        self.grammars = Grammars(runner.tokenizer, runner.vocab_size, runner.eos_token_ids,
                                 threads=config.grammar_threads, timeout_s=config.grammar_compile_timeout_s)
        self.compiling: dict[Sequence, Any] = {}  # sequence -> the future of its compiled grammar
        self.reserve_ratio = RESERVE_RATIO_START
        self.steps = self.prompt_tokens = self.generation_tokens = 0
        self._seen_preemptions = 0
        quiet_gc()

    # ---- requests -------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    arrival_time: float | None = None, stream_text: bool = True, detokenize: bool = True,
                    ahead: bool = False) -> int:
        """Queue a request; returns its prompt length. `ahead`: at the head of the waiting queue (make_room made
        room for it). `stream_text=False` skips incremental detokenization
        (the text is decoded once at the end) unless stop strings need it. `detokenize=False` leaves all text to
        the caller (an engine.detokenizer.Detokenizer off this thread): outputs carry token ids only, stop
        strings are not looked for here, and the caller aborts the request when it finds one."""
        if request_id in self.seqs:
            raise RequestRejected(f"request_id {request_id!r} is already in the engine: use a unique id")
        if not isinstance(params, SamplingParams):
            raise RequestRejected(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise RequestRejected(f"stop strings {params.stop!r} need a tokenizer and model {self.model_name!r} "
                                  "has none: use stop_token_ids")
        token_ids = self._prompt_ids(prompt)
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
                       detokenize=detokenize, ahead=ahead)
        seq.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * n
        if params.structured is not None:
            if self.tokenizer is None:
                raise RequestRejected(f"structured output needs a tokenizer and model {self.model_name!r} has none")
            future = self.grammars.compile(params.structured)
            try:
                seq.matcher = self.grammars.ready(future)
            except GrammarError as e:  # known bad from an earlier request with the same constraint
                raise RequestRejected(str(e)) from None
            if seq.matcher is None:
                self.seqs[request_id] = seq
                self.compiling[seq] = future
                return n
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
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
        token_ids = self._prompt_ids(prompt)
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

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A prompt's ids, checked against the vocabulary and max_model_len."""
        token_ids = self._tokenize(prompt)
        n = len(token_ids)
        if n > self.max_model_len:
            raise RequestRejected(f"prompt of {n} tokens is longer than max_model_len={self.max_model_len}: "
                                  "shorten it or raise max_model_len")
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRejected(f"prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        return list(token_ids)

    def _compiled(self) -> list[StepOutput]:
        """Requests whose grammar is now compiled join the scheduler's queue; one that failed is answered with
        finish_reason "error" naming the problem."""
        failed = []
        for seq, future in list(self.compiling.items()):
            try:
                seq.matcher = self.grammars.ready(future)
            except GrammarError as e:
                del self.compiling[seq]
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
                self.seqs.pop(seq.request_id, None)
                failed.append(StepOutput(seq.request_id, [], "", True, "error", seq.num_prompt_tokens, 0, 0,
                                         token_ids=[], text="", error=str(e)))
                continue
            if seq.matcher is not None:
                del self.compiling[seq]
                self.scheduler.add(seq)
        return failed

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected(f"model {self.model_name!r} has no tokenizer: send token ids, not text")
            if not prompt:
                raise RequestRejected("prompt is empty: send at least one token")
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise RequestRejected("prompt is empty: send at least one token")
            return list(prompt)
        raise RequestRejected(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None
                    ) -> list[int]:
        """The messages through the model's chat template; `template_kwargs`: more variables the template reads
        (the wire bounds them and keeps apply_chat_template's own parameters out); `tools`: OpenAI's function tools,
        as the chat template renders them (one that knows none ignores them)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RequestRejected(f"model {self.model_name!r} has no chat template: send a plain prompt")
        try:
            with_tools = {"tools": tools} if tools else {}  # the call without tools is what it always was
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **(template_kwargs or {}), **with_tools)
        except Exception as e:  # template errors come in many types
            raise RequestRejected(f"chat messages do not fit the chat template: {e}") from e
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_fim(self, prompt: str, suffix: str) -> list[int]:
        """A fill-in-the-middle prompt: the text before the hole and after it, with the model's FIM tokens
        (engine/fim.py), for the model to write the middle."""
        if self.fim is None:
            raise RequestRejected(f"suffix: model {self.model_name!r} has no fill-in-the-middle tokens in its "
                                  f"tokenizer (recognised: {known_formats()}); send the prompt alone, or send "
                                  "suffix to a model with FIM tokens")
        return self.fim.render(list(self.tokenizer.encode(prompt, add_special_tokens=False)),
                               list(self.tokenizer.encode(suffix, add_special_tokens=False)))

    def abort(self, request_id: str) -> StepOutput | None:
        seq = self.seqs.get(request_id)
        if seq is None or seq.is_finished:
            return None
        if self.compiling.pop(seq, None) is not None:  # never scheduled
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        else:
            self.scheduler.finish(seq, "abort")
        return self._finish_output(seq, [], None)

    def has_unfinished(self) -> bool:
        return bool(self.compiling) or self.scheduler.has_unfinished()

    # ---- the loop -------------------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One scheduler iteration; outputs only for requests that produced something."""
        failed = self._compiled() if self.compiling else []
        batch = self.scheduler.schedule()
        self.steps += 1
        self._adapt_reserve()
        if not batch:
            if self.compiling and not failed:
                time.sleep(0.001)  # nothing to run until a grammar compiles: do not spin a core the compiler needs
            return failed
        seqs, tokens, logprobs = self.runner.run(batch)
        if isinstance(batch, AllDecode) and len(seqs) == len(batch.seqs):
            return failed + self._step_decode(batch.seqs, tokens, logprobs)
        bs, commit, outputs = self.block_size, self.block_manager.commit, []
        for seq, n in batch:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self._count_prefill(seq, n)
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
        return failed + outputs

    def _step_decode(self, seqs: list[Sequence], tokens: list[int], logprobs: list) -> list[StepOutput]:
        """The pure-decode step: every sequence computed its last token and takes one more, accounted and appended
        in one pass. A token that may end its sequence, one with logprobs and a sequence streaming text go
        through `_append_token`; the rest need only the new id and the counts."""
        bs, commit, now, outputs = self.block_size, self.block_manager.commit, time.monotonic(), []
        for seq, token, lp in zip(seqs, tokens, logprobs):
            if seq.num_computed_tokens < seq.num_prompt_tokens:  # a prompt's last token, after a cache hit
                self._count_prefill(seq, 1)
            computed = seq.num_computed_tokens = seq.num_computed_tokens + 1
            if computed // bs > seq.num_committed_blocks:
                commit(seq)
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

    def _count_prefill(self, seq: Sequence, n: int) -> None:
        """Each prompt token once: prefix-cache hits are never computed, and recomputation after a preemption
        is not new prompt work."""
        end = min(seq.num_computed_tokens + n, seq.num_prompt_tokens)
        start = max(seq.num_computed_tokens, seq.num_prefilled_tokens)
        if end > start:
            self.prompt_tokens += end - start
            seq.num_prefilled_tokens = end

    def _append_token(self, seq: Sequence, token: int, logprob: dict[int, float] | None) -> StepOutput:
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        p, new_ids = seq.params, [token]
        if seq.matcher is not None:
            seq.matcher.consume_token(token)  # the mask allowed it, so the grammar accepts it
        reason = self._stop_reason(seq, token)
        if reason is None and seq.matcher is not None and self.config.jump_forward and p.logprobs is None:
            # the tokens the grammar forces next join the sequence now (no logprobs: a forced token has none)
            # the matcher has consumed them all, so it may be complete (stopped) before the last is appended
            forced = forced_tokens(seq.matcher, seq.max_tokens - (len(seq.token_ids) - seq.num_prompt_tokens))
            for k, token in enumerate(forced):
                seq.token_ids.append(token)
                new_ids.append(token)
                if reason := self._stop_reason(seq, token, grammar=k == len(forced) - 1):
                    break
            self.generation_tokens += len(new_ids) - 1
        new_text = ""
        if seq.stream_text:
            seq.text += detokenize_increment(self.tokenizer, seq, final=reason is not None)
            if p.stop and find_stop(seq, p.stop):
                reason = "stop"
            end = len(seq.text) if reason else len(seq.text) - held_back(seq.text, p.stop)
            new_text, seq.emitted = seq.text[seq.emitted:end], max(seq.emitted, end)
        lps = [logprob] if logprob is not None else None
        if reason:
            self.scheduler.finish(seq, reason)
            return self._finish_output(seq, new_ids, lps, new_text)
        return StepOutput(seq.request_id, new_ids, new_text, False, None, seq.num_prompt_tokens,
                          len(seq.token_ids) - seq.num_prompt_tokens, seq.num_cached_tokens, None, None, lps)

    def _stop_reason(self, seq: Sequence, token: int, grammar: bool = True) -> str | None:
        """Why the sequence ends with `token`, just appended, or None. `grammar`: whether the matcher's state is the
        one after `token` (not after forced tokens still to be appended)."""
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if grammar and seq.matcher is not None and seq.matcher.is_stopped():
            return "stop"  # the grammar is complete and allows nothing more: no step spent drawing its EOS
        if len(seq.token_ids) - seq.num_prompt_tokens >= seq.max_tokens:
            return "length"
        return None

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
                          logprobs=lps, prompt_logprobs=seq.prompt_logprobs)

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
            bm.held_prefix(seq.token_ids, seq.block_hashes)  # shared, not claimed (an embedding shares none)
        return max(0, seq.num_tokens - (len(seq.block_table) + held) * bs) + self.reserve_ratio * seq.remaining_tokens

    def admission(self) -> Admission:
        s = self.scheduler
        free_tokens = self.block_manager.num_free * self.block_size
        held = len(s.running) + len(s.waiting) + len(self.compiling)  # a compiling request takes its seat already
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
