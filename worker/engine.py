"""What the worker uses of an engine: `LLMEngine` (a model, or the simulated engine's cost model) and any test
double must offer this, checked by type, so the worker never probes an engine for attributes."""
from __future__ import annotations

from typing import Any, Protocol

from kvgate.engine.fim import FimFormat
from kvgate.engine.lora_slots import LoraSlots
from kvgate.engine.outputs import Admission, EngineStats, StepOutput
from kvgate.engine.pooling_params import PoolingParams
from kvgate.engine.sampling_params import SamplingParams


class Engine(Protocol):
    model_name: str
    tokenizer: Any  # None: the engine takes token ids only (the simulated engine)
    block_size: int
    max_model_len: int
    max_num_seqs: int
    embedding_size: int  # an embedding's length before `dimensions` cuts it
    fim: FimFormat | None  # the model's fill-in-the-middle tokens (engine/fim.py); None: it has none
    loras: LoraSlots  # its LoRA adapters: `add(name, path)` reads one (LoraError), `in` says whether it is known,
    # `has_room(name)` whether a request of that adapter could start now (the worker asks before reading its jobs)

    @property
    def stats(self) -> EngineStats: ...

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    arrival_time: float | None = None, stream_text: bool = True, detokenize: bool = True,
                    ahead: bool = False, lora: str | None = None) -> int: ...

    def add_embedding_request(self, request_id: str, prompt: str | list[int], pooling: PoolingParams, *,
                              arrival_time: float | None = None, ahead: bool = False) -> int: ...

    def abort(self, request_id: str) -> StepOutput | None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[StepOutput]: ...

    def admission(self) -> Admission: ...

    def shared_prefix_tokens(self, prompt_ids: list[int], hashes: list[int] | None = None) -> int: ...

    def output_budget(self, prompt_len: int, max_tokens: int) -> int: ...

    def fits(self, prompt_len: int, max_tokens: int, shared: int = 0) -> bool: ...

    def make_room(self, prompt_len: int, max_tokens: int, shared: int, victims: list[str]) -> list[str] | None: ...

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None
                    ) -> list[int]: ...

    def encode_fim(self, prompt: str, suffix: str) -> list[int]: ...
