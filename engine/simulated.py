"""The simulated engine: the production LLMEngine (its Scheduler, BlockManager, prefix cache and admission)
over a CostModelRunner instead of a model. Only the GPU is simulated, so W-FLEET and the chaos runs measure
the policy production runs. Torch-free."""
from __future__ import annotations

from kvgate.engine.cost_model_runner import CostModelRunner
from kvgate.engine.llm_engine import LLMEngine


class SimulatedEngine(LLMEngine):
    """Only a constructor: everything an engine does is LLMEngine's."""

    def __init__(self, num_blocks: int, block_size: int = 16, max_num_seqs: int = 32, step_overhead_s: float = 0.002,
                 per_token_s: float = 0.0001, seed: int = 0, *, max_model_len: int = 4096,
                 max_num_batched_tokens: int = 8192, vocab_size: int = 32000, model_name: str = "simulated",
                 sleep: bool = True, max_loras: int = 0, max_cpu_loras: int | None = None,
                 lora_load_s: float = 0.0, lora_read_s: float = 0.0) -> None:
        runner = CostModelRunner(num_blocks, step_overhead_s=step_overhead_s, per_token_s=per_token_s, seed=seed,
                                 max_model_len=max_model_len, vocab_size=vocab_size, model_name=model_name,
                                 sleep=sleep, max_loras=max_loras, lora_load_s=lora_load_s,
                                 lora_read_s=lora_read_s)
        super().__init__(runner=runner, block_size=block_size, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, seed=seed,
                         max_loras=max_loras, max_cpu_loras=max_cpu_loras)
