"""Structured output: the one constraint a request's tokens follow (a JSON schema, any JSON object, a regular
expression, a choice among strings, or a grammar), compiled, matched and turned into a token mask for the batch.

The grammar engine is llguidance (MIT, guidance-ai; vLLM and SGLang offer it beside xgrammar). Measured on our case
(SmolLM2's 49,152-token vocabulary, an 8-field schema, a 2-core CPU): compiling 5.8 ms against xgrammar's 22.5 ms, the
mask for 64 rows 0.26-0.34 ms against xgrammar's 1.4-2.7 ms, and it has no dependency of its own (xgrammar's wheel pulls
triton and apache-tvm-ffi). Its parser limits ("fuel") bound the work of a hostile schema or regex, so compiling or
masking one ends in an error instead of an hour's work.

- `StructuredOutput` is the engine's own form of the wire's `Structured` (the engine may not import the SDK).
- `Grammars` compiles on its own threads, never the engine's: a compiled grammar is kept by content (an LRU of
  prototypes), and each request gets a copy of its prototype (`deep_copy`, microseconds), so a cached schema costs
  nothing to compile again. A compile that fails, or runs past `timeout_s`, is an error naming the problem.
- `TokenMasks` fills the bitmask of a batch's constrained rows with llguidance's executor (its threads, without the
  GIL) and applies it to the logits: a disallowed token's logit is -inf, so greedy rows stay greedy over what the
  grammar allows and sampling never draws outside it. Unconstrained batches never get here.
"""
from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvgate.engine")

# the wire's kinds (producer/constraints.py STRUCTURED_KINDS), which the engine may not import: a test holds them equal
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON as json.dumps writes it: one space after ':' and ',' and no other whitespace. With llguidance's default
# (any run of whitespace between tokens) a greedy small model can fill its whole max_tokens with newlines: 15 of 16
# W-STRUCT answers ran to max_tokens so. A schema's own "x-guidance" options still override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
BITS = 32


class GrammarError(ValueError):
    """A constraint that cannot be used: the library refused it, or it took too long to compile."""


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What a request's output must follow. `spec`: the JSON schema's text (json_schema; optional for json_object),
    the regex, or the grammar (Lark, or GBNF/EBNF); `choices`: the strings of `choice`."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured kind {self.kind!r} must be one of {', '.join(KINDS)}")
        if self.kind == "choice" and not self.choices:
            raise ValueError("structured choice needs at least one string in choices")
        if self.kind in ("json_schema", "regex", "grammar") and not self.spec:
            raise ValueError(f"structured {self.kind} needs a spec (the {self.kind.replace('_', ' ')})")

    @classmethod
    def of(cls, value: Any) -> StructuredOutput | None:
        """From itself, a dict, or any object with kind/spec/choices (the wire's Structured)."""
        if value is None or isinstance(value, cls):
            return value
        get = value.get if isinstance(value, dict) else lambda name, default: getattr(value, name, default)
        return cls(get("kind", None), get("spec", "") or "", tuple(get("choices", ()) or ()))

    def grammar(self) -> str:
        """llguidance's grammar text for this constraint."""
        import llguidance

        if self.kind in ("json_schema", "json_object"):
            return llguidance.LLMatcher.grammar_from_json_schema(self.spec or '{"type": "object"}', JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.grammar_from("regex", self.spec)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(self.choices)))
        return llguidance.grammar_from("grammar", self.spec)


class Grammars:
    """Compiles constraints off the engine thread, keeps them by content, and gives each request its matcher."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int], *, threads: int = 2,
                 timeout_s: float = 10.0, cache_size: int = 256) -> None:
        self.tokenizer, self.vocab_size, self.timeout_s, self.cache_size = tokenizer, vocab_size, timeout_s, cache_size
        self.eos = sorted(eos_token_ids)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvgate-grammar")
        self._cache: OrderedDict[StructuredOutput, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: Future | None = None
        self.compiles = self.hits = 0

    def tokenizer_future(self) -> Future:
        """llguidance's view of the vocabulary, built once on a compile thread (about 1.5 s for SmolLM2's)."""
        if self._ll_tokenizer is None:
            self._ll_tokenizer = self._pool.submit(self._build_tokenizer)
        return self._ll_tokenizer

    def _build_tokenizer(self) -> Any:
        import llguidance.hf

        if self.tokenizer is None:
            raise GrammarError("this model has no tokenizer, so its output cannot follow a grammar")
        return llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos or None)

    def compile(self, constraint: StructuredOutput) -> Future:
        """A future of the compiled prototype matcher, shared by every request with the same constraint."""
        with self._lock:
            future = self._cache.get(constraint)
            if future is not None:
                self._cache.move_to_end(constraint)
                self.hits += 1
                return future
            self.compiles += 1
            tokenizer = self.tokenizer_future()
            future = self._pool.submit(self._compile, constraint, tokenizer)
            future.started_at = time.monotonic()
            self._cache[constraint] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    @staticmethod
    def _compile(constraint: StructuredOutput, tokenizer: Future) -> Any:
        import llguidance

        try:
            grammar = constraint.grammar()
        except ValueError as e:
            raise GrammarError(f"structured {constraint.kind} is not valid: {e}") from None
        matcher = llguidance.LLMatcher(tokenizer.result(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"structured {constraint.kind} does not compile: {matcher.get_error()}")
        return matcher

    def ready(self, future: Future) -> Any | None:
        """A fresh matcher once `future` is done; None while it compiles. GrammarError when it failed or has run
        past timeout_s (its thread finishes in the background; the request is answered now)."""
        if not future.done():
            if time.monotonic() - future.started_at > self.timeout_s:
                with self._lock:  # a later request with it tries again rather than waiting on this one
                    for key, f in list(self._cache.items()):
                        if f is future:
                            del self._cache[key]
                raise GrammarError(f"the structured constraint took more than {self.timeout_s:g} s to compile: "
                                   "simplify it (fewer nested or alternative parts)")
            return None
        error = future.exception()
        if error is not None:
            raise error if isinstance(error, GrammarError) else GrammarError(f"structured output: {error}")
        return future.result().deep_copy()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class TokenMasks:
    """The token mask of a batch's constrained rows: filled on llguidance's threads, applied to the logits."""

    def __init__(self, vocab_size: int, threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // BITS)
        self._executor = None
        self._threads = threads
        self._bitmask = None

    def fill(self, matchers: list[Any]):
        """The bitmask [len(matchers), words] int32: bit t of row r set where matchers[r] allows token t."""
        import llguidance
        import llguidance.torch
        import torch

        if self._executor is None:
            self._executor = llguidance.LLExecutor(self._threads)
        rows = len(matchers)
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = torch.empty(max(rows, 8), self.words, dtype=torch.int32)
        bitmask = self._bitmask[:rows]
        llguidance.torch.fill_next_token_bitmask_par(self._executor, list(zip(matchers, range(rows))), bitmask)
        return bitmask

    def apply(self, logits, rows: list[int], bitmask) -> None:
        """In place: logits[rows[r], t] = -inf where bit t of bitmask row r is clear (tokens past the grammar's
        vocabulary are never allowed: the mask covers the logits' whole width). On a GPU the words go over (32x
        fewer bytes than booleans) and a Triton kernel writes the -inf; on the CPU one compiled loop walks each
        row's words once (kernels/cpu_mask.py), or the torch twin where numba or the dtype rules that out."""
        import torch

        if logits.device.type == "cuda":
            from kvgate.kernels.token_mask import apply_token_bitmask

            index = torch.tensor(rows, dtype=torch.int32).to(logits.device, non_blocking=True)
            apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True), index)
            return
        cpu_apply = _cpu_mask() if logits.dtype == torch.float32 and logits.is_contiguous() else None
        if cpu_apply is not None:
            import numpy as np

            cpu_apply(logits.numpy(), np.asarray(rows, dtype=np.int64), bitmask.numpy())
            return
        from kvgate.kernels.reference import apply_token_bitmask

        apply_token_bitmask(logits, bitmask, torch.tensor(rows))

    def mask(self, logits, rows: list[int], matchers: list[Any]) -> None:
        self.apply(logits, rows, self.fill(matchers))


def forced_tokens(matcher: Any, limit: int) -> list[int]:
    """Jump-forward: the tokens the grammar allows as the only continuation from here (llguidance's fast-forward
    tokens, tokenized as the model would write them), at most `limit`, consumed by the matcher. The engine appends
    them to the sequence at once; the next step computes them with the token after them, one forward for all."""
    if limit <= 0:
        return []
    forced = list(matcher.compute_ff_tokens()[:limit])
    if matcher.is_error():  # the tokens of a parser past its limits are no continuation (37,502 of `{"next": `)
        return []
    if forced:
        matcher.consume_tokens(forced)
    return forced


def matcher_error(matcher: Any, constraint: StructuredOutput, output_tokens: int) -> str:
    """Why a request's matcher stopped in error while it generated, as the request's error: the grammar engine's
    first line (the rest is a dump of its parser state and the grammar). Its parser limits end a constraint that has
    no finite answer this way (a required recursive $ref: "Too many items"), and a masked sampler would then draw
    the one token it still allows, EOS, as if the answer were complete."""
    message = (matcher.get_error() or "no message").strip().splitlines()[0][:300]
    return (f"structured {constraint.kind} failed at output token {output_tokens}: the grammar engine reports "
            f"{message!r}; give the constraint a finite answer (no required recursive $ref, a grammar rule that can "
            "end) or simplify it")


@functools.cache
def _cpu_mask():
    """kernels/cpu_mask.py's compiled loop, or None where numba cannot be imported (the twin serves); looked up once,
    at the first CPU mask, so a GPU worker never imports numba for it."""
    try:
        from kvgate.kernels.cpu_mask import apply_token_bitmask
    except ImportError as e:
        log.warning("structured output masks through torch on the CPU: numba is unavailable (%s)", e)
        return None
    return apply_token_bitmask


def allowed_by_reference(matcher: Any, vocab_size: int) -> list[int]:
    """Every token the matcher alone accepts next, found by trying each one (validate_tokens, which consumes
    nothing): the brute-force twin of the bitmask, for tests."""
    return [token for token in range(vocab_size) if matcher.validate_tokens([token]) == 1]
