"""A runner without a model: a step costs `step_overhead_s + per_token_s * tokens computed` and each sampled
token is a deterministic function of the seed, the request (or its params seed), the position and the prompt;
a structured-output request's is one its grammar allows (engine/simulated_tokenizer.py gives the grammar real tokens).

Tokens served from the prefix cache are never in the batch (the scheduler starts a sequence's first chunk
after its cache hits), so they cost nothing here, as on a GPU. Torch-free."""
from __future__ import annotations

import math
import struct
import time
import zlib
from typing import Any

from kvgate.engine.scheduler import ScheduledBatch
from kvgate.engine.sequence import Sequence
from kvgate.engine.simulated_loras import SimulatedLoras
from kvgate.engine.simulated_tokenizer import SimulatedTokenizer, simulated_tokenizer  # noqa: F401 (tests take it here)


class CostModelRunner:
    def __init__(self, num_blocks: int, *, step_overhead_s: float = 0.002, per_token_s: float = 0.0001,
                 seed: int = 0, max_model_len: int = 4096, vocab_size: int = 32000, model_name: str = "simulated",
                 sleep: bool = True, max_loras: int = 0, lora_load_s: float = 0.0,
                 lora_read_s: float = 0.0) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1: give the simulated KV cache at least one block")
        if step_overhead_s < 0 or per_token_s < 0:
            raise ValueError(f"step_overhead_s={step_overhead_s} and per_token_s={per_token_s} must be >= 0")
        self.num_blocks, self.max_model_len, self.words = num_blocks, max_model_len, vocab_size
        self.model_name, self.seed, self.sleep = model_name, seed, sleep
        self.step_overhead_s, self.per_token_s = step_overhead_s, per_token_s
        self.tokenizer = simulated_tokenizer(vocab_size)
        # adapters without weights (engine/simulated_loras.py): slots, loads and their cost; None without slots
        self.lora = SimulatedLoras(lora_load_s, sleep, lora_read_s) if max_loras else None
        self.launch_device = None  # it launches no step ahead: its cost model runs when the step is taken
        self.vocab_size = len(self.tokenizer)  # the words, then the bytes and end-of-text a grammar may need
        # only a grammar draws the end-of-text token, so an unconstrained request still ends by length or stop ids
        self.eos_token_ids: set[int] = {self.tokenizer.eos_token_id}
        self.embedding_size, self.pooling = 8, "last"
        self.tokens_computed = 0  # over all steps: what the cost model charged for
        self.busy_s = 0.0  # modelled compute time over all steps, slept or not

    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list[dict[int, float] | None]]:
        computed = sum(n for _, n in batch)
        cost = self.step_overhead_s + self.per_token_s * computed
        self.tokens_computed += computed
        self.busy_s += cost
        if self.sleep:
            time.sleep(cost)
        for seq, n in batch:  # prompt logprobs: the same point mass on each prompt token
            if seq.prompt_logprobs is not None:
                start = seq.num_computed_tokens
                for p in range(start + 1, min(start + n + 1, seq.num_prompt_tokens)):
                    seq.prompt_logprobs[p] = {seq.token_ids[p]: 0.0}
        done = [seq for seq, n in batch if seq.num_computed_tokens + n == seq.num_tokens and seq.pooling is None]
        for seq, n in batch:
            if seq.pooling is not None and seq.num_computed_tokens + n == seq.num_tokens:
                seq.embedding = self.embedding(seq)
        tokens = [self.next_token(seq) for seq in done]
        # the model is a point mass on its token: logprob 0 for the chosen one, no alternatives
        logprobs = [None if seq.params.logprobs is None else {t: 0.0} for seq, t in zip(done, tokens)]
        return done, tokens, logprobs

    def embedding(self, seq: Sequence) -> bytes:
        """A deterministic vector of the prompt, cut and normalized as asked: float32 little-endian."""
        key = f"{self.seed}:".encode() + str(seq.prompt_token_ids).encode()
        vector = [(zlib.crc32(key + bytes([i])) % 2001 - 1000) / 1000 for i in range(self.embedding_size)]
        vector = vector[:seq.pooling.dimensions or len(vector)]
        if seq.pooling.normalize:
            norm = math.sqrt(sum(v * v for v in vector)) or 1.0
            vector = [v / norm for v in vector]
        return struct.pack(f"<{len(vector)}f", *vector)

    def next_token(self, seq: Sequence) -> int:
        who = seq.request_id if seq.params.seed is None else seq.params.seed
        key = f"{self.seed}:{who}:{seq.num_output_tokens}".encode() + str(seq.prompt_token_ids[:8]).encode()
        if seq.matcher is not None:
            return self.allowed_token(seq.matcher, zlib.crc32(key))
        return zlib.crc32(key) % self.words

    def allowed_token(self, matcher: Any, draw: int) -> int:
        """What a masked sampler would take: a token the grammar allows next, chosen by `draw`, and the end-of-text
        token as soon as the grammar allows it (a simulated answer is as short as its constraint lets it be, so it
        ends before max_tokens as a model's usually does). A matcher in error allows nothing but that token; the
        engine then reads its error."""
        import numpy as np

        allowed = np.flatnonzero(np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                                               bitorder="little"))
        eos = self.tokenizer.eos_token_id
        if not len(allowed) or eos in allowed:
            return eos
        return int(allowed[draw % len(allowed)])

