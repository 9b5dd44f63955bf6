"""`kvgate bench engine --prefill-budget-sweep 2048,4096,8192,16384`: kvgate continuous on the workload once per step
token budget (max_num_batched_tokens), to choose the engine's default by measurement (issue 41; nano-vllm and
Mini-SGLang use 16,384). A larger budget prefills more prompts per step (fewer, fuller prefill steps, a higher
activation peak); a smaller one interleaves prefill chunks with decodes more finely. Each budget reports its median
round's output tok/s (the rounds beside it), its steps, and the mean and longest prefill-or-mixed step."""
from __future__ import annotations

import statistics
import time
from dataclasses import replace


def sweep(workload, budgets: list[int], device, seed: int, repeats: int, run_model, after_warm_up) -> dict:
    """`run_model` and `after_warm_up` are bench/engine.py's (which calls this: passed, not imported back)."""
    found: dict = {}
    for model in workload.models:
        found[model] = {}
        for budget in budgets:
            timed = replace(workload, prefill_budget=budget)
            runs = StepTimes.watching(after_warm_up, lambda: run_model(model, timed, ["kvgate_continuous"], device,
                                                                       seed, repeats))
            r = runs.entry["contestants"]["kvgate_continuous"]
            found[model][budget] = {"output_tok_s": r["output_tok_s"], "rounds_tok_s": r["rounds_tok_s"],
                                    "steps": r.get("steps"), **runs.prefill_steps()}
            print(f"{model} prefill budget {budget}: {r['output_tok_s']:.1f} tok/s (rounds "
                  f"{' / '.join(f'{x:.1f}' for x in r['rounds_tok_s'])}), {r.get('steps')} steps, prefill or mixed "
                  f"steps {found[model][budget]['prefill_steps']}, mean {found[model][budget]['prefill_step_ms']:.1f} "
                  f"ms", flush=True)
        best = max(found[model], key=lambda b: found[model][b]["output_tok_s"])
        found[model]["best"] = best
        print(f"{model}: the best budget here is {best} (the median round of each)")
    return found


class StepTimes:
    """Every prefill-or-mixed step's seconds in the timed rounds (a step with more new tokens than sequences), taken
    by wrapping each engine's runner once its warm-up is done."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.entry: dict = {}

    @classmethod
    def watching(cls, after_warm_up, run) -> StepTimes:
        """Run `run` with every kvgate engine's steps after its warm-up timed."""
        from kvgate.bench.hf import synchronize

        times = cls()

        def install(llm, m) -> None:
            forward = llm.engine.runner.run

            def step(batch):
                start = time.perf_counter()
                out = forward(batch)
                synchronize(m.device)
                if sum(n for _, n in batch) > len(batch):
                    times.seconds.append(time.perf_counter() - start)
                return out
            llm.engine.runner.run = step
        with after_warm_up(install):
            times.entry = run()
        return times

    def prefill_steps(self) -> dict:
        s = self.seconds
        return {"prefill_steps": len(s), "prefill_step_ms": 1e3 * statistics.fmean(s) if s else 0.0,
                "longest_prefill_step_ms": 1e3 * max(s, default=0.0)}
