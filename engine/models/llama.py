"""The Llama family over the paged KV cache: Llama 2/3 (llama3 rope scaling), Mistral, Qwen2/2.5 (qkv bias),
Qwen3 (q/k RMSNorm), SmolLM2. q/k/v and gate/up are fused into one matmul each; attention reads K/V only
through kernels.ops over block tables and slot mappings."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F

from kvgate.kernels import cpu_linear, ops

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scaling, computed by transformers' own functions for scaled rope."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = head_dim_of(config)
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type={rope_type!r} is not supported; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        qwen2 = config.model_type == "qwen2"
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias or qwen2)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias and not qwen2)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_cache = self.v_cache = torch.empty(0)  # views into the engine's KV cache, bound later

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        # q/k norm (Qwen3), rotary and the k/v store: one kernel on the GPU, reading heads in place from qkv
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else ()
        q = ops.qkv_rope_store(qkv, self.num_heads, self.num_kv_heads, self.head_dim, cos, sin, self.k_cache,
                               self.v_cache, meta.slot_mapping, *norm)
        o = ops.paged_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.cu_seqlens_q,
                                meta.context_lens, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, cos, sin, meta):
        x, residual = self.input_layernorm(x, residual) if residual is not None else (self.input_layernorm(x)[0], x)
        x = self.self_attn(x, cos, sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Built on the meta device by `build_model`; parameters are filled by `load_weights`."""

    def __init__(self, config) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={config.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
        self.config = config
        self.model = LlamaModel(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # tied: the logits reuse the embedding, until `pack_linears` gives them a packed copy of it
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.cos = self.sin = torch.empty(0)

    def init_rope(self, max_positions: int) -> None:
        """cos/sin for every position once, so a step only gathers rows."""
        inv_freq, scaling = rope_inv_freq(self.config)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        device = self.model.embed_tokens.weight.device
        self.cos, self.sin = (freqs.cos() * scaling).to(device), (freqs.sin() * scaling).to(device)

    def pack_linears(self, rows_hint: int) -> int:
        """On CPU in float32, every projection and the lm_head through oneDNN (kernels/cpu_linear.py)."""
        packed = cpu_linear.pack_linears(self, rows_hint)
        embedding = self.model.embed_tokens.weight
        if self.lm_head is None and cpu_linear.can_pack(embedding):
            self.lm_head = cpu_linear.PackedLinear(embedding, None, rows_hint)
            packed += 1
        return packed

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.cos[positions], self.sin[positions]
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, meta)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32, every row (prompt logprobs; from bf16 the cast is exact: it only widens). The sampler
        takes `logits` and widens only the rows that need it."""
        return self.logits(hidden).float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype, as the GEMM writes them (a decode graph takes its argmax from these)."""
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter must be covered exactly."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if "rotary_emb" in hf_name:
                continue
            if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            name, rows = self._map_name(hf_name)
            if name not in params:
                raise ValueError(f"weight {hf_name!r} has no place in {type(self).__name__} "
                                 f"({self.config.model_type}); is the config's architecture right?")
            param = params[name]
            target = param.data if rows is None else param.data[rows]
            if target.shape != tensor.shape:
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(hf_name)
        expected = self._expected_hf_names(params)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")

    def _map_name(self, hf_name: str) -> tuple[str, slice | None]:
        attn = self.model.layers[0].self_attn
        q, kv = attn.q_size, attn.kv_size
        inter = self.model.layers[0].mlp.down_proj.in_features
        fused = {"q_proj": ("qkv_proj", slice(0, q)), "k_proj": ("qkv_proj", slice(q, q + kv)),
                 "v_proj": ("qkv_proj", slice(q + kv, q + 2 * kv)),
                 "gate_proj": ("gate_up_proj", slice(0, inter)), "up_proj": ("gate_up_proj", slice(inter, 2 * inter))}
        parts = hf_name.split(".")
        for i, part in enumerate(parts):
            if part in fused:
                new, rows = fused[part]
                return ".".join(parts[:i] + [new] + parts[i + 1:]), rows
        return hf_name, None

    def _expected_hf_names(self, params: dict[str, torch.Tensor]) -> set[str]:
        names = set()
        for name in params:
            if ".qkv_proj." in name:
                names |= {name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")}
            elif ".gate_up_proj." in name:
                names |= {name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")}
            else:
                names.add(name)
        return names


def build_model(config, dtype: torch.dtype, device: torch.device,
                weights: Iterable[tuple[str, torch.Tensor]], max_positions: int) -> LlamaForCausalLM:
    """Allocate without random init (meta device), then load the weights in the target dtype."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    with torch.no_grad():
        model.load_weights(weights)
    model.init_rope(max_positions)
    return model.eval().requires_grad_(False)
