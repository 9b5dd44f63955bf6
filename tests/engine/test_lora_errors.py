"""Each way an adapter can be bad gives a LoraError naming its file and the problem, and the engine serves on:
requests of the good adapters and of the base model still finish with the right tokens."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvgate.engine import LLM, LoraError, SamplingParams
from tests.engine.helpers import random_prompts, tiny_source
from tests.engine.lora_adapters import hf_greedy, make_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    source, hf = tiny_source("llama", seed=6)
    root = tmp_path_factory.mktemp("bad_loras")
    twin = make_adapter(hf, root / "good", seed=1, r=8)
    llm = LLM(source, kv_cache_memory=1 << 20, max_loras=2, max_lora_rank=8, loras={"good": str(root / "good")})
    return llm, hf, twin, root


def copy_good(root, name):
    shutil.copytree(root / "good", root / name)
    return root / name


def edit_config(folder, **changes):
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))


def edit_tensors(folder, change):
    file = folder / "adapter_model.safetensors"
    tensors = load_file(file)
    save_file(change(tensors), file)


def rename_first(old: str, new: str):
    def change(tensors):
        key = next(k for k in tensors if old in k)
        tensors[key.replace(old, new)] = tensors.pop(key)
        return tensors
    return change


def missing_folder(root):
    return root / "nowhere", r"nowhere does not exist"


def missing_config(root):
    folder = copy_good(root, "no_config")
    (folder / "adapter_config.json").unlink()
    return folder, r"no_config/adapter_config\.json is missing"


def corrupt_config(root):
    folder = copy_good(root, "bad_json")
    (folder / "adapter_config.json").write_text("{not json")
    return folder, r"bad_json/adapter_config\.json is not valid JSON"


def missing_weights(root):
    folder = copy_good(root, "no_weights")
    (folder / "adapter_model.safetensors").unlink()
    return folder, r"no_weights/adapter_model\.safetensors is missing"


def corrupt_weights(root):
    folder = copy_good(root, "truncated")
    file = folder / "adapter_model.safetensors"
    file.write_bytes(file.read_bytes()[:100])
    return folder, r"truncated/adapter_model\.safetensors is corrupt"


def rank_over_limit(root, hf):
    make_adapter(hf, root / "rank16", seed=2, r=16)
    return root / "rank16", r"rank16/adapter_model\.safetensors: layers\.0\.\w+ has rank 16, over max_lora_rank=8"


def target_module_lacking(root, hf):
    make_adapter(hf, root / "lm_head", seed=3, targets=["q_proj", "lm_head"])
    return root / "lm_head", r"lm_head/adapter_config\.json: target_modules \['lm_head'\] are modules the base model"


def tensor_of_unknown_module(root):
    folder = copy_good(root, "rotary")
    edit_tensors(folder, rename_first("q_proj", "rotary_proj"))
    return folder, r"rotary/adapter_model\.safetensors: tensor '.*rotary_proj.*' targets a module the base model"


def layer_past_the_model(root):
    folder = copy_good(root, "layer9")
    edit_tensors(folder, rename_first("layers.1.", "layers.9."))
    return folder, r"layer9/adapter_model\.safetensors: tensor '.*layers\.9.*' is for layer 9, but the base model has 2"


def base_model_mismatch(root):
    folder = copy_good(root, "other_base")
    edit_config(folder, base_model_name_or_path="meta-llama/Llama-3.2-1B")
    return folder, r"other_base/adapter_config\.json: base_model_name_or_path='meta-llama/Llama-3\.2-1B', but the " \
                   r"loaded model is 'tiny-llama'"


def shapes_not_fitting(root):
    folder = copy_good(root, "shapes")

    def change(tensors):
        key = next(k for k in tensors if "down_proj.lora_A" in k)
        tensors[key] = torch.zeros(8, 64)  # down_proj takes the 96 intermediate features, not 64
        return tensors
    edit_tensors(folder, change)
    return folder, r"shapes/adapter_model\.safetensors: layers\.\d\.down_proj: lora_A \(8, 64\) and lora_B \(64, 8\) " \
                   r"do not fit the base model's 96 -> 64 projection"


def lone_matrix(root):
    folder = copy_good(root, "lone")
    edit_tensors(folder, lambda t: {k: v for k, v in t.items() if not k.endswith("layers.0.self_attn.q_proj.lora_B.weight")})
    return folder, r"lone/adapter_model\.safetensors: layers\.0\.q_proj has lora_A without its lora_B"


def dora(root):
    folder = copy_good(root, "dora")
    edit_config(folder, use_dora=True)
    return folder, r"dora/adapter_config\.json: use_dora=True; DoRA adapters are not supported"


CASES = [missing_folder, missing_config, corrupt_config, missing_weights, corrupt_weights, rank_over_limit,
         target_module_lacking, tensor_of_unknown_module, layer_past_the_model, base_model_mismatch, shapes_not_fitting,
         lone_matrix, dora]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_a_bad_adapter_is_refused_with_its_file_and_problem_and_the_engine_serves_on(served, case):
    llm, hf, twin, root = served
    prompts = random_prompts(2, 4, 20, seed=7)
    llm.engine.add_request("before", prompts[0], GREEDY, lora="good")  # in flight while the bad one is added
    llm.engine.step()
    folder, message = case(root, hf) if "hf" in case.__code__.co_varnames[:case.__code__.co_argcount] else case(root)
    with pytest.raises(LoraError, match=message):
        llm.add_lora("bad", str(folder))
    assert "bad" not in llm.engine.loras
    llm.engine.abort("before")
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora=["good", None])
    assert [o.token_ids for o in outs] == [hf_greedy(twin, prompts[0], 6), hf_greedy(hf, prompts[1], 6)]
