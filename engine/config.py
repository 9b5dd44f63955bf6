"""Engine settings, declared once: `LLM`, `LLMEngine` and the worker (its flags and KVGATE_* variables) all use
these fields, defaults and descriptions. Invalid values raise pydantic's ValidationError, a ValueError."""
from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator

SCHEDULING_POLICIES = ("continuous", "static")
DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICE_PATTERN = r"auto|cpu|mps|cuda(:\d+)?"


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    device: str = Field("auto",
                        description="where the model runs: auto (cuda when available, else cpu), cpu, cuda, cuda:N")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="weights and KV cache dtype; auto: the model's half type on cuda, float32 on cpu")
    max_num_seqs: int = Field(256, ge=1, description="most sequences running at once (the batch cap)")
    # 8,192 until a GPU measures otherwise (issue 41): nano-vllm and Mini-SGLang use 16,384; `kvgate bench engine
    # --workload gpu --prefill-budget-sweep 2048,4096,8192,16384` gives each budget's tok/s and prefill step time on
    # W-GPU, and the default moves to the best there. On a CPU a step's cost grows with its tokens, so no CPU figure
    # can choose it.
    max_num_batched_tokens: int = Field(8192, ge=1, description="token budget of one engine step")
    max_model_len: int | None = Field(None, ge=1, description="longest prompt + output; unset: the model's own limit")
    block_size: int = Field(16, ge=1, description="tokens per KV cache block")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0,
                                          description="share of GPU memory the engine may fill, KV cache included")
    kv_cache_memory: ByteSize | None = Field(
        None, description="KV cache size, e.g. 2GiB, 512MiB or bytes; unset: sized from gpu_memory_utilization "
                          "on cuda, at most 1GiB on cpu")
    enable_prefix_caching: bool = Field(True, description="reuse the KV blocks of prompt prefixes seen before")
    scheduling: Literal["continuous", "static"] = Field(
        "continuous", description="continuous batching, or static (fill a batch, run it out) as a baseline")
    seed: int = Field(0, description="seed for random weights and unseeded sampling")
    grammar_compile_timeout_s: float = Field(
        10.0, gt=0.0, description="seconds a structured-output constraint may take to compile before its request "
                                  "is answered with an error")
    grammar_threads: int = Field(2, ge=1, description="threads that compile structured-output constraints")
    jump_forward: bool = Field(True, description="append the tokens a structured-output grammar forces (a JSON "
                                                 "key, its quotes and colon) in one step instead of a forward each")
    enforce_eager: bool = Field(False, description="run decode steps eagerly, without CUDA graphs (a CPU has none)")
    max_loras: int = Field(0, ge=0, description="LoRA adapters the device holds at once, each in a slot of one step's "
                                               "batch; 0: LoRA off (no adapter layers)")
    max_lora_rank: int = Field(16, ge=1, description="the largest LoRA rank served; an adapter above it is refused")
    max_cpu_loras: int | None = Field(None, ge=1, description="LoRA adapters kept in host memory, ready for a slot "
                                                               "(adding one more drops the oldest unused); unset: "
                                                               "every adapter added")
    overlap: Literal["auto", "on", "off"] = Field(
        "auto", description="launch a decode step before the previous one's tokens are read, so the host's work "
                            "overlaps the device's (a stopped sequence is found a step late; its extra token is "
                            "dropped); auto: on for cuda, off for cpu, whose cores do both")

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not re.fullmatch(DEVICE_PATTERN, value):
            raise ValueError("must be auto, cpu, mps, cuda or cuda:N")
        return value

    @field_validator("kv_cache_memory")
    @classmethod
    def _positive_size(cls, value: ByteSize | None) -> ByteSize | None:
        if value is not None and value <= 0:
            raise ValueError("must be a positive size such as 2GiB, 512MiB or a number of bytes")
        return value


def check_device(device: str) -> None:
    """Refuse a CUDA device this torch cannot use, before a model load fails deep inside torch."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ValueError(f"device {device!r} is not available: torch {torch.__version__} is {build} or sees "
                         "no GPU; use --device cpu (or auto)")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} does not exist: torch sees {torch.cuda.device_count()} GPU(s)")

