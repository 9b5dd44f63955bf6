"""kvfleet inference engine: iteration-level continuous batching over a paged KV cache."""
from engine.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
