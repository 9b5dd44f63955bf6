"""kvgate inference engine: iteration-level continuous batching over a paged KV cache.

`import kvgate.engine` stays torch-free: LLM and LLMEngine load on first access, and torch only once a model is
loaded (the simulated engine never loads it)."""
import importlib
import importlib.metadata
import os
import sys


def _unshadow_kernels() -> None:
    """Import Hugging Face's `kernels` (transformers >= 5.25 requires it and imports it by that name) before this
    checkout's kernels/ folder can stand in for it. In a checkout the root holds kernels/ (kvgate.kernels, installed
    by pyproject's package-dir), and wherever the root is on sys.path (`python -m ...` or pytest run from it) a bare
    `import kernels` finds that folder first: transformers then fails with "cannot import name 'CUDAProperties' from
    'kernels'". An installed kvgate has no such folder, and without the distribution there is nothing to import."""
    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # through a symlinked kvgate/engine too
    if "kernels" in sys.modules or not os.path.isfile(os.path.join(root, "kernels", "__init__.py")):
        return
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    saved = sys.path[:]
    sys.path[:] = [entry for entry in saved if os.path.realpath(entry or os.curdir) != root]
    try:
        importlib.import_module("kernels")
    finally:
        sys.path[:] = saved


_unshadow_kernels()

from kvgate.engine.lora import LoraError
from kvgate.engine.outputs import Admission, EmbeddingOutput, EngineStats, RequestOutput, RequestRejected, StepOutput
from kvgate.engine.pooling_params import PoolingParams
from kvgate.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "PoolingParams", "RequestOutput", "EmbeddingOutput", "StepOutput",
           "Admission", "EngineStats", "RequestRejected", "LoraError"]


def __getattr__(name: str):
    if name == "LLM":
        from kvgate.engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from kvgate.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
