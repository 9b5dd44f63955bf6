"""LoRA adapters in PEFT's format, read from a local folder and checked against the loaded model before any slot
holds them: `adapter_config.json` + `adapter_model.safetensors`, target modules among q/k/v/o and gate/up/down.

Every problem is a LoraError naming the file and what is wrong with it; the engine refuses the adapter and serves on.
An adapter in host memory is a dict (layer, module) -> (A [r, in], B [out, r] with PEFT's scaling folded in), float32
on the CPU; engine/lora_layers.py copies it into a device slot."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PEFT's module names -> (the fused projection here, which slice of it)
TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
UNSUPPORTED = {"use_dora": "DoRA adapters", "fan_in_fan_out": "fan_in_fan_out (Conv1D-style) weights",
               "lora_bias": "LoRA biases", "alora_invocation_tokens": "activated LoRAs (aLoRA)",
               "layer_replication": "replicated layers", "target_parameters": "LoRAs of bare parameters"}


class LoraError(ValueError):
    """An adapter that cannot be served: the message names its file and the problem."""


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """What an adapter must fit: each target module's (in, out) features, the number of layers, the model's names."""
    modules: dict[str, tuple[int, int]]
    num_layers: int
    names: tuple[str, ...] = ()

    @classmethod
    def of(cls, config: Any, names: tuple[str, ...] = ()) -> ModelShapes:
        hidden, inter = config.hidden_size, config.intermediate_size
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        q = config.num_attention_heads * head_dim
        kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
        modules = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                   "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
        return cls(modules, config.num_hidden_layers, tuple(n for n in names if n))


@dataclass(slots=True)
class LoraAdapter:
    name: str
    path: Path
    rank: int  # the largest rank among its modules
    weights: dict[tuple[int, str], tuple[Any, Any]] = field(default_factory=dict)


def read_adapter(name: str, path: str | Path, shapes: ModelShapes, max_rank: int) -> LoraAdapter:
    folder = Path(path).expanduser()
    config = _read_config(folder / CONFIG_FILE)
    _check_config(folder / CONFIG_FILE, config, shapes)
    tensors = _read_tensors(folder / WEIGHTS_FILE)
    weights_file = folder / WEIGHTS_FILE
    pairs: dict[tuple[int, str], dict[str, Any]] = {}
    for key, tensor in tensors.items():
        m = KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            raise LoraError(f"{weights_file}: tensor {key!r} targets a module the base model has no LoRA layer for; "
                            f"supported: {', '.join(TARGETS)} in layers 0..{shapes.num_layers - 1}")
        layer, module = int(m.group(1)), m.group(2)
        if layer >= shapes.num_layers:
            raise LoraError(f"{weights_file}: tensor {key!r} is for layer {layer}, but the base model has "
                            f"{shapes.num_layers} layers: is this an adapter of another model?")
        pair = pairs.setdefault((layer, module), {})
        pair[m.group(3)], pair["path"] = tensor, key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
    if not pairs:
        raise LoraError(f"{weights_file} holds no lora_A/lora_B weights: is it a PEFT LoRA adapter?")
    adapter = LoraAdapter(name, folder, 0)
    for (layer, module), ab in sorted(pairs.items()):
        a, b = _check_pair(weights_file, layer, module, ab, shapes, max_rank)
        rank = a.shape[0]
        adapter.weights[(layer, module)] = (a, b * _scaling(config, ab["path"], rank))
        adapter.rank = max(adapter.rank, rank)
    return adapter


def _read_config(file: Path) -> dict:
    if not file.parent.is_dir():
        raise LoraError(f"adapter folder {file.parent} does not exist: pass a local PEFT adapter folder")
    if not file.is_file():
        raise LoraError(f"{file} is missing: a PEFT adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise LoraError(f"{file} is not valid JSON ({e}): re-save the adapter with PEFT") from e
    if not isinstance(config, dict):
        raise LoraError(f"{file} is not a JSON object: re-save the adapter with PEFT")
    return config


def _check_config(file: Path, config: dict, shapes: ModelShapes) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraError(f"{file}: peft_type={peft_type!r}; only LORA adapters are served")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise LoraError(f"{file}: {key}={config[key]!r}; {what} are not supported: train a plain LoRA")
    if config.get("bias", "none") != "none":
        raise LoraError(f"{file}: bias={config['bias']!r}; only bias='none' is supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        lacking = sorted(set(targets) - set(TARGETS))
        if lacking:
            raise LoraError(f"{file}: target_modules {lacking} are modules the base model has no LoRA layer for; "
                            f"supported: {', '.join(TARGETS)}")
    if config.get("modules_to_save"):
        raise LoraError(f"{file}: modules_to_save={config['modules_to_save']!r} replaces whole modules, which a "
                        "shared base model cannot do per request: train without modules_to_save")
    base = config.get("base_model_name_or_path")
    if base and shapes.names and not any(_same_model(base, name) for name in shapes.names):
        raise LoraError(f"{file}: base_model_name_or_path={base!r}, but the loaded model is {shapes.names[0]!r}: "
                        "load the adapter on the model it was trained on")


def _same_model(a: str, b: str) -> bool:
    """Names of one model: the last path part, case aside, equal or one a variant of the other (-instruct)."""
    a, b = (s.removeprefix("random:").rstrip("/").rsplit("/", 1)[-1].lower() for s in (a, b))
    return a.startswith(b) or b.startswith(a)


def _read_tensors(file: Path) -> dict[str, Any]:
    if not file.is_file():
        other = " (a .bin adapter: re-save it with safe_serialization=True)" \
            if (file.parent / "adapter_model.bin").is_file() else ""
        raise LoraError(f"{file} is missing{other}: a PEFT adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return {k: v.float() for k, v in load_file(file, device="cpu").items()}
    except (SafetensorError, OSError, ValueError) as e:
        raise LoraError(f"{file} is corrupt or not a safetensors file ({e}): re-save the adapter") from e


def _check_pair(file: Path, layer: int, module: str, ab: dict[str, Any], shapes: ModelShapes,
                max_rank: int) -> tuple[Any, Any]:
    where = f"{file}: layers.{layer}.{module}"
    if "A" not in ab or "B" not in ab:
        raise LoraError(f"{where} has lora_{'A' if 'A' in ab else 'B'} without its lora_{'B' if 'A' in ab else 'A'}")
    a, b = ab["A"], ab["B"]
    in_features, out_features = shapes.modules[module]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape[0] != out_features \
            or a.shape[0] != b.shape[1]:
        raise LoraError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base model's "
                        f"{in_features} -> {out_features} projection (expected [r, {in_features}] and "
                        f"[{out_features}, r]): is this an adapter of another model?")
    if a.shape[0] > max_rank:
        raise LoraError(f"{where} has rank {a.shape[0]}, over max_lora_rank={max_rank}: raise max_lora_rank")
    return a.contiguous(), b.contiguous()


def _scaling(config: dict, module_path: str, rank: int) -> float:
    """PEFT's: lora_alpha / r (alpha / sqrt(r) with use_rslora), alpha_pattern overriding lora_alpha by name."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module_path):
            alpha = value
            break
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
