"""Model implementations over the paged KV cache, chosen by the HF config's model_type."""
from kvgate.engine.models.llama import SUPPORTED_MODEL_TYPES, AttentionMetadata, LlamaForCausalLM, build_model

__all__ = ["SUPPORTED_MODEL_TYPES", "AttentionMetadata", "LlamaForCausalLM", "build_model"]
