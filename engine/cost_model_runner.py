"""A runner without a model: a step costs `step_overhead_s + per_token_s * tokens computed` and each sampled
token is a deterministic function of the seed, the request (or its params seed), the position and the prompt.

Tokens served from the prefix cache are never in the batch (the scheduler starts a sequence's first chunk
after its cache hits), so they cost nothing here, as on a GPU. Torch-free."""
from __future__ import annotations

import math
import struct
import time
import zlib

from kvgate.engine.scheduler import ScheduledBatch
from kvgate.engine.sequence import Sequence


class SimulatedTokenizer:
    """Deterministic words -> ids and ids -> ' t<id>' text; enough to count tokens and render output."""

    chat_template = "<role> content ... <assistant>"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [zlib.crc32(word.encode()) % self.vocab_size for word in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" t{i}" for i in ids)

    def get_vocab(self) -> dict[str, int]:
        return {}  # no named tokens: no fill-in-the-middle (engine/fim.py)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: list | None = None,
                            **template_kwargs) -> str:  # renders no tools
        turns = " ".join(f"<{m['role']}> {m['content']}" for m in messages)
        return f"{turns} <assistant>" if add_generation_prompt else turns


class CostModelRunner:
    def __init__(self, num_blocks: int, *, step_overhead_s: float = 0.002, per_token_s: float = 0.0001,
                 seed: int = 0, max_model_len: int = 4096, vocab_size: int = 32000, model_name: str = "simulated",
                 sleep: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1: give the simulated KV cache at least one block")
        if step_overhead_s < 0 or per_token_s < 0:
            raise ValueError(f"step_overhead_s={step_overhead_s} and per_token_s={per_token_s} must be >= 0")
        self.num_blocks, self.max_model_len, self.vocab_size = num_blocks, max_model_len, vocab_size
        self.model_name, self.seed, self.sleep = model_name, seed, sleep
        self.step_overhead_s, self.per_token_s = step_overhead_s, per_token_s
        self.tokenizer = SimulatedTokenizer(vocab_size)
        self.eos_token_ids: set[int] = set()  # as ignore_eos: a simulated request ends by length or stop ids
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
        return zlib.crc32(key) % self.vocab_size

