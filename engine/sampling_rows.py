"""A step's sampling parameters as arrays, a row per sampled sequence, so the sampler does no per-row Python.

A decode-only step gathers them from `SamplingRows`, a table with one row per decode-input row, written once when a
sequence claims its row (its parameters never change); any other step builds them from the sequences. A request
without a seed gets one from the sampler's stream the first time a step samples at a temperature (`unseeded`), in
batch order on either path, so a seeded engine writes the same tokens whichever path a step takes."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.sequence import Sequence

GREEDY_TEMPERATURE = 1e-5  # SamplingParams.greedy's bound
EMPTY_SEEDS, EMPTY_POSITIONS = np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)


@dataclass(slots=True)
class SamplingBatch:
    """None in a field means the feature is off for every row, so the sampler skips it without looking."""
    all_greedy: bool
    greedy: np.ndarray | None  # [B] bool, only when some rows are greedy and some are not
    inv_temperature: np.ndarray | float  # [B] float64 (1 on greedy rows), or one value for every row
    top_k: np.ndarray | None  # [B] int64 (-1: off) and top_p [B] float64 (1: off), when some row uses either
    top_p: np.ndarray | None
    seeds: np.ndarray  # [B] uint64 (empty when all_greedy, like positions)
    unseeded: list[int]  # rows whose request has no seed yet: the sampler draws them
    positions: np.ndarray  # [B] int64: the output position of the token to draw
    penalized: list[int]  # rows with a repetition, frequency or presence penalty
    logprob_rows: list[int]  # rows that asked for logprobs
    logprob_tops: list[int]  # how many alternatives each of them asked for
    constrained: list[int] = ()  # rows whose output follows a grammar (structured output): masked first
    adjusted: list[int] = ()  # rows with a logit_bias or a min_tokens: the sampler checks which still apply
    min_p: np.ndarray | None = None  # [B] float64 (0: off), when some sampled row uses it

    @property
    def plain_greedy(self) -> bool:
        """Every row takes the argmax of the model's own logits: greedy, no logprobs, penalties, logit_bias,
        min_tokens or grammar. Such a decode batch takes its tokens from the decode graph (engine/cuda_graphs.py)
        and its logits are never cast to float32; the one rule both the plain and the launched step ask."""
        return self.all_greedy and not (self.logprob_rows or self.penalized or self.constrained or self.adjusted)

    def float32_rows(self) -> list[int] | None:
        """The rows whose transforms need their logits in float32, or None for every row: each that samples (its
        temperature, top-k/top-p, min_p and weights are defined in float32), and each with a penalty or an
        adjustment (a logit_bias or a quotient rounds otherwise in bf16). A greedy row that is only masked (a
        grammar's -inf) or asks for logprobs needs none: its argmax over bf16 logits is the argmax over their exact
        float32 widening, first maximum on ties alike, and its logprobs widen its row alone (Sampler._with_logprobs).
        """
        if self.all_greedy:
            return sorted({*self.penalized, *self.adjusted})
        if self.greedy is None:
            return None
        need = ~self.greedy
        need[list(self.penalized)] = need[list(self.adjusted)] = True  # list: a () index would be every row
        return None if need.all() else np.flatnonzero(need).tolist()

    def select(self, rows: list[int]) -> SamplingBatch:
        """The batch of `rows` alone, in that order, each list's row numbers renumbered. The paths the whole batch
        takes are kept (one temperature for every row stays one value; top-k/top-p arrays stay though no row kept
        uses them), so each kept row's transforms compute the values they compute in the whole batch."""
        at = {row: j for j, row in enumerate(rows)}
        kept = lambda found: [at[i] for i in found if i in at]  # noqa: E731
        lp = [(at[i], top) for i, top in zip(self.logprob_rows, self.logprob_tops) if i in at]
        lists = dict(penalized=kept(self.penalized), logprob_rows=[i for i, _ in lp],
                     logprob_tops=[top for _, top in lp], constrained=kept(self.constrained),
                     adjusted=kept(self.adjusted))
        index = np.asarray(rows, dtype=np.int64)
        greedy = None if self.greedy is None else self.greedy[index]
        if self.all_greedy or (greedy is not None and greedy.all()):
            return SamplingBatch(True, None, 1.0, None, None, EMPTY_SEEDS, [], EMPTY_POSITIONS, **lists)
        pick = lambda a: a if a is None or isinstance(a, float) else a[index]  # noqa: E731
        return SamplingBatch(False, greedy if greedy is not None and greedy.any() else None,
                             pick(self.inv_temperature), pick(self.top_k), pick(self.top_p), self.seeds[index],
                             kept(self.unseeded), self.positions[index], min_p=pick(self.min_p), **lists)

    @classmethod
    def of(cls, seqs: list[Sequence]) -> SamplingBatch:
        """From the sequences themselves: a step that is not decode-only."""
        params = [s.params for s in seqs]
        temps = np.array([p.temperature for p in params], dtype=np.float64)
        greedy = temps < GREEDY_TEMPERATURE
        all_greedy = bool(greedy.all())
        top_k = np.array([p.top_k for p in params], dtype=np.int64)
        top_p = np.array([p.top_p for p in params], dtype=np.float64)
        uses_top = bool(((top_k > 0) | (top_p < 1.0)).any())
        penalized = [i for i, p in enumerate(params) if p.penalized]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        lp_tops = [params[i].logprobs for i in lp_rows]
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        adjusted = [i for i, p in enumerate(params) if is_adjusted(p)]
        if all_greedy:
            return cls(True, None, 1.0, None, None, EMPTY_SEEDS, [], EMPTY_POSITIONS, penalized, lp_rows, lp_tops,
                       constrained, adjusted)
        seeds = np.array([s.sample_seed or 0 for s in seqs], dtype=np.uint64)
        unseeded = [i for i, s in enumerate(seqs) if s.sample_seed is None]
        positions = np.array([len(s.token_ids) - s.num_prompt_tokens for s in seqs], dtype=np.int64)
        inv = 1.0 / np.where(greedy, 1.0, temps)
        min_p = np.array([p.min_p for p in params], dtype=np.float64)
        return cls(False, greedy if greedy.any() else None, inv, top_k if uses_top else None,
                   top_p if uses_top else None, seeds, unseeded, positions, penalized, lp_rows, lp_tops, constrained,
                   adjusted, min_p if min_p.any() else None)


def is_adjusted(p: SamplingParams) -> bool:
    """A logit_bias, or a min_tokens that masks stop tokens while the output is shorter (sampler.apply_adjustments)."""
    return bool(p.logit_bias) or p.min_tokens > 0


class SamplingRows:
    """Each decode-input row's sampling parameters, written when a sequence claims the row and cleared when the
    row is freed. Counts over the rows held (their temperatures, how many use top-k/top-p, penalties or logprobs)
    let a step whose rows all sample alike skip gathering what none of them uses: after a forward has evicted the
    caches, each numpy operation on these small arrays costs more than its arithmetic."""

    def __init__(self, capacity: int) -> None:
        self.greedy = np.ones(capacity, dtype=bool)
        self.inv_temperature = np.ones(capacity, dtype=np.float64)
        self.top_k = np.full(capacity, -1, dtype=np.int64)
        self.top_p = np.ones(capacity, dtype=np.float64)
        self.penalized = np.zeros(capacity, dtype=bool)
        self.logprobs = np.full(capacity, -1, dtype=np.int64)  # -1: none asked
        self.first_output = np.zeros(capacity, dtype=np.int64)  # the input position whose next token is output 0
        self.seed = np.zeros(capacity, dtype=np.uint64)
        self.seeded = np.zeros(capacity, dtype=bool)  # False: drawn from the sampler's stream at first need
        self.constrained = np.zeros(capacity, dtype=bool)  # structured output: the row's tokens follow a grammar
        self.adjusted = np.zeros(capacity, dtype=bool)  # logit_bias or min_tokens
        self.min_p = np.zeros(capacity, dtype=np.float64)
        self.temperatures: Counter[float] = Counter()  # of the rows held; 0.0 stands for every greedy one
        self.num_top = self.num_penalized = self.num_logprobs = self.num_unseeded = self.num_constrained = 0
        self.num_adjusted = self.num_min_p = 0

    def write(self, row: int, seq: Sequence) -> None:
        p = seq.params
        greedy = p.temperature < GREEDY_TEMPERATURE
        self.greedy[row] = greedy
        self.inv_temperature[row] = 1.0 if greedy else 1.0 / p.temperature
        self.top_k[row], self.top_p[row] = p.top_k, p.top_p
        self.penalized[row] = p.penalized
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.first_output[row] = seq.num_prompt_tokens - 1
        self.seeded[row] = seq.sample_seed is not None
        self.seed[row] = seq.sample_seed or 0
        self.constrained[row] = seq.matcher is not None
        self.adjusted[row] = is_adjusted(p)
        self.min_p[row] = 0.0 if greedy else p.min_p
        self._count(row, 1)

    def clear(self, row: int) -> None:
        self._count(row, -1)

    def _count(self, row: int, n: int) -> None:
        key = 0.0 if self.greedy[row] else float(self.inv_temperature[row])
        self.temperatures[key] += n
        if not self.temperatures[key]:
            del self.temperatures[key]
        self.num_top += n * bool(self.top_k[row] > 0 or self.top_p[row] < 1.0)
        self.num_penalized += n * bool(self.penalized[row])
        self.num_logprobs += n * bool(self.logprobs[row] >= 0)
        self.num_unseeded += n * (not self.seeded[row])
        self.num_constrained += n * bool(self.constrained[row])
        self.num_adjusted += n * bool(self.adjusted[row])
        self.num_min_p += n * bool(self.min_p[row] > 0.0)

    def gather(self, rows: np.ndarray, positions: np.ndarray, seqs: list[Sequence]) -> SamplingBatch:
        """The batch of a decode-only step: `rows` its decode-input rows, `positions` each row's input position
        (its last token's), `seqs` its sequences in the same order."""
        penalized = np.flatnonzero(self.penalized[rows]).tolist() if self.num_penalized else []
        lp_rows, lp_tops = [], []
        if self.num_logprobs:
            asked = self.logprobs[rows]
            lp_index = np.flatnonzero(asked >= 0)
            lp_rows, lp_tops = lp_index.tolist(), asked[lp_index].tolist()
        constrained = np.flatnonzero(self.constrained[rows]).tolist() if self.num_constrained else []
        adjusted = np.flatnonzero(self.adjusted[rows]).tolist() if self.num_adjusted else []
        if len(self.temperatures) == 1:  # every row held, so every row of this batch, at one temperature
            inv_temperature, greedy = next(iter(self.temperatures)), None
            all_greedy = inv_temperature == 0.0
        else:
            greedy = self.greedy[rows]
            all_greedy, inv_temperature = bool(greedy.all()), self.inv_temperature[rows]
            greedy = greedy if greedy.any() else None
        if all_greedy:
            return SamplingBatch(True, None, 1.0, None, None, EMPTY_SEEDS, [], EMPTY_POSITIONS, penalized, lp_rows,
                                 lp_tops, constrained, adjusted)
        top_k = top_p = None
        if self.num_top:
            top_k, top_p = self.top_k[rows], self.top_p[rows]
            if not ((top_k > 0) | (top_p < 1.0)).any():
                top_k = top_p = None
        min_p = self.min_p[rows] if self.num_min_p else None
        return SamplingBatch(False, greedy, inv_temperature, top_k, top_p, *self._seeds(rows, seqs),
                             positions - self.first_output[rows], penalized, lp_rows, lp_tops, constrained, adjusted,
                             min_p if min_p is not None and min_p.any() else None)

    def _seeds(self, rows: np.ndarray, seqs: list[Sequence]) -> tuple[np.ndarray, list[int]]:
        """The rows' seeds, and the rows still without one; a seed the sampler drew since is written down here."""
        seeds, unseeded = self.seed[rows], []
        if self.num_unseeded:
            for i in np.flatnonzero(~self.seeded[rows]).tolist():
                seed = seqs[i].sample_seed
                if seed is None:
                    unseeded.append(i)
                else:
                    seeds[i] = self.seed[rows[i]] = seed
                    self.seeded[rows[i]] = True
                    self.num_unseeded -= 1
        return seeds, unseeded
