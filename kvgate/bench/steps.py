"""`kvgate bench steps`: W-CPU's requests once per scheduling policy with every engine step timed, to show where
continuous batching's gain over static comes from (fewer steps) and what it pays for them (fuller steps, prompts
prefilled beside decodes); `--profile N` adds a torch profile of N full-batch decode steps."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

from kvgate.bench.engine import (ModelRun, add_workload_arguments, greedy_params, kvgate_llm, make_requests,
                          scaled_workload, settings_of)

POLICIES = ("continuous", "static")


@dataclass(slots=True)
class StepTime:
    seconds: float
    seqs: int
    new_tokens: int

    @property
    def pure_decode(self) -> bool:
        return self.new_tokens == self.seqs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile N decode steps at the full batch (continuous) and print the top ops")


def run(args: argparse.Namespace) -> int:
    from kvgate.bench.report import machine_info, print_header, versions
    from kvgate.engine.model_runner import resolve_device
    from kvgate.engine.loader import resolve_model

    workload = scaled_workload(args)
    device = resolve_device(args.device)
    report = {"workload": f"{workload.name} steps", "machine": machine_info(device), "versions": versions(),
              "settings": settings_of(workload, device), "notes": [], "models": {}}
    print_header(report)
    for model in workload.models:
        source = resolve_model(model, seed=args.seed)
        m = ModelRun(source, make_requests(workload, source.config.vocab_size, args.seed), workload, device)
        entry = {policy: summarize(timed_pass(m, policy)) for policy in POLICIES}
        if args.profile:
            entry["profile"] = profile_decode(m, args.profile)
        report["models"][model] = entry
        print_entry(model, entry)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def timed_pass(m: ModelRun, policy: str) -> list[StepTime]:
    """Every request to completion under `policy`, each `ModelRunner.run` (one engine step's forward and
    sampling) timed."""
    from kvgate.bench.hf import synchronize

    llm = kvgate_llm(m, policy)
    runner, steps = llm.engine.runner, []
    forward = runner.run

    def timed(batch):
        start = time.perf_counter()
        out = forward(batch)
        synchronize(m.device)
        steps.append(StepTime(time.perf_counter() - start, len(batch), sum(n for _, n in batch)))
        return out

    runner.run = timed
    llm.generate([r.prompt_ids for r in m.requests], greedy_params(m.requests), use_tqdm=True)
    return steps


def summarize(steps: list[StepTime]) -> dict:
    decode = [s for s in steps if s.pure_decode]
    mixed = [s for s in steps if not s.pure_decode]
    by_batch = defaultdict(list)
    for s in decode:
        by_batch[-(-s.seqs // 4) * 4].append(s.seconds)  # batches of up to 4, 8, ... sequences
    return {"steps": len(steps), "seconds": sum(s.seconds for s in steps),
            "prefill_or_mixed": {"steps": len(mixed), "seconds": sum(s.seconds for s in mixed)},
            "decode": {"steps": len(decode), "seconds": sum(s.seconds for s in decode),
                       "mean_seqs": statistics.fmean(s.seqs for s in decode) if decode else 0.0,
                       "mean_ms_by_seqs": {k: 1e3 * statistics.fmean(v) for k, v in sorted(by_batch.items())}}}


def profile_decode(m: ModelRun, steps: int) -> str:
    """The top ops of `steps` decode steps once the first full batch is prefilled."""
    from torch.profiler import profile

    from kvgate.engine import SamplingParams

    engine, batch = kvgate_llm(m, "continuous").engine, m.requests[: m.workload.max_num_seqs]
    for i, r in enumerate(batch):
        engine.add_request(str(i), r.prompt_ids, SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    while len(engine.step()) < len(batch):  # until every prompt is prefilled, in chunks or not
        pass
    with profile() as prof:
        for _ in range(steps):
            engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def print_entry(model: str, entry: dict) -> None:
    print(f"\n{model}")
    for policy in POLICIES:
        r = entry[policy]
        mixed, decode = r["prefill_or_mixed"], r["decode"]
        by = ", ".join(f"<={k}: {v:.1f}" for k, v in decode["mean_ms_by_seqs"].items())
        print(f"  {policy:<10} {r['steps']} steps, {r['seconds']:.1f} s: prefill or mixed {mixed['steps']} steps "
              f"{mixed['seconds']:.1f} s; decode {decode['steps']} steps {decode['seconds']:.1f} s, mean batch "
              f"{decode['mean_seqs']:.1f}")
        print(f"  {'':<10} decode ms a step by sequences in it: {by}")
    if "profile" in entry:
        print(entry["profile"])
