"""The HF transformers contestants of `kvgate bench engine`: static padded `generate`, and transformers' own
continuous batching (the manager behind `generate_batch`)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm


@dataclass(slots=True)
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int


@dataclass(slots=True)
class RunResult:
    """One contestant's run: the tokens each request got (exactly max_tokens when honest) and the wall time."""
    output_token_ids: list[list[int]]
    elapsed_s: float
    notes: str = ""
    steps: int | None = None  # engine iterations (kvgate's contestants)
    trace: object = None  # kvgate's contestants: the bench.bound.StepTrace of the steps it ran
    round_checks: dict | None = None  # kvgate's contestants: the round's Triton compiles and allocator growth

    @property
    def output_tokens(self) -> int:
        return sum(len(ids) for ids in self.output_token_ids)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def never_stop(model) -> None:
    """ignore_eos: generate() falls back on the model's generation_config for eos, so clear it at the source."""
    model.generation_config.eos_token_id = None


def hf_static(model, requests: list[BenchRequest], batch_size: int, pad_token_id: int) -> RunResult:
    """Padded batches of `batch_size` in request order (the seed article's baseline): each batch runs until its
    longest request is done; a request is credited only with the tokens it asked for."""
    device = model.device
    never_stop(model)
    outputs: list[list[int]] = []
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    synchronize(device)
    start = time.perf_counter()
    for batch in tqdm(batches, desc=f"hf static (batch {batch_size})", unit="batch"):
        input_ids, attention_mask = left_pad([r.prompt_ids for r in batch], pad_token_id, device)
        longest = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=longest,
                                 do_sample=False, pad_token_id=pad_token_id)
        new = out[:, input_ids.shape[1]:].tolist()
        outputs.extend(ids[:r.max_tokens] for ids, r in zip(new, batch))
    synchronize(device)
    return RunResult(outputs, time.perf_counter() - start)


def left_pad(prompts: list[list[int]], pad_token_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def hf_generate_batch(model, requests: list[BenchRequest], max_batch_requests: int | None = None,
                      cache_tokens: int | None = None) -> RunResult:
    """transformers' continuous batching. `generate_batch` takes one max_new_tokens for all requests, so this
    drives the same manager it wraps (`continuous_batching_context_manager`) and gives each request its own.
    `cache_tokens` sizes its KV cache; None lets it take 90% of free device memory, which on CPU means zeroing
    gigabytes of RAM before the first token."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    never_stop(model)
    longest = max(r.max_tokens for r in requests)
    gen_config = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=-1,
                                  pad_token_id=model.config.pad_token_id or 0)
    cb_config = ContinuousBatchingConfig(max_requests_per_batch=max_batch_requests)
    if cache_tokens is not None:
        cb_config.num_blocks = cache_blocks(cb_config, cache_tokens)
    results: dict[str, list[int]] = {}
    device = model.device
    with model.continuous_batching_context_manager(generation_config=gen_config, block=True, timeout=30,
                                                   continuous_batching_config=cb_config) as manager:
        synchronize(device)
        start = time.perf_counter()
        for i, r in enumerate(requests):
            manager.add_request(r.prompt_ids, request_id=f"r{i}", max_new_tokens=r.max_tokens, eos_token_id=-1)
        with tqdm(total=len(requests), desc="hf generate_batch", unit="req") as bar:
            while len(results) < len(requests):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError(f"transformers' continuous batching stopped after {len(results)} of "
                                           f"{len(requests)} requests")
                    continue
                if result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"transformers' continuous batching failed {result.request_id}: "
                                           f"{result.error}")
                    results[result.request_id] = list(result.generated_tokens)
                    bar.update()
        synchronize(device)
        elapsed = time.perf_counter() - start
    return RunResult([results[f"r{i}"] for i in range(len(requests))], elapsed,
                     notes="per-request max_new_tokens through the manager generate_batch wraps "
                           "(generate_batch itself takes one max_new_tokens for all requests)")


def cache_blocks(cb_config, tokens: int) -> int:
    """Blocks of transformers' continuous-batching cache that hold `tokens`: a block's tokens are `block_size` in
    transformers 5.17 (the GPU image's) and `page_size` after it, where `block_size` is a deprecated alias that
    stays None unless set."""
    per_block = cb_config.page_size if hasattr(cb_config, "page_size") else cb_config.block_size
    return -(-tokens // per_block)
