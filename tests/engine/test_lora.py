"""LoRA adapters on a tiny random Llama: each adapter's logprobs and greedy tokens equal HF transformers + PEFT's, a
step mixing adapters and the base model gives each sequence what it gets alone, slots are loaded and evicted
between steps without touching a running sequence's adapter, and the prefix cache never shares a block between
adapters."""
from __future__ import annotations

import pytest

from kvgate.engine import LLM, LLMEngine, RequestRejected, SamplingParams
from tests.engine.helpers import random_prompts, tiny_source
from tests.engine.lora_adapters import hf_greedy, hf_logprobs, make_adapter

NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)
# rank, alpha, targets and PEFT options of each adapter: full, attention only (rsLoRA), MLP only, per-module alpha
SPECS = {
    "full": dict(r=8, alpha=16),
    "attn": dict(r=4, alpha=8, targets=["q_proj", "k_proj", "v_proj", "o_proj"], use_rslora=True),
    "mlp": dict(r=16, alpha=16, targets=["gate_proj", "up_proj", "down_proj"]),
    "qv": dict(r=2, alpha=4, targets=["q_proj", "v_proj"], alpha_pattern={"v_proj": 32}),
    "r1": dict(r=1, alpha=2),
    "down": dict(r=8, alpha=8, targets=["down_proj"]),
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """The tiny model, its adapters' folders and PEFT twins, and prompts."""
    source, hf = tiny_source("qwen2", seed=4)  # qkv biases: the delta adds to a biased projection
    root = tmp_path_factory.mktemp("loras")
    twins = {name: make_adapter(hf, root / name, seed=i, **spec) for i, (name, spec) in enumerate(SPECS.items())}
    return source, hf, {name: str(root / name) for name in SPECS}, twins, random_prompts(3, 3, 40, seed=4)


def make_llm(source, paths, **kwargs) -> LLM:
    kwargs.setdefault("max_loras", len(paths))
    return LLM(source, kv_cache_memory=1 << 20, max_num_seqs=32, loras=paths, **kwargs)


def test_each_adapter_matches_hf_peft_logprobs_and_greedy_tokens(adapters):
    source, hf, paths, twins, prompts = adapters
    llm = make_llm(source, paths)
    for name, twin in twins.items():
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora=name)
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(twin, prompt, NEW), name
            got = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
            assert got == pytest.approx(hf_logprobs(twin, prompt, out.token_ids), abs=2e-3), name
    base = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in base] == [hf_greedy(hf, p, NEW) for p in prompts]
    assert base[0].token_ids != llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora="full")[0].token_ids


def test_one_step_mixing_six_adapters_and_the_base_gives_each_sequence_what_it_gets_alone(adapters):
    source, _, paths, _, prompts = adapters
    names = [*paths, None]
    alone = {name: make_llm(source, paths).generate(prompts, GREEDY, use_tqdm=False, lora=name) for name in names}
    llm = make_llm(source, paths)
    mixed_prompts = [p for p in prompts for _ in names]
    mixed_loras = [name for _ in prompts for name in names]
    mixed = llm.generate(mixed_prompts, GREEDY, use_tqdm=False, lora=mixed_loras)
    assert llm.engine.steps <= NEW + 1  # every sequence ran in the same steps: one prefill, then decodes together
    for out, prompt, name in zip(mixed, mixed_prompts, mixed_loras):
        want = alone[name][prompts.index(prompt)]
        assert out.token_ids == want.token_ids, name
        assert [lp[t] for lp, t in zip(out.logprobs, out.token_ids)] == pytest.approx(
            [lp[t] for lp, t in zip(want.logprobs, want.token_ids)], abs=1e-5)


def test_fewer_slots_than_adapters_loads_and_evicts_between_steps_and_each_sequence_keeps_its_adapter(adapters):
    source, _, paths, twins, prompts = adapters
    llm = make_llm(source, paths, max_loras=2, max_cpu_loras=len(paths))
    loras = [name for name in paths for _ in range(2)]
    outs = llm.generate([prompts[0]] * len(loras), GREEDY, use_tqdm=False, lora=loras)
    for out, name in zip(outs, loras):
        assert out.token_ids == hf_greedy(twins[name], prompts[0], NEW), name
    slots = llm.engine.loras
    assert slots.loads == len(paths) and slots.evictions == len(paths) - 2
    assert not slots.running and not slots.queued and len(slots.loaded) == 2


def test_no_free_slot_holds_the_queue_head_and_never_evicts_a_running_adapter(adapters):
    source, _, paths, twins, prompts = adapters
    engine = LLMEngine(source, kv_cache_memory=1 << 20, max_num_seqs=8, max_loras=1)
    engine.loras.add("full", paths["full"])
    engine.loras.add("mlp", paths["mlp"])
    long = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", prompts[0], long, lora="full")
    engine.add_request("b", prompts[0], long, lora="mlp")
    engine.add_request("c", prompts[0], long)  # the base model needs no slot, but waits behind "b": first in line
    engine.step()
    running = {s.request_id for s in engine.scheduler.running}
    assert running == {"a"} and engine.loras.loaded == {"full": 0}
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
    assert outs["a"] == hf_greedy(twins["full"], prompts[0], 6)
    assert outs["b"] == hf_greedy(twins["mlp"], prompts[0], 6)
    assert engine.loras.evictions == 1


def test_preemption_recomputes_with_the_same_adapter(adapters):
    source, _, paths, twins, prompts = adapters
    block = 2 * 2 * 16 * 2 * 16 * 4  # a block of the tiny model: K and V, 2 layers, 16 tokens, 2 heads x 16
    llm = LLM(source, kv_cache_memory=6 * block, max_num_seqs=4, max_loras=2, max_cpu_loras=8, loras=paths)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    names = ["full", "mlp", None, "full"]
    outs = llm.generate([prompts[1]] * 4, params, use_tqdm=False, lora=names)
    assert llm.engine.stats.preemptions > 0
    for out, name in zip(outs, names):
        twin = twins[name] if name else adapters[1]
        assert out.token_ids == hf_greedy(twin, prompts[1], 24), name


def test_the_prefix_cache_never_shares_blocks_between_adapters_or_with_the_base(adapters):
    source, _, paths, twins, _ = adapters
    llm = make_llm(source, paths)
    prompt = list(range(1, 50))  # three full blocks of 16
    first = {name: llm.generate([prompt], GREEDY, use_tqdm=False, lora=name)[0] for name in ("full", "mlp", None)}
    assert all(out.cached_tokens == 0 for out in first.values())  # the same tokens, but none of the others' K/V
    again = {name: llm.generate([prompt], GREEDY, use_tqdm=False, lora=name)[0] for name in ("full", "mlp", None)}
    assert all(out.cached_tokens == 48 for out in again.values())  # each finds its own blocks
    for name in ("full", "mlp"):
        assert again[name].token_ids == first[name].token_ids == hf_greedy(twins[name], prompt, NEW)


def test_an_adapter_added_again_under_its_name_does_not_reuse_its_old_blocks(adapters):
    source, _, paths, twins, _ = adapters
    llm = make_llm(source, paths)
    prompt = list(range(1, 50))
    llm.generate([prompt], GREEDY, use_tqdm=False, lora="full")
    llm.engine.loras.remove("full")
    llm.add_lora("full", paths["mlp"])
    out = llm.generate([prompt], GREEDY, use_tqdm=False, lora="full")[0]
    assert out.cached_tokens == 0 and out.token_ids == hf_greedy(twins["mlp"], prompt, NEW)


def test_an_unknown_adapter_is_rejected_and_lora_off_refuses_adapters(adapters):
    source, _, paths, _, prompts = adapters
    llm = make_llm(source, paths)
    with pytest.raises(RequestRejected, match="unknown LoRA adapter 'nope'"):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora="nope")
    assert not llm.engine.has_unfinished()
    from kvgate.engine import LoraError
    with pytest.raises(LoraError, match="max_loras >= 1"):
        LLM(source, kv_cache_memory=1 << 20).add_lora("full", paths["full"])


def test_adapter_rows_in_overlapped_decode_steps_write_what_the_plain_steps_write(adapters):
    """Overlap launches decode steps ahead (engine/overlap.py): each launched step must carry its rows' adapters, as
    the plain step does, not the base model's weights or the adapters of the step before."""
    source, _, paths, _, prompts = adapters
    plain = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)  # no logprobs: overlap may launch ahead
    loras = [name for name in paths for _ in prompts]
    every = [p for _ in paths for p in prompts]
    runs = {mode: make_llm(source, paths, overlap=mode).generate(every, plain, use_tqdm=False, lora=loras)
            for mode in ("off", "on")}
    assert [o.token_ids for o in runs["on"]] == [o.token_ids for o in runs["off"]]
