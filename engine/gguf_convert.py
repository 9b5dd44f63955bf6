"""One-time conversion of a GGUF file into a cached HF folder (float32 safetensors, config.json, tokenizer).

Dequantizing a GGUF file takes tens of seconds; the folder it leaves behind loads in a few. The folder appears
by one rename of a finished temporary folder, so a conversion killed half-way never leaves a folder that
looks complete."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    """$KVGATE_CACHE/models, or ~/.cache/kvgate/models."""
    return Path(os.environ.get("KVGATE_CACHE", "~/.cache/kvgate")).expanduser() / "models"


def cache_name(gguf_path: Path) -> str:
    """Ties the cached folder to this exact file, so a replaced file is converted again."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    return f"{gguf_path.stem}-{hashlib.sha1(key).hexdigest()[:10]}"


def converted_folder(gguf_path: Path, name: str | None = None) -> Path:
    """The cached HF folder for `gguf_path`, converting it first if this is the first time."""
    folder = cache_root() / (name or cache_name(gguf_path))
    if (folder / "config.json").is_file():
        return folder
    convert(gguf_path, folder)
    return folder


def convert(gguf_path: Path, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    logger.warning("converting %s to %s (once; later loads use the cached folder)", gguf_path, folder)
    steps = tqdm(total=3, desc=f"GGUF -> {folder.name}", unit="step")
    try:
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        steps.update()
        steps.set_postfix_str("dequantize weights")
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        steps.update()
        steps.set_postfix_str("save")
        _save(model, tmp)
        tokenizer.save_pretrained(tmp)
        steps.update()
        _publish(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        steps.close()


def _save(model, folder: Path) -> None:
    """save_pretrained refuses a model loaded from GGUF (it counts as quantized), though its weights are plain
    float32 by now; so write what save_pretrained would have written."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    config = model.config
    # Left in, this entry would make transformers look for a GGUF file when it reads the folder.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as the embedding; safetensors stores it once
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def _publish(tmp: Path, folder: Path) -> None:
    try:
        tmp.rename(folder)
    except OSError:
        # Another process finished the same conversion first; its folder is as good as ours.
        if not (folder / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
