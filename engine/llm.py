"""The offline, vLLM-style entry point: `LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import array
import itertools
import sys
from typing import Any

from tqdm.auto import tqdm

from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.outputs import EmbeddingOutput, RequestOutput
from kvgate.engine.pooling_params import PoolingParams
from kvgate.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: Any, *, device: str = "auto", dtype: str = "auto", max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_model_len: int | None = None, block_size: int = 16,
                 gpu_memory_utilization: float = 0.9, kv_cache_memory: int | None = None,
                 enable_prefix_caching: bool = True, scheduling: str = "continuous", seed: int = 0,
                 max_loras: int = 0, max_lora_rank: int = 16, max_cpu_loras: int | None = None,
                 loras: dict[str, str] | None = None, overlap: str = "auto") -> None:
        """`loras`: adapter name -> PEFT adapter folder, served when `max_loras` >= 1 (engine/lora.py)."""
        self.engine = LLMEngine(model, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                                kv_cache_memory=kv_cache_memory, enable_prefix_caching=enable_prefix_caching,
                                scheduling=scheduling, seed=seed, max_loras=max_loras, max_lora_rank=max_lora_rank,
                                max_cpu_loras=max_cpu_loras, overlap=overlap)
        for name, path in (loras or {}).items():
            self.add_lora(name, path)
        self._ids = itertools.count()

    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter in folder `path` as `name` (a LoraError says what is wrong with it)."""
        self.engine.loras.add(name, path)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: list[str] | list[list[int]] | str,
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. `lora`: the adapter of every prompt,
        or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts: pass one, or one each")
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} adapters for {len(prompts)} prompts: pass one, or one each")
        order = self._add_all(prompts, params, loras)
        results = {rid: RequestOutput(rid, ids, [], "", None, [] if p.logprobs is not None else None)
                   for (rid, ids), p in zip(self._prompt_ids.items(), params)}
        with tqdm(total=len(order), desc="generate", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    result = results[out.request_id]
                    if out.logprobs:
                        result.logprobs.extend(out.logprobs)
                    if out.finished:
                        result.token_ids, result.text = out.token_ids, out.text
                        result.finish_reason, result.cached_tokens = out.finish_reason, out.cached_tokens
                        result.error, result.prompt_logprobs = out.error, out.prompt_logprobs
                        bar.update(1)
        return [results[rid] for rid in order]

    def embed(self, prompts: list[str] | list[list[int]] | str, pooling: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingOutput]:
        """Each prompt's embedding (engine/pooling_params.py: the model's own pooling, unit length, unless `pooling`
        says otherwise); outputs come back in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        pooling = pooling if pooling is not None else PoolingParams()
        order: list[str] = []
        try:
            for prompt in prompts:
                rid = str(next(self._ids))
                self.engine.add_embedding_request(rid, prompt, pooling)
                order.append(rid)
        except Exception:
            for rid in order:
                self.engine.abort(rid)
            raise
        results = {rid: EmbeddingOutput(rid, self.engine.seqs[rid].prompt_token_ids, []) for rid in order}
        with tqdm(total=len(order), desc="embed", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished and out.request_id in results:
                        results[out.request_id].embedding = floats(out.embedding)
                        bar.update(1)
        return [results[rid] for rid in order]

    def _add_all(self, prompts, params, loras) -> list[str]:
        order: list[str] = []
        self._prompt_ids: dict[str, list[int]] = {}
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p, stream_text=False, lora=lora)
                self._prompt_ids[rid] = self.engine.seqs[rid].prompt_token_ids
                order.append(rid)
        except Exception:
            for rid in order:  # a bad prompt leaves nothing half-queued behind
                self.engine.abort(rid)
            raise
        return order

    def chat(self, conversations: list[dict[str, str]] | list[list[dict[str, str]]],
             params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate replies to conversations through the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.engine.encode_chat(list(c)) for c in conversations]
        return self.generate(prompts, params, use_tqdm)


def floats(data: bytes | None) -> list[float]:
    """A vector as the engine hands it out (float32 little-endian bytes) as Python floats."""
    values = array.array("f", data or b"")
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()
