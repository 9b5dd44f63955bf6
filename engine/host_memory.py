"""Host memory of an engine on the CPU: the C library's allocator keeps what a step frees for the next step.

A step on the CPU allocates large temporaries (activations, logits, the LoRA twin's segments) and frees them. By
default glibc serves an allocation above a sliding threshold with a fresh mmap and hands the top of its heap back to
the kernel on free: every step then faults in fresh zeroed pages. On W-LORA's engine half (a short run of 32 of
W-CPU's requests) each round took 200,000-290,000 minor faults, in the base model's rounds and the adapters' alike,
and the adapters' rounds slowed round after round. With allocations up to MMAP_THRESHOLD served from the heap and
freed memory kept, the same rounds took none and the base model's ran about 10% faster. The cost: the process keeps
its high-water mark of host memory, a worker's steady state anyway.

The setting is the process's, so the first engine on the CPU makes it, once; where the user set glibc's own knobs
(MALLOC_*_ environment variables, GLIBC_TUNABLES) or the C library is not glibc, nothing is changed."""
from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger("kvgate.engine")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit: up to it from the heap, above it mmapped and unmapped on free
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: the heap's top is handed back only past 2 GiB free
USER_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")

_kept = False


def keep_freed_memory() -> bool:
    """Whether freed host memory is kept for reuse in this process (set now, or already)."""
    global _kept
    if _kept:
        return True
    if not sys.platform.startswith("linux") or any(k in os.environ for k in USER_KNOBS):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl and others: no glibc mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _kept = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if _kept:
        log.info("host memory a step frees is kept for the next (glibc mmap threshold %d MiB)", MMAP_THRESHOLD >> 20)
    return _kept
