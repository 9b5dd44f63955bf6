"""Batched sampling: greedy rows by one argmax, the rest through repetition penalty (HF semantics),
temperature, top-k, top-p and a per-request torch.Generator when a seed was given."""
from __future__ import annotations

import torch

from kvgate.engine.sequence import Sequence


def apply_repetition_penalty(logits: torch.Tensor, token_ids: list[int], penalty: float) -> None:
    """HF's rule over the prompt and the output so far: divide positive scores, multiply negative ones."""
    ids = torch.tensor(sorted(set(token_ids)), device=logits.device, dtype=torch.long)
    score = logits[ids]
    logits[ids] = torch.where(score < 0, score * penalty, score / penalty)


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Like HF's TopK then TopP warpers: masked logits are -inf; the most likely token always survives."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative <= 1 - top_p
        remove[-1] = False
        logits = logits.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.device = device

    def generator_for(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self.generator
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.params.seed)
        return seq.generator

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[dict[int, float] | None]]:
        """Next token for each row of `logits` [B, V] (float32), and logprobs for the rows that asked."""
        plain = all(s.params.greedy and s.params.repetition_penalty == 1.0 for s in seqs)
        if plain:
            tokens = logits.argmax(-1).tolist()
        else:
            tokens = [self._sample_row(logits[i].clone(), seq) for i, seq in enumerate(seqs)]
        logprobs: list[dict[int, float] | None] = [None] * len(seqs)
        for i, seq in enumerate(seqs):
            if seq.params.logprobs is not None:
                logprobs[i] = self._logprobs(logits[i], tokens[i], seq.params.logprobs)
        return tokens, logprobs

    def _sample_row(self, row: torch.Tensor, seq: Sequence) -> int:
        p = seq.params
        if p.repetition_penalty != 1.0:
            apply_repetition_penalty(row, seq.token_ids, p.repetition_penalty)
        if p.greedy:
            return int(row.argmax())
        row = apply_top_k_top_p(row / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator_for(seq)))

    @staticmethod
    def _logprobs(row: torch.Tensor, token: int, top: int) -> dict[int, float]:
        """The model's own distribution (before sampling transforms): the chosen token plus the top `top`."""
        logp = row.log_softmax(-1)
        out = {token: float(logp[token])}
        if top:
            values, ids = logp.topk(top)
            for v, i in zip(values.tolist(), ids.tolist()):
                out.setdefault(i, v)
        return out
