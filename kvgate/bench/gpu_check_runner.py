"""The runner of the offline GPU check, `make gpu-check OUT=dir` (or `python -m kvgate.bench.gpu_check_runner dir`
from the checkout's root): every GPU check of the step issue in one run on one H100/H200 with no network, each step in
its own process under its own limit, the limits summing to BUDGET_S (one global deadline), at most MAX_FILES_OUT files
in OUT; the in-process checks a step runs are in gpu_checks.py.

It runs on a bare image (the image's python, `make gpu-kit`'s wheels on PYTHONPATH, no install: `import kvgate`
finds the checkout's layers by itself). Steps:

0. preflight (seconds): versions, the GPU, every entry point imports, one kernel against its twin; a failure
   stops the run with its reason in summary.json;
1. pytest -m gpu over the four files that hold the GPU tests: kernels against their twins (xdist when present),
   then CUDA graphs, KV sizing and parity through the kernels;
2. graphs: replay against eager at full size (random:qwen2.5-0.5b, 48 requests): float32 ids identical, bfloat16
   logprobs on the same inputs at every decode step;
3. parity: each random: config against HF transformers on the same GPU (float32, teacher-forced logprobs);
4. W-GPU in three steps, so that a slow HF baseline cannot take kvgate's figures down: kvgate on qwen2.5
   (continuous and static), kvgate continuous on the other two models, HF static and generate_batch on qwen2.5;
5. kernels: the tile-tuning table.

OUT gets run.log, summary.json (rewritten after every step), results.tgz (every step's log, JSON and junit XML,
repacked after every step), the four headline JSON files as they appear, and triton-cache.tgz (this run's compiled
kernels, for a rerun). KVGATE_DEVICE=cpu rehearses every step's mechanics on a CPU (`make gpu-rehearsal`)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

BUDGET_S = 480
# The CPU rehearsal's steps are small, but a shared CPU may run them at a fraction of a core: its limits (and
# budget) may be stretched with KVGATE_GPU_CHECK_LIMIT_SCALE; a GPU run always keeps 480 s.
LIMIT_SCALE_VARIABLE = "KVGATE_GPU_CHECK_LIMIT_SCALE"
MAX_FILES_OUT = 8
OWN_FILES = ("run.log", "summary.json", "results.tgz", "triton-cache.tgz")
GPU_TEST_FILES = {  # the only files with GPU tests: collecting all of tests/ needs the gateway's and Redis' packages
    "pytest-kernels": ("tests/kernels/test_kernel_gpu.py", "tests/kernels/test_kernel_qkv_rope_store.py"),
    "pytest-engine": ("tests/engine/test_cuda_graphs.py", "tests/engine/test_kv_sizing.py",
                      "tests/engine/test_model_parity.py", "tests/engine/test_overlap.py",
                      "tests/engine/test_sampler_precision.py"),
}
PY = sys.executable


@dataclass(slots=True, frozen=True)
class Step:
    name: str
    command: tuple[str, ...]
    limit_s: int
    returns: str | None = None  # a file of the work folder copied to OUT as soon as it exists


def plan(work: Path, rehearsal: bool = False) -> list[Step]:
    """The steps in order; their limits sum to BUDGET_S (the rehearsal's too: its steps are small, not its limits)."""
    from kvgate.bench.gpu_checks import RANDOM_MODELS

    me = (PY, "-m", "kvgate.bench.gpu_check_runner")
    pytest = (PY, "-m", "pytest", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider", "--durations=10")
    workers = ("-n", "2" if rehearsal else "8") if has_xdist() else ()

    def w_gpu(name: str, models, contestants) -> tuple[str, ...]:
        return (*me, "--check", "w-gpu", "--work", str(work), "--models", ",".join(models), "--contestants",
                ",".join(contestants), "--json", str(work / f"{name}.json"))
    qwen, others = RANDOM_MODELS[0], RANDOM_MODELS[1:]
    # the rehearsal runs the whole kernel folder: with no GPU the kernels run in the image's Triton interpreter
    kernel_tests = ("tests/kernels",) if rehearsal else ("-m", "gpu", *GPU_TEST_FILES["pytest-kernels"])
    return [
        Step("preflight", (*me, "--check", "preflight", "--work", str(work)), 40),
        Step("pytest-kernels", (*pytest, *workers, f"--junitxml={work / 'pytest-kernels.xml'}", *kernel_tests), 85),
        Step("pytest-engine", (*pytest, f"--junitxml={work / 'pytest-engine.xml'}", "-m", "gpu",
                               *GPU_TEST_FILES["pytest-engine"]), 45),
        Step("graphs", (*me, "--check", "graphs", "--work", str(work)), 60, "graphs.json"),
        Step("parity", (*me, "--check", "parity", "--work", str(work)), 60, "parity.json"),
        Step("w-gpu-qwen2.5", w_gpu("w-gpu-qwen2.5", [qwen], ["kvgate_continuous", "kvgate_static"]), 60,
             "w-gpu-qwen2.5.json"),
        Step("w-gpu-others", w_gpu("w-gpu-others", others, ["kvgate_continuous"]), 50),
        Step("w-gpu-qwen2.5-hf", w_gpu("w-gpu-qwen2.5-hf", [qwen], ["hf_static", "hf_generate_batch"]), 50),
        Step("kernels", (PY, "-m", "kvgate.bench.kernels", *(("--tiny",) if rehearsal else ()), "--json",
                         str(work / "kernels.json")), 30, "kernels.json"),
    ]


def out_files(steps: list[Step]) -> list[str]:
    return [*OWN_FILES, *(s.returns for s in steps if s.returns)]


def has_xdist() -> bool:
    import importlib.util

    return importlib.util.find_spec("xdist") is not None


def environment(rehearsal: bool) -> dict[str, str]:
    repo = str(Path(__file__).resolve().parents[2])
    paths = [repo, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "KVGATE_DEVICE": "cpu" if rehearsal else os.environ.get("KVGATE_DEVICE", "cuda")}


class Run:
    """The steps against one deadline; after each: summary.json, results.tgz and the step's headline file in OUT."""

    def __init__(self, out: Path, work: Path, rehearsal: bool, budget_s: float = BUDGET_S) -> None:
        self.out, self.work, self.rehearsal, self.budget_s = out, work, rehearsal, budget_s
        self.deadline = time.monotonic() + budget_s
        self.summary: dict = {"budget_s": budget_s, "device": "cpu (rehearsal)" if rehearsal else "cuda",
                              "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": {}}
        self.triton_cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))

    def log(self, line: str) -> None:
        line = f"[{self.budget_s - self.left():5.0f}s] {line}"
        print(line, flush=True)
        with open(self.out / "run.log", "a") as f:
            f.write(line + "\n")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def kernels_cached(self) -> int:
        return len(list(self.triton_cache.iterdir())) if self.triton_cache.is_dir() else 0

    def run(self, steps: list[Step], only: set[str] | None = None) -> int:
        env = environment(self.rehearsal)
        for step in steps:
            if only and step.name not in only:
                continue
            if self.left() < 5:
                self.record(step, {"rc": "skipped", "reason": f"{max(self.left(), 0):.0f} s left of {self.budget_s}"})
                continue
            limit = min(step.limit_s, int(self.left()))
            self.log(f"START {step.name} (limit {limit} s)")
            before, start = self.kernels_cached(), time.monotonic()
            with open(self.work / f"{step.name}.log", "w") as log:
                try:
                    rc = subprocess.run(step.command, stdout=log, stderr=subprocess.STDOUT, timeout=limit,
                                        env=env).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            self.record(step, {"rc": rc, "seconds": round(time.monotonic() - start, 1), "limit_s": limit,
                               "triton_kernels_compiled": self.kernels_cached() - before})
            if step.name == "preflight" and rc != 0:
                reason = self.summary["steps"][step.name].get("reason") or f"rc={rc}, see its log in results.tgz"
                self.log(f"FATAL: the preflight failed ({reason}); the run stops here")
                break
        self.finish()
        return 0 if all(s["rc"] == 0 for s in self.summary["steps"].values()) else 1

    def conclusions(self) -> dict:
        """What the summary says across steps at the end."""
        return {"w_gpu_qwen2.5_kvgate_continuous_over": across_steps(self.work)}

    def record(self, step: Step, entry: dict) -> None:
        entry.update(step_findings(self.work, step))
        self.summary["steps"][step.name] = entry
        self.log(f"END   {step.name} rc={entry['rc']} {entry.get('seconds', 0)} s"
                 + (f" ok={entry['ok']}" if "ok" in entry else ""))
        if entry["rc"] not in (0, "skipped"):
            tail = (self.work / f"{step.name}.log")
            if tail.exists():
                with open(self.out / "run.log", "a") as f:
                    f.write(f"----- tail of {step.name}.log\n{tail.read_text(errors='replace')[-3000:]}\n")
        if step.returns and (self.work / step.returns).exists():
            shutil.copy2(self.work / step.returns, self.out / step.returns)
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1, default=str) + "\n")
        pack(self.work, self.out / "results.tgz")

    def finish(self) -> None:
        self.summary["seconds"] = round(self.budget_s - self.left(), 1)
        self.summary.update(self.conclusions())
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1, default=str) + "\n")
        if self.triton_cache.is_dir() and self.left() > 0:
            pack_triton_cache(self.triton_cache, self.out / "triton-cache.tgz")
        self.log(f"done; OUT holds {', '.join(sorted(p.name for p in self.out.iterdir()))}")


def step_findings(work: Path, step: Step) -> dict:
    """What a step's files say: pytest counts and failures, a check's ok and reason, W-GPU's headline figures."""
    import xml.etree.ElementTree as ET

    found: dict = {}
    xml = work / f"{step.name}.xml"
    if xml.exists():
        root = ET.parse(xml).getroot()
        suites = [root] if root.tag == "testsuite" else list(root)
        found.update({k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")})
        found["failed"] = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
                           if c.find("failure") is not None or c.find("error") is not None][:30]
    data_file = work / (step.returns or f"{step.name}.json")
    if data_file.exists():
        try:
            data = json.loads(data_file.read_text())
        except ValueError:
            return found
        found.update({k: data[k] for k in ("ok", "reason") if k in data})
        if "ok" not in data and "--check" in step.command:  # killed before its end: what it had finished
            found["partial"] = sorted(k for k in data if k not in ("machine", "versions", "settings", "notes"))
        for model, entry in data.get("models", {}).items():
            found.setdefault("tok_s", {})[model] = {c: round(r["output_tok_s"]) for c, r in
                                                    entry["contestants"].items()}
            found.setdefault("rounds_tok_s", {})[model] = {c: [round(x) for x in r.get("rounds_tok_s", [])]
                                                           for c, r in entry["contestants"].items()}
            found.setdefault("rounds_triton_compiles", {})[model] = {  # a warm round compiles nothing
                c: r["rounds_triton_compiles"] for c, r in entry["contestants"].items()
                if "rounds_triton_compiles" in r}
            if "fraction_of_bound" in entry:
                found.setdefault("bound", {})[model] = {k: entry[k] for k in ("bound_tok_s", "fraction_of_bound",
                                                                              "binds")}
    return found


def across_steps(work: Path) -> dict | str:
    """kvgate continuous over every other contestant on qwen2.5, across the steps that ran them apart (same seed,
    same requests): the issue's targets are >= 10x HF static and >= 2x HF generate_batch."""
    try:
        runs = {}
        for name in ("w-gpu-qwen2.5", "w-gpu-qwen2.5-hf"):
            runs.update(json.loads((work / f"{name}.json").read_text())["models"]["random:qwen2.5-0.5b"]["contestants"])
        ours = runs.pop("kvgate_continuous")["output_tok_s"]
        return {name: ours / r["output_tok_s"] for name, r in runs.items()}
    except (OSError, KeyError, ValueError) as e:
        return f"not available: {type(e).__name__}: {e}"


def pack(folder: Path, target: Path) -> None:
    tmp = target.with_suffix(".part")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(folder, arcname=".")
    tmp.replace(target)


def pack_triton_cache(cache: Path, target: Path) -> None:
    """This run's compiled kernels for a rerun, small: per kernel its metadata and cubin (not its IR or PTX), its
    group file naming just those (a group file lists absolute paths: the rerun unpacks at the same
    TRITON_CACHE_DIR)."""
    import io

    tmp = target.with_suffix(".part")
    with tarfile.open(tmp, "w:gz") as tar:
        for group in cache.glob("*/__grp__*.json"):
            try:
                children = json.loads(group.read_text())["child_paths"]
            except (OSError, ValueError, KeyError):
                continue
            keep = {name: path for name, path in children.items() if name.endswith((".json", ".cubin"))}
            for path in keep.values():
                if Path(path).exists():
                    tar.add(path, arcname=str(Path(path).relative_to(cache)))
            data = json.dumps({"child_paths": keep}).encode()
            info = tarfile.TarInfo(str(group.relative_to(cache)))
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", default=Path("gpu-check-out"), help="folder for what comes back")
    parser.add_argument("--work", type=Path, help="folder for every step's files (default: a temporary one)")
    parser.add_argument("--only", help="steps to run, comma-separated (a rerun on a warm machine)")
    parser.add_argument("--check", choices=("preflight", "graphs", "parity", "w-gpu"),
                        help="run one in-process check into --work (what a step runs)")
    parser.add_argument("--models", help="w-gpu: models, comma-separated")
    parser.add_argument("--contestants", help="w-gpu: contestants, comma-separated")
    parser.add_argument("--json", type=Path, help="w-gpu: where its figures go")
    args = parser.parse_args(argv)
    rehearsal = os.environ.get("KVGATE_DEVICE", "cuda") == "cpu"
    stretch = float(os.environ.get(LIMIT_SCALE_VARIABLE, "1")) if rehearsal else 1.0
    if args.check:
        if args.work is None:
            parser.error("--check needs --work, the folder its JSON goes to")
        return run_check(args)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="kvgate-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    steps = [replace(s, limit_s=round(s.limit_s * stretch)) for s in plan(work, rehearsal)]
    return Run(args.out, work, rehearsal, BUDGET_S * stretch).run(steps, only)


def run_check(args: argparse.Namespace) -> int:
    from kvgate.bench import gpu_checks

    sc = gpu_checks.scale()
    if args.check == "w-gpu":
        result = gpu_checks.check_w_gpu(args.json, sc, args.models.split(","), args.contestants.split(","))
    else:
        result = gpu_checks.CHECKS[args.check](args.work / f"{args.check}.json", sc)
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "versions")}, indent=1, default=str))
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
