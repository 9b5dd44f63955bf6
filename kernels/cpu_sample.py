"""The temperature sampler's host half on the CPU as compiled loops (numba): each row's uniform number from its seed
and output position, then the inverse CDF over its weights.

Their numpy twins (`uniform_for` and `inverse_cdf` in engine/sampler.py) make ~40 numpy calls a step, and after a
forward has evicted the caches each call costs 9-15 us whatever its size: at batch 256 that was most of what a
temperature step cost over a greedy one. Here it is one call. The uniform numbers are the twin's bit for bit, so
a seeded request draws the same tokens either way; the inverse CDF sums in other groups (float32 sums of 256 and
16 tokens, float64 beyond), so the two can differ only where u lands within rounding of a boundary
(tests/kernels/test_cpu_sample.py checks both against a whole-vocabulary float64 CDF).

The sums are vectorized reductions (fastmath's reassociation only): the same binary on the same CPU always sums
in the same order, so a seed's tokens are reproducible there; another CPU's vector width may round a sum
differently, with the same measure-zero effect. Importing this module compiles the kernels (from numba's cache
after the first time, ~1 s, mostly numba's own start), so the sampler imports it only when it samples on the
CPU, and keeps the twins where numba cannot be imported (a Python it does not support yet)."""
from __future__ import annotations

import numba
import numpy as np

CHUNK, BLOCK = 256, 16  # tokens per first-level chunk and per second-level block
# uint64 constants throughout: numba types a uint64 mixed with a signed integer as float64
M32, S15, S16, S32 = np.uint64(0xFFFFFFFF), np.uint64(15), np.uint64(16), np.uint64(32)
K1, K2, K3 = np.uint64(0x7FEB352D), np.uint64(0x846CA68B), np.uint64(0x5BD1E995)


def _mix32(x):
    """lowbias32 on a uint32 held in a uint64: products are masked back to 32 bits, as uint32 arithmetic wraps."""
    x ^= x >> S16
    x = (x * K1) & M32
    x ^= x >> S15
    x = (x * K2) & M32
    x ^= x >> S16
    return x


def _uniform(seed, position):
    """uniform_for of one row: a number in (0, 1) from 48 hashed bits, exact in float64."""
    h = _mix32((seed & M32) ^ _mix32((seed >> S32) ^ _mix32(position & M32)))
    lo = _mix32(h ^ K3)
    return (np.float64(h) * 65536.0 + np.float64(lo >> S16) + 0.5) * 2.0 ** -48


def _sum32(row, start, end):
    """float32 lanes vectorize (float64 ones take 3x as long); every cumulative is float64. The zero-based range
    is what LLVM vectorizes: over range(start, end) numba's loop stays scalar (6x slower)."""
    s = np.float32(0.0)
    for k in range(end - start):
        s += row[start + k]
    return s


def _last_positive(row, start, end):
    t = end - 1
    while t > start and not row[t] > 0:
        t -= 1
    return t


def _pick(row, u, sums):
    """The first token of `row` whose cumulative weight exceeds u times the row's total, found in three levels
    (CHUNK-token chunks, BLOCK-token blocks of the chunk that holds the target, the tokens of one block), so no
    long dependent chain of adds runs. `sums` is scratch for the row's chunk sums."""
    vocab = row.shape[0]
    chunks = (vocab + CHUNK - 1) // CHUNK
    total = 0.0
    for c in range(chunks):
        sums[c] = _sum32(row, c * CHUNK, min(vocab, (c + 1) * CHUNK))
        total += sums[c]
    target = u * total
    below, c = 0.0, 0
    while c < chunks - 1 and below + sums[c] <= target:  # u < 1: the last chunk always holds the target
        below += sums[c]
        c += 1
    t, end = c * CHUNK, min(vocab, (c + 1) * CHUNK)
    while t + BLOCK < end:
        s = _sum32(row, t, t + BLOCK)
        if below + s > target:
            break
        below += s
        t += BLOCK
    while t < end:
        below += row[t]
        if below > target and row[t] > 0:
            break
        t += 1
    return t if t < end else _last_positive(row, c * CHUNK, end)  # rounding ran past the chunk: its last token


def _uniforms(seeds, positions):
    """uniform_for's numbers, bit for bit: one in (0, 1) per row from its seed and output position."""
    out = np.empty(seeds.shape[0], dtype=np.float64)
    for r in range(seeds.shape[0]):
        out[r] = _uniform(np.uint64(seeds[r]), np.uint64(positions[r]))
    return out


def _inverse_cdf(weights, u):
    """inverse_cdf's tokens for the uniform numbers `u` (float64), one per row of `weights`."""
    out = np.empty(weights.shape[0], dtype=np.int64)
    sums = np.empty((weights.shape[1] + CHUNK - 1) // CHUNK, dtype=np.float64)
    for r in range(weights.shape[0]):
        out[r] = _pick(weights[r], u[r], sums)
    return out


_inline = numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
_mix32, _uniform, _sum32, _last_positive = (_inline(f) for f in (_mix32, _uniform, _sum32, _last_positive))
_pick = numba.njit(cache=True, nogil=True, fastmath={"reassoc"}, inline="always")(_pick)


def _jit(signature: str):
    return numba.njit(signature, cache=True, nogil=True, fastmath={"reassoc"})


# Compiled now for these types alone: a call with others fails at once instead of compiling again mid-step.
uniforms = _jit("float64[::1](uint64[::1], int64[::1])")(_uniforms)
inverse_cdf = _jit("int64[::1](float32[:, ::1], float64[::1])")(_inverse_cdf)


@_jit("int64[::1](float32[:, ::1], uint64[::1], int64[::1])")
def sample_rows(weights, seeds, positions):
    """The sampled token of each row of `weights` [B, V] (float32, C-contiguous, non-negative, each row's largest
    about 1) for the rows' seeds (uint64) and output positions (int64): one call a step (the two inside are
    native calls)."""
    return inverse_cdf(weights, uniforms(seeds, positions))
