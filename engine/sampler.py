"""Batched sampling: every transform is a tensor operation over the whole batch and the step ends with one
device-to-host transfer.

A structured-output row's logits are first masked to what its grammar allows (engine/constraints.py: -inf
elsewhere), so every later transform and greedy's argmax see only allowed tokens. Then OpenAI's logit_bias and
vLLM's min_tokens (stop tokens at -inf while the output is shorter), in vLLM's order: before penalties, so greedy
rows take the argmax of the biased logits. Then penalties (repetition with HF's rule over prompt and output;
OpenAI's frequency and presence over the output), then temperature, top-k and top-p, then min_p (on the tempered
weights, as vLLM applies it), then inverse-CDF sampling with one uniform number per row (`inverse_cdf`).
A batch using none of these pays one check of an empty list (or None) per transform per step.
Logits in a narrower dtype than float32 (a bf16 model's) are widened only where a transform needs it: the rows that
sample, are penalized or adjusted (SamplingBatch.float32_rows) get a float32 copy and are sampled as in a batch of
their own, which draws what the whole batch widened would (every transform and draw is per row); the other rows
take the argmax of the logits as they are, exact (a widening cast keeps the order, first maximum on ties alike).
That number is a hash of the row's seed and its output position, so a seeded request draws the same tokens
whatever else is in the batch, and no per-row torch.Generator (and no per-row host sync) is needed. Requests
without a seed get one from the engine's seeded stream when first sampled. Logprobs are the model's own
distribution, before any transform. On the CPU the argmax runs in numpy (vectorized where torch's CPU kernel for
this shape is not) and the uniform numbers and inverse CDF in one compiled call (kernels/cpu_sample.py; its numpy
twin here where numba is missing); on a GPU everything stays on the device."""
from __future__ import annotations

import logging
import random
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvgate.engine.constraints import TokenMasks
from kvgate.engine.sampling_rows import SamplingBatch
from kvgate.engine.sequence import Sequence

log = logging.getLogger("kvgate.engine")
MASK32 = np.uint64(0xFFFFFFFF)
SEED_BITS = (1 << 62) - 1
CHUNK = 32  # tokens per first-level chunk of inverse_cdf (the twin)
LOG2_E = 1.4426950408889634
WIDE = (torch.float32, torch.float64)  # logits the sampler transforms as they are; narrower ones are widened by row
INF_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}  # +inf's bits: above it, NaN


def mix32(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer hash (lowbias32) on uint32, in place: its products wrap as the hash's do."""
    x ^= x >> 16
    x *= np.uint32(0x7FEB352D)
    x ^= x >> 15
    x *= np.uint32(0x846CA68B)
    x ^= x >> 16
    return x


def uniform_for(seeds: np.ndarray | list[int], positions: np.ndarray | list[int]) -> np.ndarray:
    """A number in (0, 1) per row from (seed, position) alone: float64 from 48 hashed bits. Host-side numpy:
    the seeds and positions live on the host, and a few vector ops on B numbers cost microseconds there."""
    s = np.asarray(seeds, dtype=np.uint64)
    h = mix32((s & MASK32).astype(np.uint32) ^ mix32((s >> 32).astype(np.uint32) ^ position_hashes(positions)))
    lo = mix32(h ^ np.uint32(0x5BD1E995))
    return (h * 65536.0 + (lo >> 16) + 0.5) * 2.0 ** -48  # exact in float64: h * 2^16 + 16 bits < 2^48


_POSITION_HASHES = [mix32(np.arange(4096, dtype=np.uint32))]


def position_hashes(positions: np.ndarray | list[int]) -> np.ndarray:
    """mix32 of each position, from a table: a lookup instead of nine numpy operations a step."""
    positions = np.asarray(positions)
    try:
        return _POSITION_HASHES[0][positions]
    except IndexError:  # a longer output than any before: a table past it
        _POSITION_HASHES[0] = mix32(np.arange(2 * int(positions.max()) + 1, dtype=np.uint32))
        return _POSITION_HASHES[0][positions]


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's first maximal index (int64, into `out` when given). On the CPU torch's argmax over the last
    dimension is a scalar loop (0.6 ms for [256, 1,024] on one thread, W-HOST) where numpy's is vectorized
    (0.03 ms); both take the first maximum (and a NaN as the maximum), so the tokens are the same. 16-bit logits
    (a bf16 model's greedy rows) go through `half_argmax`."""
    if logits.device.type == "cpu" and logits.dtype in WIDE:
        if out is None:
            return torch.from_numpy(logits.numpy().argmax(-1))
        logits.numpy().argmax(-1, out=out.numpy())
        return out
    if logits.device.type == "cpu" and logits.dtype in INF_BITS and logits.dim() == 2 and logits.is_contiguous():
        index = half_argmax(logits)
        return torch.from_numpy(index) if out is None else out.copy_(torch.from_numpy(index))
    return torch.argmax(logits, -1, out=out) if out is not None else logits.argmax(-1)


def half_argmax(logits: torch.Tensor) -> np.ndarray:
    """torch's argmax of 16-bit logits [B, V] on the CPU, vectorized (torch's is a scalar loop: 35-70 ms against
    3 ms here for [64, 151,936] bf16 on one thread). Their bits as int16, a negative value's magnitude bits flipped,
    are ordered as the floats are but for -0 (one below +0, equal as floats) and NaN (the maximum for torch, first
    one wins whatever its payload or sign); the rows whose maximum could be either (+0, a NaN) take torch's."""
    bits = logits.view(torch.int16).numpy()
    key = bits >> 15  # -1 where negative
    key &= np.int16(0x7FFF)
    key ^= bits
    index = key.argmax(-1)
    top = key[np.arange(key.shape[0]), index]
    inf = INF_BITS[logits.dtype]
    odd = (top == 0) | (top > inf) | (key.min(-1) < -inf - 1)  # +0 (a -0 before it ties), +NaN, -NaN
    if odd.any():
        rows = np.flatnonzero(odd)
        index[rows] = logits[torch.from_numpy(rows)].argmax(-1).numpy()
    return index


def to_device(array: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host array on the sampler's device without waiting for it: a copy from pageable memory is staged before
    the call returns, so the host never stalls on the work queued before it (a step launched ahead,
    engine/overlap.py, would stall on the step in flight)."""
    return torch.from_numpy(array).to(device, dtype, non_blocking=True)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """In place on `logits` rows `rows`: repetition (HF: divide positive scores of every token seen in prompt or
    output, multiply negative ones), then frequency and presence (OpenAI: subtract per output occurrence, and
    once per token that occurred)."""
    vocab, dev = logits.shape[1], logits.device
    index = torch.tensor(rows, device=dev)
    sub = logits[index]
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=dev)
    counts = torch.zeros(len(rows), vocab, dtype=sub.dtype, device=dev)
    rep, freq, pres = [], [], []
    for j, i in enumerate(rows):
        seq, p = seqs[i], seqs[i].params
        seen[j, torch.tensor(seq.token_ids, dtype=torch.long, device=dev)] = True
        out = seq.token_ids[seq.num_prompt_tokens:]
        if out:
            counts[j].index_add_(0, torch.tensor(out, dtype=torch.long, device=dev),
                                 torch.ones(len(out), dtype=sub.dtype, device=dev))
        rep.append(p.repetition_penalty)
        freq.append(p.frequency_penalty)
        pres.append(p.presence_penalty)
    rep_t = torch.tensor(rep, dtype=sub.dtype, device=dev)[:, None]
    penalized = torch.where(sub < 0, sub * rep_t, sub / rep_t)
    sub = torch.where(seen, penalized, sub)
    sub -= torch.tensor(freq, dtype=sub.dtype, device=dev)[:, None] * counts
    sub -= torch.tensor(pres, dtype=sub.dtype, device=dev)[:, None] * (counts > 0).to(sub.dtype)
    logits[index] = sub


def apply_adjustments(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """In place on `logits` rows `rows`: each row's logit_bias added (OpenAI's), then, while its output is shorter
    than its min_tokens, its stop tokens (EOS unless ignore_eos, and stop_token_ids) set to -inf (vLLM's). A
    structured row's grammar decides where it ends: masking the EOS a complete grammar allows alone would leave it
    no allowed token."""
    bias_rows, bias_ids, bias = [], [], []
    ban_rows, ban_ids = [], []
    for i in rows:
        seq = seqs[i]
        p = seq.params
        if p.logit_bias:
            bias_rows += [i] * len(p.logit_bias)
            bias_ids += p.logit_bias.keys()
            bias += p.logit_bias.values()
        if seq.num_output_tokens < p.min_tokens and seq.stop_ids and seq.matcher is None:
            ban_rows += [i] * len(seq.stop_ids)
            ban_ids += seq.stop_ids
    dev = logits.device
    if bias_rows:
        logits.index_put_((torch.tensor(bias_rows, device=dev), torch.tensor(bias_ids, device=dev)),
                          torch.tensor(bias, dtype=logits.dtype, device=dev), accumulate=True)
    if ban_rows:
        logits[torch.tensor(ban_rows, device=dev), torch.tensor(ban_ids, device=dev)] = float("-inf")


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """HF's TopK then TopP warpers over a batch [B, V]: per-row k (<= 0 or >= V: off) and p (1: off); masked
    logits are -inf and each row's most likely token always survives."""
    vocab = logits.shape[1]
    ascending, order = torch.sort(logits, dim=-1)
    k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    kth = ascending.gather(1, (vocab - k).long()[:, None])
    ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    cumulative = ascending.softmax(-1).cumsum(-1)
    remove = (cumulative <= (1 - top_p)[:, None]) & (top_p < 1)[:, None]
    remove[:, -1] = False
    ascending = ascending.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ascending)


def inverse_cdf(weights: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Per row of `weights` [B, V] (float32, non-negative, each row's largest about 1), the first token whose
    cumulative weight exceeds u (float64, in (0, 1)) times the row's total. In two levels, sums of CHUNK-token
    chunks and then the one chunk holding the target, so no cumulative sum runs the whole vocabulary (a cumsum over
    [256, 1,024] alone takes 0.24 ms on one CPU thread) and the rest are numpy operations on [B, V / CHUNK]. Each
    row is computed on its own, so a seeded row's token ignores its batch."""
    rows, vocab = weights.shape
    if vocab % CHUNK:
        weights = np.pad(weights, ((0, 0), (0, CHUNK - vocab % CHUNK)))
    chunks = weights.reshape(rows, -1, CHUNK)
    sums = np.einsum("rck->rc", chunks)  # numpy's sum over a short last axis is 5x slower
    cum = np.zeros((rows, sums.shape[1] + 1))
    sums.cumsum(1, dtype=np.float64, out=cum[:, 1:])
    # u < 1, so target < the row's total (> 0: its largest weight is about 1) and chunk k is never empty
    target = (u * cum[:, -1])[:, None]
    k = (cum[:, 1:] <= target).sum(1)
    each = np.arange(rows)
    chunk = chunks[each, k]
    j = (chunk.cumsum(1, dtype=np.float64) + cum[each, k][:, None] <= target).sum(1)
    if j.max() == CHUNK:  # a float32 chunk sum rounded above its float64 cumsum: take its last positive token
        over = np.flatnonzero(j == CHUNK)
        j[over] = [np.flatnonzero(chunk[i]).max() for i in over.tolist()]
    return k * CHUNK + j


def compiled_sampler() -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray] | None:
    """kernels/cpu_sample.py's `sample_rows`, or None where numba cannot be imported (the twin below serves)."""
    try:
        from kvgate.kernels.cpu_sample import sample_rows
    except ImportError as e:
        log.warning("numba is not importable (%s): the CPU sampler uses its numpy twin, ~0.5 ms more a step at "
                    "batch 256; pip install numba", e)
        return None
    return sample_rows


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu", vocab_size: int | None = None) -> None:
        self.vocab_size = vocab_size  # the logits' width, where known before the first step (structured output)
        self.seeds = random.Random(seed)  # for requests that did not give one
        self.device = device
        self.buffer: torch.Tensor | None = None  # scratch for the temperature path's weights
        self.cpu_rows = compiled_sampler() if torch.device(device).type == "cpu" else None
        self.masks: TokenMasks | None = None  # made at the first step with a structured-output row
        self._filler: ThreadPoolExecutor | None = None  # fills a step's mask while its forward runs
        self._filling: tuple[list[Sequence], list[int], Future] | None = None

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], batch: SamplingBatch | None = None,
                 consume: bool = False, argmax: torch.Tensor | None = None
                 ) -> tuple[list[int], list[dict[int, float] | None]]:
        """Next token for each row of `logits` [B, V] (float32, or the model's bf16: see the module), and logprobs
        for the rows that asked. `batch`: the rows' parameters as arrays (a decode step's, kept per row by the
        runner); without it they are read from `seqs`. `consume`: the caller has no further use for `logits`, so
        the temperature path may write its weights over them (the runner's fresh logits each step), touching a
        megabyte less of the cache. `argmax`: each row's argmax of `logits` as given, computed already (a decode
        graph's), see `sample`."""
        if batch is None:
            batch = SamplingBatch.of(seqs)
        tokens = self.sample(logits, seqs, batch, consume, argmax=argmax)
        if not batch.logprob_rows:
            return tokens.tolist(), [None] * len(seqs)
        return self._with_logprobs(logits, tokens, batch.logprob_rows, batch.logprob_tops)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], batch: SamplingBatch, consume: bool = False,
               out: torch.Tensor | None = None, argmax: torch.Tensor | None = None) -> torch.Tensor:
        """The next tokens [B], left on the logits' device: no transfer, so a step launched ahead (engine/overlap.py)
        feeds them to the next step's inputs there, written by the last operation into `out` where given (the
        token buffer the next step reads); `logits` stay the model's own where logprob rows need them. `argmax`
        (a decode graph's, of these logits before any mask): the greedy rows' tokens of a batch in a narrower dtype,
        so those rows' logits are not read again; unused where a grammar masks a row."""
        raw = logits
        if batch.constrained:  # before everything else; the logprobs stay the model's own
            if batch.logprob_rows or not consume:
                logits = logits.clone()
            self.mask(logits, seqs, batch.constrained)
        if logits.dtype not in WIDE:
            rows = batch.float32_rows()
            if rows is not None and len(rows) < logits.shape[0]:
                return self._sample_rows_in_float32(logits, seqs, batch, rows, out,
                                                    None if batch.constrained else argmax)
            logits = logits.float()  # every row needs it: one cast, a copy of the caller's nothing reads after
        if batch.adjusted:
            if logits is raw and (batch.logprob_rows or not consume):
                logits = logits.clone()
            apply_adjustments(logits, seqs, batch.adjusted)
        if batch.penalized:
            logits = logits.clone() if logits is raw else logits
            apply_penalties(logits, seqs, batch.penalized)
        if batch.all_greedy:
            return argmax_rows(logits, out)
        # weights may overwrite logits nothing reads after: a penalized copy, or the caller's without logprobs
        spare = batch.greedy is None and (logits is not raw or (consume and not batch.logprob_rows))
        return self._sample(logits, seqs, batch, spare, out)

    def _sample_rows_in_float32(self, logits: torch.Tensor, seqs: list[Sequence], batch: SamplingBatch,
                                rows: list[int], out: torch.Tensor | None, argmax: torch.Tensor | None
                                ) -> torch.Tensor:
        """A batch in a narrower dtype (bf16) where only `rows` need float32 (SamplingBatch.float32_rows): those
        rows alone are widened and sampled, each as it would be in the whole batch widened; every other row takes
        the argmax of the logits as they are (masked already), exact, so greedy rows cost a read of their bf16
        and no float32 copy (or none: `argmax` given). Seeds are drawn first over the whole batch, in its order, as
        the whole batch draws."""
        if argmax is None:
            tokens = argmax_rows(logits, out)
        elif out is None:
            tokens = argmax.clone()  # the graph's buffer is overwritten by its next replay
        else:  # a launched step: `out` is where the graph wrote its argmax (DecodeInputs.tokens), or a copy of it
            tokens = out if out.data_ptr() == argmax.data_ptr() else out.copy_(argmax)
        if not rows:
            return tokens
        if not batch.all_greedy:
            self._draw_seeds(seqs, batch)
        index = to_device(np.asarray(rows, dtype=np.int64), logits.device)
        part = batch.select(rows)
        part.constrained = []  # masked already, above
        part.logprob_rows, part.logprob_tops = [], []  # taken from the caller's logits (Sampler.__call__)
        sampled = self.sample(logits.index_select(0, index).float(), [seqs[i] for i in rows], part, consume=True)
        return tokens.index_copy_(0, index, sampled)

    def start_mask(self, seqs: list[Sequence], rows: list[int]) -> None:
        """Begin filling the mask of `rows` of `seqs` on another thread (llguidance's executor works without the
        GIL), so that it overlaps the step's forward; `mask` then takes it. The matchers do not move meanwhile: only
        this step's sampling advances them."""
        if self.masks is None:
            vocab = self.vocab_size
            if vocab is None:
                return  # unknown until the first logits: this step fills at sampling time
            self.masks = TokenMasks(vocab)
        if self._filler is None:
            self._filler = ThreadPoolExecutor(1, thread_name_prefix="kvgate-mask")
        self._filling = (seqs, rows, self._filler.submit(self.masks.fill, [seqs[i].matcher for i in rows]))

    def mask(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        """In place: each constrained row's logits outside what its grammar allows next become -inf."""
        if self.masks is None:
            self.masks = TokenMasks(logits.shape[1])
        filling, self._filling = self._filling, None
        if filling is not None and filling[0] is seqs and filling[1] == rows:
            self.masks.apply(logits, rows, filling[2].result())
        else:
            if filling is not None:
                filling[2].result()  # never two fills of one buffer at once
            self.masks.mask(logits, rows, [seqs[i].matcher for i in rows])

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], batch: SamplingBatch, spare: bool,
                out: torch.Tensor | None) -> torch.Tensor:
        dev = logits.device
        if batch.top_k is not None:
            scaled = apply_top_k_top_p(logits * self._per_row(batch.inv_temperature, logits),
                                       to_device(batch.top_k, dev), to_device(batch.top_p, dev, logits.dtype))
            weights = scaled.sub_(scaled.amax(-1, keepdim=True)).exp_()
        else:  # softmax(logits / T) up to each row's total, into a buffer kept between steps
            scratch = logits if spare else self._scratch(logits)
            weights = self._exponent(logits, self._per_row(batch.inv_temperature * LOG2_E, logits), scratch).exp2_()
        if batch.min_p is not None:  # each row's largest weight is 1: drop those under min_p of it
            weights.masked_fill_(weights < to_device(batch.min_p, dev, weights.dtype)[:, None], 0.0)
        self._draw_seeds(seqs, batch)
        if dev.type == "cpu":
            w = weights.float().numpy()
            sampled = torch.from_numpy(self.cpu_rows(w, batch.seeds, batch.positions) if self.cpu_rows  # one call
                                       else inverse_cdf(w, uniform_for(batch.seeds, batch.positions)))
        else:  # on a GPU the whole-vocabulary cumsum is one fast kernel
            u = uniform_for(batch.seeds, batch.positions)
            cdf = weights.cumsum(-1)
            target = (to_device(u, dev) * cdf[:, -1].double()).to(cdf.dtype)[:, None]
            sampled = torch.clamp(torch.searchsorted(cdf, target, right=True).squeeze(1), max=logits.shape[1] - 1,
                                  out=out if batch.greedy is None else None)
        if batch.greedy is not None:
            return torch.where(to_device(batch.greedy, dev), argmax_rows(logits), sampled, out=out)
        if out is None or sampled is out:
            return sampled
        return out.copy_(sampled)  # the CPU's tokens, drawn in numpy

    @staticmethod
    def _exponent(logits: torch.Tensor, scale: torch.Tensor | float, out: torch.Tensor) -> torch.Tensor:
        """(x - max) * scale per row, whose 2^ is e^((x - max) / T) (torch's CPU exp2 takes 0.7x the time of its
        exp). One temperature for every row takes one pass over [B, V] instead of two: fma(scale, x, -max * scale)
        (torch's vectorized add with alpha is a fused multiply-add), where the rounding of max * scale is the same
        for the whole row and so scales all of its weights alike, which an inverse CDF does not see."""
        top = logits.amax(-1, keepdim=True)
        if isinstance(scale, float):
            return torch.add(top.mul_(-scale), logits, alpha=scale, out=out)
        return torch.sub(logits, top, out=out).mul_(scale)

    @staticmethod
    def _per_row(values: np.ndarray | float, like: torch.Tensor) -> torch.Tensor | float:
        """A [B, 1] factor for `like`'s rows, or the one value every row shares (as like's dtype rounds it)."""
        if isinstance(values, float):
            exact = like.dtype in (torch.float32, torch.float64)  # a CPU scalar is rounded to them as a tensor is
            return values if exact else torch.tensor(values, dtype=like.dtype).item()
        return to_device(values, like.device, like.dtype)[:, None]

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A [B, V] buffer like `like`, kept: a fresh megabyte each step costs the CPU its page faults each time.
        Made again when the shape, dtype or device changes, or inference mode (an inference tensor can be written
        only inside it)."""
        buf, rows = self.buffer, like.shape[0]
        if (buf is None or buf.shape[0] < rows or buf.shape[1:] != like.shape[1:] or buf.dtype != like.dtype
                or buf.device != like.device or buf.is_inference() != torch.is_inference_mode_enabled()):
            buf = self.buffer = torch.empty_like(like)
        return buf[:rows]

    def _draw_seeds(self, seqs: list[Sequence], batch: SamplingBatch) -> None:
        """Each unseeded row's seed, in row order; a row drawn already keeps its seed (no second draw)."""
        for i in batch.unseeded:
            batch.seeds[i] = self._seed_of(seqs[i])

    def _seed_of(self, seq: Sequence) -> int:
        if seq.sample_seed is None:
            seed = seq.params.seed
            seq.sample_seed = (self.seeds.getrandbits(62) if seed is None else seed) & SEED_BITS
        return seq.sample_seed

    @staticmethod
    def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: list[int], tops: list[int]):
        """One transfer: the tokens, each asking row's chosen logprob and its top alternatives, packed together."""
        index = torch.tensor(rows, device=raw.device)
        logp = raw[index].float().log_softmax(-1)  # these rows alone widened: the model's own, exactly
        chosen = logp.gather(1, tokens[index][:, None]).squeeze(1)
        k = max(tops)
        values, ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
        packed = torch.cat([tokens.double(), chosen.double(), values.double().flatten(), ids.double().flatten()])
        flat = packed.tolist()
        n, r = len(tokens), len(rows)
        token_list = [int(t) for t in flat[:n]]
        top_v, top_i = flat[n + r:n + r + r * k], flat[n + r + r * k:]
        out: list[dict[int, float] | None] = [None] * n
        for j, (i, top) in enumerate(zip(rows, tops)):
            lp = {token_list[i]: flat[n + j]}
            for v, t in zip(top_v[j * k:j * k + top], top_i[j * k:j * k + top]):
                lp.setdefault(int(t), v)
            out[i] = lp
        return token_list, out
