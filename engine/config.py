"""Engine settings shared by `LLM` and `LLMEngine`, validated where they are made."""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULING_POLICIES = ("continuous", "static")


@dataclass(slots=True)
class EngineConfig:
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes; None: sized from the device
    enable_prefix_caching: bool = True
    scheduling: str = "continuous"
    seed: int = 0
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (on a CPU there are none anyway)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len={self.max_model_len!r} must be a positive integer or None")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory!r} must be a positive number of bytes or None")
        if self.scheduling not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling={self.scheduling!r} must be one of {SCHEDULING_POLICIES}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r} must be 'auto', 'float32', 'float16' or 'bfloat16'")
