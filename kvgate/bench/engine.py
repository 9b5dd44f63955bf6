"""`kvgate bench engine`: W-CPU / W-GPU from shared/benchmarks.md. kvgate continuous vs kvgate static vs HF static
`generate` vs HF continuous batching, same prompts and output lengths, side by side in one run."""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from kvgate.commands.flags import setting_parser

CONTESTANTS = ("kvgate_continuous", "kvgate_static", "hf_static", "hf_generate_batch")


@dataclass(slots=True, frozen=True)
class Workload:
    name: str
    models: tuple[str, ...]
    dtype: str
    num_requests: int
    prompt_len: tuple[int, int]  # inclusive uniform range
    output_len: tuple[int, int]
    max_num_seqs: int  # kvgate continuous cap, and the static batch of kvgate static and HF static
    find_largest_hf_batch: bool  # W-GPU: HF static with the largest batch that fits, halving on OOM
    rounds: int = 1  # rounds of every contestant unless --repeats says otherwise; the figure is their median
    # The HF contestants run the first this many requests (None: all), so a round fits its time slot; their figure is
    # output tok/s like kvgate's, so "kvgate continuous >= 10x HF static" is a ratio of rates on the same prompts.
    hf_num_requests: int | None = None
    prefill_budget: int | None = None  # kvgate's max_num_batched_tokens (None: the engine's default)


WORKLOADS = {
    "cpu": Workload("W-CPU", ("smollm2-135m",), "float32", 64, (16, 128), (8, 256), 32, False),
    "gpu": Workload("W-GPU", ("random:qwen2.5-0.5b", "random:qwen3-0.6b", "random:llama-3.2-1b"), "bfloat16", 256,
                    (100, 1024), (100, 1024), 256, True, rounds=3, hf_num_requests=64),
}


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload and its scaling, shared with `kvgate bench steps`."""
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="cpu", help="cpu: W-CPU, gpu: W-GPU")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--model", action="append", help="model(s) instead of the workload's (repeatable)")
    parser.add_argument("--num-requests", type=int, help="scale the workload down (or up)")
    parser.add_argument("--max-prompt", type=int, help="cap the prompt length range")
    parser.add_argument("--max-output", type=int, help="cap the output length range")
    parser.add_argument("--max-num-seqs", type=setting_parser("max_num_seqs"),
                        help="kvgate's cap and the static batch size")
    parser.add_argument("--device", type=setting_parser("device"), default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", type=setting_parser("dtype"),
                        help="float32, bfloat16 or float16 (default: the workload's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and of random weights")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument("--contestants", default=",".join(CONTESTANTS), help="comma-separated subset")
    parser.add_argument("--repeats", type=int,
                        help="rounds of every contestant, interleaved; each figure is its median round (a shared "
                             "machine drifts between contestants run minutes apart); default: the workload's "
                             "(W-CPU 1, W-GPU 3)")
    parser.add_argument("--hf-requests", type=int,
                        help="the HF contestants run only the first N requests (default: W-GPU 64, W-CPU all)")
    parser.add_argument("--prefill-budget", type=int, help="kvgate's token budget of one step (max_num_batched_tokens)")
    parser.add_argument("--prefill-budget-sweep", metavar="N,N,...",
                        help="kvgate continuous once per step budget (e.g. 2048,4096,8192,16384) instead of the "
                             "contestants: each budget's median tok/s and prefill step time")


def run(args: argparse.Namespace) -> int:
    from kvgate.bench.report import machine_info, print_header, print_model_result, versions
    from kvgate.engine.model_runner import resolve_device

    workload = scaled_workload(args)
    contestants = [c.strip() for c in args.contestants.split(",") if c.strip()]
    unknown = set(contestants) - set(CONTESTANTS)
    if unknown:
        raise SystemExit(f"unknown contestants {sorted(unknown)}; choose from {', '.join(CONTESTANTS)}")
    if args.repeats is not None and args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: pass 1 or more rounds")
    device = resolve_device(args.device)
    repeats = args.repeats or workload.rounds
    report = {"workload": workload.name, "machine": machine_info(device), "versions": versions(),
              "settings": {**settings_of(workload, device), "repeats": repeats}, "notes": notes_of(device, workload)}
    print_header(report)
    if args.prefill_budget_sweep:
        from kvgate.bench.prefill_budget import sweep

        report["prefill_budget_sweep"] = sweep(workload, budgets(args.prefill_budget_sweep), device, args.seed,
                                               repeats, run_model, after_warm_up)
        return write_report(report, args.json)
    per_model = {}
    for model in workload.models:
        per_model[model] = run_model(model, workload, contestants, device, args.seed, repeats)
        print_model_result(model, per_model[model])
    if workload.name == "W-CPU" and len(per_model) == 1:
        report["model"], only = next(iter(per_model.items()))
        report.update(only)
    else:
        report["models"] = per_model
    return write_report(report, args.json)


def write_report(report: dict, path: Path | None) -> int:
    if path:
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


def budgets(text: str) -> list[int]:
    try:
        found = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--prefill-budget-sweep {text!r}: pass token budgets separated by commas, e.g. "
                         "2048,4096,8192,16384") from None
    if not found or min(found) < 1:
        raise SystemExit(f"--prefill-budget-sweep {text!r}: pass one or more budgets >= 1")
    return found


def scaled_workload(args: argparse.Namespace) -> Workload:
    w = WORKLOADS[args.workload]
    num_requests = args.num_requests or w.num_requests
    hf = getattr(args, "hf_requests", None) or w.hf_num_requests
    if hf is not None and hf < 1:
        raise SystemExit(f"--hf-requests {hf}: pass 1 or more")
    return replace(w, models=tuple(args.model or w.models), dtype=args.dtype or w.dtype, num_requests=num_requests,
                   prompt_len=capped(w.prompt_len, args.max_prompt), output_len=capped(w.output_len, args.max_output),
                   max_num_seqs=args.max_num_seqs or w.max_num_seqs,
                   hf_num_requests=min(hf, num_requests) if hf else None,
                   prefill_budget=getattr(args, "prefill_budget", None) or w.prefill_budget)


def capped(bounds: tuple[int, int], cap: int | None) -> tuple[int, int]:
    if cap is None:
        return bounds
    if cap < 1:
        raise SystemExit(f"a length cap of {cap} leaves nothing to run; pass a cap >= 1")
    return min(bounds[0], cap), min(bounds[1], cap)


def settings_of(workload: Workload, device) -> dict:
    return {"models": list(workload.models), "dtype": workload.dtype, "device": str(device),
            "num_requests": workload.num_requests, "prompt_len": list(workload.prompt_len),
            "output_len": list(workload.output_len), "max_num_seqs": workload.max_num_seqs,
            "hf_num_requests": min(workload.hf_num_requests or workload.num_requests, workload.num_requests),
            "prefill_budget": workload.prefill_budget or "the engine's default",
            "sampling": "greedy, ignore_eos", "prompts": "random token ids, seed shared by every contestant"}


def median_round(rounds: list[dict]) -> dict:
    """The round with the median throughput (the lower one of an even count), with every round's figure beside it
    in the order they ran (and, for kvgate's, each round's Triton compiles and allocator growth): the figure is the
    median, never the best."""
    ordered = sorted(rounds, key=lambda r: r["output_tok_s"])
    every = {f"rounds_{k}": [r[k] for r in rounds] for k in ("triton_compiles", "allocator_growth_bytes")
             if all(k in r for r in rounds)}
    return {**ordered[(len(ordered) - 1) // 2], "rounds_tok_s": [r["output_tok_s"] for r in rounds], **every}


def notes_of(device, workload: Workload | None = None) -> list[str]:
    notes = ["hf_generate_batch: transformers' continuous-batching manager (the one generate_batch wraps), driven "
             "directly so that each request gets its own max_new_tokens; generate_batch takes one for all",
             "hf_static: padded batches in request order, left padding; each batch runs to its longest request and "
             "a request is credited only with the tokens it asked for"]
    if workload is not None and (workload.hf_num_requests or workload.num_requests) < workload.num_requests:
        notes.append(f"the HF contestants ran the first {workload.hf_num_requests} of the {workload.num_requests} "
                     "requests (a round in its time slot); their tok/s is on those. HF's step is launch-bound, so at "
                     "a smaller batch its tok/s is lower than on all the requests: a kvgate/HF ratio here is an upper "
                     "bound on the one over the whole workload")
    if device.type == "cpu":
        notes.append(f"CPU run: absolute figures count only on a GPU; load average at start "
                     f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores (a shared machine "
                     "is noisy: compare the ratios of one run)")
    return notes


@dataclass(slots=True)
class ModelRun:
    source: object
    requests: list
    workload: Workload
    device: object

    @property
    def max_model_len(self) -> int:
        return self.workload.prompt_len[1] + self.workload.output_len[1]

    def for_contestant(self, name: str) -> ModelRun:
        """The requests `name` runs: an HF contestant the first hf_num_requests of them."""
        n = self.workload.hf_num_requests
        if name.startswith("kvgate") or n is None or n >= len(self.requests):
            return self
        return replace(self, requests=self.requests[:n])


def make_requests(workload: Workload, vocab_size: int, seed: int) -> list:
    from kvgate.bench.hf import BenchRequest

    rng = random.Random(seed)
    return [BenchRequest(prompt_ids=[rng.randrange(vocab_size) for _ in range(rng.randint(*workload.prompt_len))],
                         max_tokens=rng.randint(*workload.output_len))
            for _ in range(workload.num_requests)]


def run_model(model, workload: Workload, contestants: list[str], device, seed: int, repeats: int | None = None
              ) -> dict:
    """`model`: a name, or a ModelSource (the GPU check's, whose random weights the engine and HF share); `repeats`
    None: the workload's rounds."""
    from kvgate.engine.loader import resolve_model

    source = resolve_model(model, seed=seed) if isinstance(model, str) else model
    model, repeats = source.name, repeats or workload.rounds
    m = ModelRun(source, make_requests(workload, source.config.vocab_size, seed), workload, device)
    rounds: dict[str, list[dict]] = {name: [] for name in contestants}
    traces: dict[str, list] = {name: [] for name in contestants}
    for round_no in range(1, repeats + 1):
        for name in contestants:
            share = m.for_contestant(name)
            result = RUNNERS[name](share)
            rounds[name].append(summarize(share, result))
            traces[name].append(result.trace)
            # A CPU run takes an hour on a busy machine: what finished must be visible if the rest never does.
            print(f"{model} round {round_no}/{repeats} {name}: {json.dumps(rounds[name][-1])}", flush=True)
    bound_inputs = add_bounds(m, rounds, traces) if workload.name == "W-GPU" else None
    results = {name: median_round(r) for name, r in rounds.items()}
    entry = {"contestants": results, "ratios": median_ratios(rounds)}
    if {"kvgate_continuous", "kvgate_static"} <= results.keys():
        # What continuous batching could gain over static on these requests if a step cost the same whatever
        # it carries (the GPU regime); on a CPU a step's cost grows with its batch, so the gain is smaller.
        entry["step_ratio"] = results["kvgate_static"]["steps"] / results["kvgate_continuous"]["steps"]
    if bound_inputs is not None:
        entry["bound_inputs"] = bound_inputs
        if "bound" in results.get("kvgate_continuous", {}):  # the headline: kvgate continuous's median round
            entry.update({k: results["kvgate_continuous"][k]
                          for k in ("bound_tok_s", "fraction_of_bound", "binds", "bound")})
    return entry


def add_bounds(m: ModelRun, rounds: dict[str, list[dict]], traces: dict[str, list]) -> dict:
    """Each traced round's bound beside its figures (bench/bound.py), the device measured once after the
    contestants ran, on the same device in the same run; returns the bound's inputs."""
    import torch

    from kvgate.bench.bound import ModelCost, bound_entry, device_limits

    dtype = getattr(torch, m.workload.dtype)
    cost, limits = ModelCost.of(m.source.config, dtype), device_limits(m.device, dtype)
    for name, summaries in rounds.items():
        for summary, trace in zip(summaries, traces[name]):
            if trace is not None:
                summary.update(bound_entry(trace, cost, limits, summary["output_tokens"], summary["elapsed_s"]))
    return {"copy_bandwidth_gb_s": limits.bandwidth / 1e9, "peak_tflop_s": limits.peak_flops / 1e12,
            "peak_source": limits.peak_source, "weight_bytes": cost.weight_bytes,
            "kv_bytes_per_token": cost.kv_bytes_per_token, "layer_linear_params": cost.layer_linear_params,
            "head_params": cost.head_params, "attention_flops_per_position": cost.attention_flops_per_position}


def summarize(m: ModelRun, result) -> dict:
    wrong = sum(len(ids) != r.max_tokens for ids, r in zip(result.output_token_ids, m.requests))
    summary = {"output_tok_s": result.output_tokens / result.elapsed_s, "output_tokens": result.output_tokens,
               "requested_tokens": sum(r.max_tokens for r in m.requests), "elapsed_s": result.elapsed_s,
               "requests": len(result.output_token_ids), "requests_with_wrong_length": wrong,
               # On a shared CPU the contestants run at different loads; this shows how different.
               "load_avg_after": [round(x, 1) for x in os.getloadavg()]}
    if result.steps is not None:
        summary["steps"] = result.steps
    if result.round_checks is not None:
        summary.update(result.round_checks)
    if result.notes:
        summary["notes"] = result.notes
    return summary


def median_ratios(rounds: dict[str, list[dict]]) -> dict:
    """Each ratio taken within a round (contestants minutes apart, not a whole run apart), then the median."""
    per_round = [ratios(dict(zip(rounds, results))) for results in zip(*rounds.values())]
    return {key: statistics.median(r[key] for r in per_round) for key in per_round[0]}


def ratios(results: dict) -> dict:
    if "kvgate_continuous" not in results:
        return {}
    ours = results["kvgate_continuous"]["output_tok_s"]
    return {f"kvgate_continuous/{name}": ours / r["output_tok_s"] for name, r in results.items()
            if name != "kvgate_continuous"}


def kvgate_llm(m: ModelRun, scheduling: str):
    """The kvgate engine as every kvgate contestant runs it (also `kvgate bench steps`)."""
    from kvgate.engine import LLM

    budget = {"max_num_batched_tokens": m.workload.prefill_budget} if m.workload.prefill_budget else {}
    return LLM(m.source, device=str(m.device), dtype=m.workload.dtype, max_num_seqs=m.workload.max_num_seqs,
               max_model_len=m.max_model_len, scheduling=scheduling, seed=0, **budget)


def greedy_params(requests) -> list:
    """Greedy, each request exactly its own number of tokens."""
    from kvgate.engine import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]


WARM_UP_TOKENS = 2  # output tokens past the steps it takes to admit every prompt


def warm_up(llm, m: ModelRun) -> None:
    """A full-shape warm-up before the timed round: every request of the round at its own prompt length, each
    generating for as many steps as the prompts take to admit at the step budget (and WARM_UP_TOKENS more), so the
    batch fills as the round's does and the round's step shapes are met once untimed - mixed steps as full as the
    budget and max_num_seqs make them (every prefill-attention BLOCK_B the round can need: 64, 128, 256 sequences),
    decodes beside prefill chunks, the activation peak of the largest step. Token ids are shifted by one, so nothing
    of the round's prompts is left in the prefix cache. Decode-only steps at every batch size are the captured
    graphs' (load time)."""
    from kvgate.engine import SamplingParams

    vocab, budget = m.source.config.vocab_size, llm.engine.config.max_num_batched_tokens
    admitting = -(-sum(len(r.prompt_ids) for r in m.requests) // budget)
    params = SamplingParams(temperature=0, max_tokens=min(admitting + WARM_UP_TOKENS, m.workload.output_len[1]),
                            ignore_eos=True)
    llm.generate([[(t + 1) % vocab for t in r.prompt_ids] for r in m.requests], [params] * len(m.requests),
                 use_tqdm=False)


@contextmanager
def after_warm_up(install):
    """Within it, every kvgate engine this bench builds gets `install(llm, m)` as soon as its warm-up is done, so what
    `install` puts on it (a step clock) sees the timed round's steps only."""
    global warm_up
    warm = warm_up

    def warm_then_install(llm, m: ModelRun) -> None:
        warm(llm, m)
        install(llm, m)
    warm_up = warm_then_install
    try:
        yield
    finally:
        warm_up = warm


def run_kvgate(m: ModelRun, scheduling: str):
    import time

    from kvgate.bench.bound import StepTrace
    from kvgate.bench.compiles import RoundWatch, launched_kernels
    from kvgate.bench.hf import RunResult, synchronize

    launched_kernels()  # from the engine's load on: the graphs' capture and the warm-up compile, the round must not
    llm = kvgate_llm(m, scheduling)
    warm_up(llm, m)
    # the bound counts the steps of the timed round only: the runner reports each batch it is given
    trace, runner = StepTrace(), llm.engine.runner
    runner.run = trace.wrap(runner.run)
    params = greedy_params(m.requests)
    synchronize(m.device)
    watch = RoundWatch(m.device)
    steps_before, start = llm.engine.steps, time.perf_counter()
    outputs = llm.generate([r.prompt_ids for r in m.requests], params, use_tqdm=True)
    synchronize(m.device)
    elapsed = time.perf_counter() - start
    result = RunResult([list(o.token_ids) for o in outputs], elapsed, steps=llm.engine.steps - steps_before,
                       trace=trace, round_checks=watch.stop())
    del llm
    free_memory()
    return result


def run_hf_static(m: ModelRun):
    import torch

    from kvgate.bench.hf import hf_static

    model = hf_model(m)
    pad = pad_token_id(m.source.config)
    batch = m.workload.max_num_seqs
    warm_up_hf(model, m, pad)
    while True:
        try:
            result = hf_static(model, m.requests, batch, pad)
            break
        except torch.cuda.OutOfMemoryError:
            if not m.workload.find_largest_hf_batch or batch == 1:
                raise
            batch //= 2
            torch.cuda.empty_cache()
            print(f"hf static: out of memory, retrying with batch {batch}")
    result.notes = f"batch {batch}"
    del model
    free_memory()
    return result


def run_hf_generate_batch(m: ModelRun):
    from kvgate.bench.hf import hf_generate_batch

    model = hf_model(m)
    # On CPU it gets the cache kvgate gets there (room for every running sequence at full length); on a GPU it
    # sizes its own from free memory, as kvgate does.
    cache_tokens = m.workload.max_num_seqs * m.max_model_len if m.device.type == "cpu" else None
    result = hf_generate_batch(model, m.requests, max_batch_requests=m.workload.max_num_seqs,
                               cache_tokens=cache_tokens)
    del model
    free_memory()
    return result


def hf_model(m: ModelRun):
    import torch

    from kvgate.engine.loader import hf_reference_model

    with torch.device(m.device):  # HF's own (discarded) random init on the device, not on the host's CPU
        return hf_reference_model(m.source, getattr(torch, m.workload.dtype)).to(m.device)


def warm_up_hf(model, m: ModelRun, pad: int) -> None:
    from kvgate.bench.hf import BenchRequest, hf_static

    hf_static(model, [BenchRequest(m.requests[0].prompt_ids[:8], 2)], 1, pad)


def pad_token_id(config) -> int:
    for candidate in (config.pad_token_id, config.eos_token_id, 0):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return candidate
    return 0


def free_memory() -> None:
    """Free one contestant's weights and cache before the next one loads (on a GPU they would not fit twice)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


RUNNERS = {
    "kvgate_continuous": lambda m: run_kvgate(m, "continuous"),
    "kvgate_static": lambda m: run_kvgate(m, "static"),
    "hf_static": run_hf_static,
    "hf_generate_batch": run_hf_generate_batch,
}
