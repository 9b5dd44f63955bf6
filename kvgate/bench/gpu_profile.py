"""`make gpu-profile OUT=dir` (or `python -m kvgate.bench.gpu_profile dir` from the checkout's root): one short GPU run
whose figures decide issue 41's next step, on `make gpu-kit`'s offline kit like `make gpu-check` (which stays the
pass/fail check). Each stage runs in its own process under its own limit; the limits sum to BUDGET_S (300 s, one
global deadline); at most MAX_FILES_OUT (8) files come back. Stages (gpu_profile_stages.py):

1. preflight: versions, the GPU, its clocks (nvidia-smi), whether CUPTI records device kernels; a failure stops the run;
2. w-gpu-warm: W-GPU on qwen2.5, kvgate continuous, one round after the full-shape warm-up, with its Triton compiles
   and allocator growth (both 0 when warm), its bound, and each step's host wall, GPU span and input building;
3. torch-profile: decode steps at the full batch under torch.profiler: top kernels by device time, kernels per step
   (and per layer), GPU idle share;
4. graph-floor: each captured decode bucket replayed on padding rows: the floor of a decode step by batch size;
5. split-sweep: decode attention at B=256, context U[100, 2048], each split count and the kernel's own, per layout;
6. prefill-sdpa: kvgate's prefill attention against torch SDPA (flash, cuDNN, efficient, math) on equal shapes.

OUT gets run.log, summary.json, results.tgz (every stage's log and JSON), triton-cache.tgz, preflight.json,
w-gpu-warm.json and profile.json (stages 3-6, one section each). KVGATE_DEVICE=cpu runs every stage on the CPU at toy
sizes (`make gpu-profile-rehearsal`): the plumbing (limits, files, format) is tested, no figure counts."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from kvgate.bench.gpu_check_runner import LIMIT_SCALE_VARIABLE, OWN_FILES, Run, Step

BUDGET_S = 300
MAX_FILES_OUT = 8
PY = sys.executable
# (stage, limit in s, the file of the work folder it returns); the limits sum to BUDGET_S
STAGES = (("preflight", 20, "preflight.json"), ("w-gpu-warm", 110, "w-gpu-warm.json"),
          ("torch-profile", 55, "profile.json"), ("graph-floor", 35, "profile.json"),
          ("split-sweep", 45, "profile.json"), ("prefill-sdpa", 35, "profile.json"))


def plan(work: Path) -> list[Step]:
    me = (PY, "-m", "kvgate.bench.gpu_profile")
    return [Step(name, (*me, "--stage", name, "--work", str(work)), limit, returns) for name, limit, returns in STAGES]


def out_files(steps: list[Step]) -> list[str]:
    return [*OWN_FILES, *dict.fromkeys(s.returns for s in steps if s.returns)]


class ProfileRun(Run):
    def conclusions(self) -> dict:
        """The headline figures of the run, where their stages finished."""
        found = {}
        for name, keys in (("w-gpu-warm.json", ("output_tok_s", "fraction_of_bound", "binds", "triton_compiles",
                                                "allocator_growth_bytes")),):
            try:
                data = json.loads((self.work / name).read_text())
            except (OSError, ValueError):
                continue
            found.update({f"w_gpu_warm_{k}": data.get(k) for k in keys})
        try:
            profile = json.loads((self.work / "profile.json").read_text()).get("torch_profile", {})
            found.update({f"decode_{k}": profile.get(k) for k in ("kernels_per_step", "gpu_idle_share")})
        except (OSError, ValueError):
            pass
        return found


def run_stage(name: str, work: Path) -> int:
    from kvgate.bench import gpu_profile_stages
    from kvgate.bench.gpu_checks import scale

    sc = scale()
    returns = dict((n, r) for n, _, r in STAGES)[name]
    result = gpu_profile_stages.STAGES[name](work / returns, sc)
    print(json.dumps(result, indent=1, default=str)[:20000])
    return 0 if result.get("ok", True) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-profile", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", default=Path("gpu-profile-out"), help="folder for what comes back")
    parser.add_argument("--work", type=Path, help="folder for every stage's files (default: a temporary one)")
    parser.add_argument("--only", help="stages to run, comma-separated (a rerun on a warm machine)")
    parser.add_argument("--stage", choices=[n for n, _, _ in STAGES], help="run one stage in-process into --work")
    args = parser.parse_args(argv)
    rehearsal = os.environ.get("KVGATE_DEVICE", "cuda") == "cpu"
    if args.stage:
        if args.work is None:
            parser.error("--stage needs --work, the folder its JSON goes to")
        if rehearsal:  # the Triton kernels run in the interpreter: set before Triton is first imported
            os.environ.setdefault("TRITON_INTERPRET", "1")
            from kvgate.bench.triton_interpreter import squeeze_scalar_index

            squeeze_scalar_index()
        return run_stage(args.stage, args.work)
    stretch = float(os.environ.get(LIMIT_SCALE_VARIABLE, "1")) if rehearsal else 1.0
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="kvgate-gpu-profile-"))
    work.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    steps = [replace(s, limit_s=round(s.limit_s * stretch)) for s in plan(work)]
    return ProfileRun(args.out, work, rehearsal, BUDGET_S * stretch).run(steps, only)


if __name__ == "__main__":
    sys.exit(main())
