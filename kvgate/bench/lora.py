"""`kvgate bench lora`: W-LORA's engine half (issue 42; `--fleet` runs the fleet half instead: lora_fleet.py). W-CPU's
requests on one engine, on the base model and spread over 8 random rank-16 adapters (request i takes adapter i mod 8), in the same run, rounds interleaved; the figure is
the median round's output tokens/s of each and their ratio (target: adapters >= 0.8x base).

The adapters are written here in PEFT's format (all seven target modules, random A and B), so the run needs neither
PEFT nor a download. The prefix cache is off: a later round would otherwise find an earlier round's prompts cached
(the base model's, never an adapter's), which measures the cache, not the adapters."""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from kvgate.bench import lora_fleet
from kvgate.bench.engine import add_workload_arguments, make_requests, median_round, scaled_workload

TARGET_RATIO = 0.8
MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument("--adapters", type=int, help="adapters the requests are spread over (8; --fleet: 200)")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank (16)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of base and adapters, interleaved")
    lora_fleet.add_arguments(parser)


def write_adapter(folder: Path, config, rank: int, seed: int) -> None:
    """A PEFT-format adapter of every target module with random A and B, scaled so each delta is small."""
    import torch
    from safetensors.torch import save_file

    from kvgate.engine.lora import ModelShapes

    shapes = ModelShapes.of(config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for owner, modules in MODULES.items():
            for module in modules:
                in_features, out_features = shapes.modules[module]
                key = f"base_model.model.model.layers.{layer}.{owner}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) / in_features ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none",
         "target_modules": [m for modules in MODULES.values() for m in modules]}))


def run(args: argparse.Namespace) -> int:
    from kvgate.bench.report import machine_info, print_header, versions
    from kvgate.engine.loader import resolve_model
    from kvgate.engine.model_runner import resolve_device

    if args.fleet:
        return lora_fleet.run(args)
    args.adapters = args.adapters or 8
    if args.adapters < 1 or args.rank < 1 or args.repeats < 1:
        raise SystemExit("--adapters, --rank and --repeats must each be 1 or more")
    workload = scaled_workload(args)
    device = resolve_device(args.device)
    source = resolve_model(workload.models[0], seed=args.seed)
    settings = {"model": source.name, "dtype": workload.dtype, "device": str(device),
                "num_requests": workload.num_requests, "prompt_len": list(workload.prompt_len),
                "output_len": list(workload.output_len), "max_num_seqs": workload.max_num_seqs,
                "adapters": args.adapters, "rank": args.rank, "repeats": args.repeats, "prefix_caching": False,
                "sampling": "greedy, ignore_eos"}
    report = {"workload": "W-LORA engine", "machine": machine_info(device), "versions": versions(),
              "settings": settings, "notes": ["base and adapters: the same engine, requests and round, interleaved"]}
    print_header(report)
    requests = make_requests(workload, source.config.vocab_size, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"adapter-{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            write_adapter(Path(tmp) / name, source.config, args.rank, seed=args.seed + i)
        report.update(measure(source, requests, workload, device, names, tmp, args.rank, args.repeats))
    print(f"base {report['base']['output_tok_s']:.1f} tok/s, {args.adapters} adapters "
          f"{report['lora']['output_tok_s']:.1f} tok/s: ratio {report['ratio']:.3f} (target >= {TARGET_RATIO})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def measure(source, requests, workload, device, names: list[str], folder: str, rank: int, repeats: int) -> dict:
    from kvgate.engine import LLM, SamplingParams

    llm = LLM(source, device=str(device), dtype=workload.dtype, max_num_seqs=workload.max_num_seqs,
              max_model_len=workload.prompt_len[1] + workload.output_len[1], enable_prefix_caching=False,
              max_loras=len(names), max_lora_rank=rank, loras={n: str(Path(folder) / n) for n in names})
    warmup = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([requests[0].prompt_ids[:8]] * 2, warmup, use_tqdm=False, lora=[None, names[0]])
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    prompts = [r.prompt_ids for r in requests]
    modes = {"base": [None] * len(requests), "lora": [names[i % len(names)] for i in range(len(requests))]}
    rounds: dict[str, list[dict]] = {mode: [] for mode in modes}
    for round_no in range(1, repeats + 1):
        for mode, loras in modes.items():
            steps, start = llm.engine.steps, time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False, lora=loras)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outputs)
            rounds[mode].append({"output_tok_s": tokens / elapsed, "output_tokens": tokens, "elapsed_s": elapsed,
                                 "steps": llm.engine.steps - steps, "requests_with_wrong_length": sum(
                                     len(o.token_ids) != r.max_tokens for o, r in zip(outputs, requests))})
            print(f"round {round_no}/{repeats} {mode}: {json.dumps(rounds[mode][-1])}", flush=True)
    ratio = statistics.median_low(lo["output_tok_s"] / b["output_tok_s"] for b, lo in zip(rounds["base"], rounds["lora"]))
    return {"base": median_round(rounds["base"]), "lora": median_round(rounds["lora"]), "ratio": ratio,
            "target_ratio": TARGET_RATIO, "meets_target": ratio >= TARGET_RATIO,
            "adapter_loads": llm.engine.loras.loads}
