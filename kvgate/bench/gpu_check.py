"""`make gpu-check OUT=dir`: every GPU check of the step issue in one run of at most 9 minutes on one H100/H200,
each in its own subprocess with its own time limit, its log and JSON written to OUT and a summary.json beside them.

1. pytest -m gpu: the Triton kernels against their twins, parity through the kernels, and CUDA-graph replay
   equal to eager on tiny models (float32 and bfloat16);
2. graphs: CUDA-graph replay equal to eager at full size (random:qwen2.5-0.5b, bf16 and fp32, 48 requests);
3. parity: each random: config against HF transformers on the same GPU (float32), teacher-forced logprobs;
4. kernels: the tile-tuning table (python -m kvgate.bench.kernels);
5. W-GPU: kvgate bench engine --workload gpu for random:qwen2.5-0.5b, every contestant, with the bandwidth
   ceiling, then kvgate continuous alone for the other two models."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

RANDOM_MODELS = ("random:qwen2.5-0.5b", "random:qwen3-0.6b", "random:llama-3.2-1b")
PY = sys.executable


def steps(out: Path) -> list[tuple[str, list[str], int]]:
    """(name, command, seconds allowed); the limits add up to 540 s."""
    me = [PY, "-m", "kvgate.bench.gpu_check"]
    bench = [PY, "-m", "kvgate.commands.cli", "bench", "engine", "--workload", "gpu"]
    return [
        ("pytest-gpu", [PY, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                        f"--junitxml={out / 'pytest-gpu.xml'}", "tests"], 100),
        ("graphs", me + ["--only", "graphs", str(out)], 60),
        ("parity", me + ["--only", "parity", str(out)], 80),
        ("kernels", [PY, "-m", "kvgate.bench.kernels", "--json", str(out / "kernels.json")], 60),
        ("w-gpu-qwen2.5", bench + ["--model", RANDOM_MODELS[0], "--json", str(out / "w-gpu-qwen2.5.json")], 170),
        ("w-gpu-others", bench + ["--model", RANDOM_MODELS[1], "--model", RANDOM_MODELS[2], "--contestants",
                                  "kvgate_continuous", "--json", str(out / "w-gpu-others.json")], 70),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for the logs and JSON")
    parser.add_argument("--only", choices=("graphs", "parity"), help="run one in-process check (used by the run)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only == "graphs":
        return write(args.out / "graphs.json", check_graphs())
    if args.only == "parity":
        return write(args.out / "parity.json", check_parity())
    summary = {}
    for name, command, limit in steps(args.out):
        start = time.monotonic()
        with open(args.out / f"{name}.log", "w") as log:
            try:
                rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=limit).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        summary[name] = {"rc": rc, "seconds": round(time.monotonic() - start, 1), "limit_s": limit,
                         "command": " ".join(command)}
        print(f"{name:<14} rc={rc} {summary[name]['seconds']} s", flush=True)
    write(args.out / "summary.json", summary)
    return 0 if all(s["rc"] == 0 for s in summary.values()) else 1


def write(path: Path, data: dict) -> int:
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data, indent=2))
    return 0 if data.get("ok", True) else 1


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy_ids(engine, prompts: list[list[int]], lengths: list[int], logprobs: int | None = None):
    from kvgate.engine import SamplingParams
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                          logprobs=logprobs))
    ids: dict[str, list[int]] = {}
    lps: dict[str, list[dict[int, float]]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            ids.setdefault(o.request_id, []).extend(o.new_token_ids)
            lps.setdefault(o.request_id, []).extend(o.logprobs or [])
    order = [str(i) for i in range(len(prompts))]
    return [ids[r] for r in order], [lps[r] for r in order]


def check_graphs() -> dict:
    """Token ids of graph replay against enforce_eager, same GPU, same requests."""
    from kvgate.engine import LLMEngine
    from kvgate.engine.loader import resolve_model

    source = resolve_model(RANDOM_MODELS[0])
    prompts = random_prompts(48, 20, 200, source.config.vocab_size)
    lengths = [8 + 3 * i for i in range(48)]  # the batch shrinks through every bucket
    result = {"model": RANDOM_MODELS[0], "requests": 48}
    for dtype in ("bfloat16", "float32"):
        kwargs = dict(device="cuda", dtype=dtype, max_num_seqs=48, gpu_memory_utilization=0.4)
        eager, _ = greedy_ids(LLMEngine(source, enforce_eager=True, **kwargs), prompts, lengths)
        engine = LLMEngine(source, **kwargs)
        graphed, _ = greedy_ids(engine, prompts, lengths)
        same = sum(a == b for a, b in zip(eager, graphed))
        result[dtype] = {"identical_requests": same, "replayed_steps_by_bucket": engine.runner.graphs.replayed}
    result["ok"] = all(result[d]["identical_requests"] == 48 for d in ("bfloat16", "float32"))
    return result


def check_parity() -> dict:
    """kvgate's greedy tokens and top-5 logprobs against HF's forward over the same tokens (float32): robust to
    the near-ties of random weights, which make comparing free-running greedy ids meaningless."""
    import torch

    from kvgate.engine import LLMEngine
    from kvgate.engine.loader import hf_reference_model, resolve_model

    result, ok = {}, True
    for name in RANDOM_MODELS:
        source = resolve_model(name)
        prompts = random_prompts(4, 16, 120, source.config.vocab_size)
        engine = LLMEngine(source, device="cuda", dtype="float32", max_num_seqs=4, gpu_memory_utilization=0.4)
        ids, lps = greedy_ids(engine, prompts, [16] * 4, logprobs=5)
        del engine
        hf = hf_reference_model(source, torch.float32).cuda()
        worst = 0.0
        with torch.no_grad():
            for prompt, out, lp in zip(prompts, ids, lps):
                full = torch.tensor([prompt + out], device="cuda")
                logp = hf(full).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
                for pos, row in enumerate(lp):
                    for token, value in row.items():
                        worst = max(worst, abs(value - logp[pos, token].item()))
        del hf
        torch.cuda.empty_cache()
        result[name] = {"max_abs_logprob_diff": worst, "positions": sum(len(x) for x in lps)}
        ok = ok and worst < 2e-3
    result["ok"] = ok
    return result


if __name__ == "__main__":
    sys.exit(main())
