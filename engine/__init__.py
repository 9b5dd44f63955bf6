"""kvgate inference engine: iteration-level continuous batching over a paged KV cache.

`import kvgate.engine` stays torch-free: LLM and LLMEngine load on first access, and torch only once a model is
loaded (the simulated engine never loads it)."""
from kvgate.engine.outputs import Admission, EmbeddingOutput, EngineStats, RequestOutput, RequestRejected, StepOutput
from kvgate.engine.pooling_params import PoolingParams
from kvgate.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "PoolingParams", "RequestOutput", "EmbeddingOutput", "StepOutput",
           "Admission", "EngineStats", "RequestRejected"]


def __getattr__(name: str):
    if name == "LLM":
        from kvgate.engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from kvgate.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
