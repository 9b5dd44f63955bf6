"""Per-request sampling settings, validated at construction so a bad value fails where it was made.

The queue's requests declare these fields once, in the wire's `Sampling` (kvgate/producer/protocol.py); the engine
may not import the SDK (kernels <- engine <- worker -> producer.protocol), so it keeps this dataclass of its own and
tests/producer/test_field_agreement.py holds the two to the same names, defaults and bounds. Where they differ on
purpose:
- `max_tokens` defaults to 16 here, as vLLM's SamplingParams does: `LLM(...).generate(prompts)` is vLLM's API, and
  code moved from vLLM gets the lengths it had. A queued job defaults to the wire's 256 (the SDK's too); the
  gateway's 512 is an operator's setting (--default-max-tokens) for bodies that give none.
- the engine sets no upper bound on max_tokens, temperature or seed, nor on how many stop strings or stop ids: the
  wire's limits (MAX_TOKENS_LIMIT, 100, 2**63, 16, 64) keep one job's payload from costing a worker, which a local
  caller cannot do to anyone but itself. max_tokens is cut to what max_model_len leaves when the request is added.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvgate.engine.constraints import StructuredOutput


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # how many top logprobs to return per token (0: only the chosen one)
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per occurrence in the output so far
    presence_penalty: float = 0.0  # OpenAI's: subtracted once if the token occurred in the output so far
    # the one constraint the output follows (engine/constraints.py): a StructuredOutput, its dict, or the wire's
    structured: Any = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one, after temperature
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    prompt_logprobs: int | None = None  # each prompt token's logprob (and this many top ones) in its context
    skip_special_tokens: bool = True  # False: special tokens stay in the text
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.structured = StructuredOutput.of(self.structured)
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be a number >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be -1 (disabled) or a positive integer")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} must be in (0, 10]")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}={value!r} must be a number in [-2, 2] (0 disables it)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be non-negative integers")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed={self.seed!r} must be a non-negative integer or None")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 20):
                raise ValueError(f"{name}={value!r} must be an integer in [0, 20] or None")
        bad = next(((k, v) for k, v in self.logit_bias.items() if not isinstance(k, int) or k < 0
                    or not isinstance(v, (int, float)) or not -100.0 <= v <= 100.0), None)
        if bad is not None:
            raise ValueError(f"logit_bias entry {bad[0]!r}: {bad[1]!r} must map a token id >= 0 to a bias in "
                             "[-100, 100]")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p!r} must be in [0, 1] (0 disables it)")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens!r} must be an integer >= 0")

    @property
    def penalized(self) -> bool:
        """A repetition, frequency or presence penalty: its logits depend on the tokens generated so far."""
        return self.repetition_penalty != 1.0 or bool(self.frequency_penalty) or bool(self.presence_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
