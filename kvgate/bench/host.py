"""`kvgate bench host`: W-HOST from shared/benchmarks.md, the engine thread's CPU time per step, split into
schedule, input preparation, sampling and post-processing, on a tiny random model whose forward costs nothing.

Streaming detokenization is measured two ways: " detok", the engine decoding inline in its step (what
`add_request(stream_text=True)` does), and " detok-thread", the worker's way: the engine emits ids only and a
DetokenizerThread decodes each step while the next one runs; there the engine thread's time includes handing the
step over and taking the previous step's text back, the wall time per step shows what the detokenizer thread's
share of the GIL costs the step, and the detokenizer thread's own CPU time per step is reported beside it.

The overlap rows (issue 41) run the largest batch's decode steps over a GPU-like device stub (`StubDevice`:
`--device-ms` of device time a step, on the engine thread's CPU clock) with the plain step and with steps launched
ahead (engine/overlap.py), and report the device's idle time before each full-batch decode step: the host time a
GPU would see exposed, overall and over the steps launched while the one before was still outstanding.

`--baseline-ref REF` runs the same cases on the engine of another commit in the same run (`--rounds N`: N times,
the engines taking turns at going first): the commit is extracted with `git archive` into a temporary folder (the
repository's worktrees are not touched) and each engine's cases run in a fresh subprocess of this file with that
tree first on sys.path. The measuring code below imports only `kvgate.engine`, so it runs unchanged against
either engine."""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGE_DIRS = {"engine": "engine", "kernels": "kernels", "producer": "producer", "worker": "worker"}
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--baseline-ref", help="also measure the engine of this git commit (e.g. HEAD~1), side by side")
    parser.add_argument("--batches", default="64,256", help="max_num_seqs values (comma-separated)")
    parser.add_argument("--num-requests", type=int, default=512, help="requests per case (W-HOST: 512)")
    parser.add_argument("--max-output", type=int, help="cap the output lengths (W-HOST: 200-400)")
    parser.add_argument("--no-gpu-shaped", action="store_true", help="skip the W-GPU-shaped run (forward stubbed)")
    parser.add_argument("--detok", choices=("all", "none"), default="all",
                        help="'none': only the cases without streaming detokenization (default all)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every case this many times, the engines taking turns at going first; the "
                             "report gives each case's median and each round's temperature / greedy ratio")
    parser.add_argument("--device-ms", type=float, default=3.5,
                        help="device time of a decode step in the overlap rows' GPU-like stub (default 3.5 ms: a "
                             "batch-256 step at 70k tok/s)")
    parser.add_argument("--no-overlap", action="store_true", help="skip the overlap rows (plain and overlapped step "
                                                                  "over a device stub)")
    parser.add_argument("--seed", type=int, default=0)


def cases_of(args: argparse.Namespace) -> list[dict]:
    out_hi = min(400, args.max_output) if args.max_output else 400
    out = (min(200, out_hi), out_hi)
    # detok: None (ids only), "inline" (the engine decodes in step), "thread" (a DetokenizerThread, as the worker)
    cases = [dict(name=f"b{b} {'t0.6' if t else 'greedy'}{DETOK_NAMES[d]}", batch=b, temperature=t,
                  stream=d is not None, detok=d, num_requests=args.num_requests, prompt=(32, 128), output=out,
                  stub=False, seed=args.seed)
             for b in (int(x) for x in args.batches.split(",")) for t in (0.0, 0.6)
             for d in ((None, "inline", "thread") if args.detok == "all" else (None,))]
    if not args.no_overlap:  # the largest batch's decode steps over a GPU-like device, plain then launched ahead
        b = max(int(x) for x in args.batches.split(","))
        cases += [dict(name=f"b{b} device {args.device_ms:g} ms overlap {mode}", batch=b, temperature=0.0,
                       stream=False, detok=None, num_requests=args.num_requests, prompt=(32, 128), output=out,
                       stub=True, seed=args.seed, device_ms=args.device_ms, overlap=mode) for mode in ("off", "on")]
    if not args.no_gpu_shaped:
        gpu_out = (min(100, out_hi), min(1024, args.max_output or 1024))
        cases.append(dict(name="W-GPU-shaped stub", batch=256, temperature=0.0, stream=False,
                          num_requests=min(256, args.num_requests), prompt=(100, 1024), output=gpu_out, stub=True,
                          seed=args.seed))
    return cases


def run(args: argparse.Namespace) -> int:
    from kvgate.bench.report import machine_info, versions

    import torch
    trees = {"current": None}
    tmp = None
    if args.baseline_ref:
        tmp = Path(tempfile.mkdtemp(prefix="kvgate-baseline-"))
        trees = {"baseline": overlay_of(args.baseline_ref, tmp), "current": None}
    report = {"workload": "W-HOST", "machine": machine_info(torch.device("cpu")), "versions": versions(),
              "baseline_ref": args.baseline_ref, "commit": git_rev("HEAD"),
              "baseline_commit": git_rev(args.baseline_ref) if args.baseline_ref else None,
              "time": "time.thread_time of the engine thread, torch.set_num_threads(1)", "cases": []}
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds} must be at least 1")
    cases = cases_of(args)
    rounds: dict[str, list[list[dict]]] = {label: [] for label in trees}
    try:
        for k in range(args.rounds):  # the engines take turns at going first, so a drift of the machine weighs alike
            for label in (list(trees) if k % 2 == 0 else list(trees)[::-1]):
                rounds[label].append(run_child(cases, trees[label]))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    for i, case in enumerate(cases):
        entry = {"case": case, **{label: median_round([r[i] for r in rs]) for label, rs in rounds.items()}}
        if "baseline" in entry:
            entry["ratio_host_ms"] = ratio(entry["baseline"], entry["current"])
        report["cases"].append(entry)
        print_case(entry)
    if args.rounds > 1:
        report["temperature_to_greedy"] = temperature_ratios(cases, rounds)
        for label, by_case in report["temperature_to_greedy"].items():
            for name, per_round in by_case.items():
                print(f"{label} {name} / greedy, by round: {per_round['rounds']} (median {per_round['median']})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def git_rev(ref: str) -> str:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", ref], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"--baseline-ref {ref!r} is not a commit of {root}: {out.stderr.strip()}")
    return out.stdout.strip()


def overlay_of(ref: str, tmp: Path) -> Path:
    """A folder holding `kvgate` as the commit `ref` lays it out (package-dir mapping included)."""
    root = Path(__file__).resolve().parents[2]
    git_rev(ref)
    tree = tmp / "tree"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", ref], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    pkg = tmp / "overlay" / "kvgate"
    shutil.copytree(tree / "kvgate", pkg)
    for name, folder in PACKAGE_DIRS.items():
        if (tree / folder).is_dir():
            shutil.copytree(tree / folder, pkg / name)
    return tmp / "overlay"


def run_child(cases: list[dict], overlay: Path | None) -> list[dict]:
    """The cases in a fresh process, each on a fresh engine; `overlay` first on sys.path makes it measure that
    commit's engine."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    code = ("import sys, json, runpy; "
            f"sys.path.insert(0, {str(overlay)!r}) if {overlay is not None} else None; "
            f"m = runpy.run_path({str(Path(__file__).resolve())!r}); "
            "print('W-HOST-RESULT ' + json.dumps([m['measure'](c) for c in json.loads(sys.argv[1])]))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True, env=env,
                         cwd=tempfile.gettempdir())
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("W-HOST-RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"W-HOST failed ({'baseline' if overlay else 'current'} engine):\n"
                         f"{out.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("W-HOST-RESULT "))


# ---- the measurement: imports kvgate.engine only, so either commit's engine can be measured -------------------

PARTS = ("schedule", "prepare", "sampler", "post")
DETOK_NAMES = {None: "", "inline": " detok", "thread": " detok-thread"}
_TOKENIZER: dict = {}


def tiny_source(tokenizer, seed: int):
    from transformers import LlamaConfig

    from kvgate.engine.loader import ModelSource
    return ModelSource(name="tiny-w-host", config=LlamaConfig(**TINY), tokenizer=tokenizer, path=None, seed=seed)


def measure(case: dict) -> dict:
    import torch

    from kvgate.engine.config import EngineConfig
    from kvgate.engine.llm_engine import LLMEngine
    from kvgate.engine.loader import resolve_model
    from kvgate.engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    tokenizer = _TOKENIZER.get("smollm2") or _TOKENIZER.setdefault("smollm2", resolve_model("smollm2-135m").tokenizer)
    overlap = {} if case.get("overlap") is None else {"overlap": case["overlap"]}
    if overlap and "overlap" not in EngineConfig.model_fields:  # an engine before it: its plain step is "off"
        if case["overlap"] == "on":
            return {"skipped": "this engine cannot launch a step ahead"}
        overlap = {}
    engine = LLMEngine(tiny_source(tokenizer, case["seed"]), max_num_seqs=case["batch"], device="cpu",
                       dtype="float32", seed=case["seed"], **overlap)
    detok = None
    if case.get("detok") == "thread":
        if "detokenize" not in inspect.signature(LLMEngine.add_request).parameters:
            return {"skipped": "this engine cannot leave the text to a DetokenizerThread"}
        from kvgate.engine.detokenizer_thread import DetokenizerThread
        detok = DetokenizerThread(tokenizer)
    rng = random.Random(case["seed"])
    for i in range(case["num_requests"]):
        prompt = [rng.randrange(TINY["vocab_size"]) for _ in range(rng.randint(*case["prompt"]))]
        params = SamplingParams(temperature=case["temperature"], max_tokens=rng.randint(*case["output"]),
                                ignore_eos=True, seed=None)
        if detok is None:
            engine.add_request(str(i), prompt, params, stream_text=case["stream"])
        else:
            engine.add_request(str(i), prompt, params, detokenize=False)
            detok.add(str(i), None, incremental=True)
    clock, current, last, active = time.thread_time, {}, [None], set()
    runner = engine.runner

    def timed(name, fn):
        def wrapper(*a, **kw):
            if name in active:  # called inside itself (schedule calls schedule_decode): counted once
                return fn(*a, **kw)
            active.add(name)
            start = clock()
            try:
                return fn(*a, **kw)
            finally:
                active.discard(name)
                current[name] = current.get(name, 0.0) + clock() - start
        return wrapper

    def scheduling(fn):  # the step's batch, which ever of the scheduler's two entries made it
        return lambda: last.__setitem__(0, fn()) or last[0]

    for entry in ("schedule", "schedule_decode")[:1 + (getattr(engine, "overlap", None) is not None)]:
        setattr(engine.scheduler, entry, timed("schedule", scheduling(getattr(engine.scheduler, entry))))
    runner.prepare = timed("prepare", runner.prepare)
    device = StubDevice(case["device_ms"] / 1e3, case["batch"]) if case.get("device_ms") else None
    if case["stub"]:
        hidden = torch.randn(16384, TINY["hidden_size"])

        def stub(ids, positions, meta, decode=False):
            if device is not None:
                device.launch(ids.shape[0], decode)
            return hidden[: ids.shape[0]]
        runner.forward = timed("forward", stub)
    else:
        runner.forward = timed("forward", runner.forward)
    runner.model.logits = timed("logits", runner.model.logits)  # the runner's and compute_logits' GEMM alike
    if device is not None:
        device.hold(engine)
    if getattr(engine, "overlap", None) is not None:  # launch samples through `sample`, not the sampler's call
        runner.sampler.sample = timed("sampler", runner.sampler.sample)
    else:
        runner.sampler = timed("sampler", runner.sampler)
    steps = []
    gc.collect()  # the previous case's engine is garbage: its collection is not this case's host work
    detok_clock = (lambda: time.clock_gettime(time.pthread_getcpuclockid(detok.thread.ident))) if detok else None
    detok_start = detok_clock() if detok else 0.0
    while engine.has_unfinished():
        current.clear()
        start, wall = clock(), time.perf_counter()
        outputs = engine.step()
        if detok is not None:  # what the worker's engine thread does: hand the step over, take the last one's text
            detok.submit(outputs, 0.0)
            detok.results(lag=1 if engine.has_unfinished() else 0)
        total, wall = clock() - start, time.perf_counter() - wall
        batch = last[0]
        full = batch is not None and len(batch) == case["batch"] and all(n == 1 for _, n in batch)
        model = current.get("forward", 0.0) + current.get("logits", 0.0)
        parts = {p: current.get(p, 0.0) for p in PARTS[:-1]}
        parts["post"] = total - model - sum(parts.values())
        steps.append((full, total - model, model, parts, wall))
    detok_s = detok_clock() - detok_start if detok else None
    if detok is not None:
        detok.close()
    full = [s for s in steps if s[0]]
    mean = lambda xs: 1e3 * statistics.fmean(xs) if xs else None  # noqa: E731
    import kvgate.engine
    return {"engine": str(Path(kvgate.engine.__file__).parent), "steps": len(steps), "full_decode_steps": len(full),
            "host_s_all_steps": sum(s[1] for s in steps), "host_ms_per_step_all": mean([s[1] for s in steps]),
            "model_s_all_steps": sum(s[2] for s in steps),
            "full_decode_ms": {**{p: mean([s[3][p] for s in full]) for p in PARTS},
                               "host": mean([s[1] for s in full]), "model": mean([s[2] for s in full]),
                               "wall": mean([s[4] for s in full])},
            # the detokenizer thread's own CPU time over the whole run, per step: where the decoding went
            "detok_thread_ms_per_step": 1e3 * detok_s / len(steps) if detok_s is not None else None,
            # the overlap rows: the device's idle time before each full-batch decode step, the host time not hidden
            **({"device_ms": case["device_ms"], "exposed_host_ms": mean(device.gaps), "device_gaps": len(device.gaps),
                "exposed_host_ms_ahead": mean(device.gaps_ahead), "device_gaps_ahead": len(device.gaps_ahead),
                "overlapped_steps": getattr(getattr(engine, "overlap", None), "launched", 0)} if device else {})}


class StubDevice:
    """A GPU-like device under the forward stub: a step's forward takes `seconds` of device time from its launch or
    the end of the step before, whichever is later, and the host waits only for a step's tokens (a plain step's at
    the end of `run`, a launched step's when they are read). Time is the engine thread's CPU time plus its waits
    for the device (a wait moves that clock to the step's end, without sleeping), so, as for the rest of W-HOST,
    other load on the machine does not count. The device's idle time before each full-batch decode step, `gaps`,
    is the host time that step did not hide; `gaps_ahead` are those of the steps launched while the one before was
    still outstanding (an overlapped step after another: the steady state), apart from those after a sync point."""

    def __init__(self, seconds: float, batch: int) -> None:
        self.seconds, self.batch, self.ready, self.waited = seconds, batch, None, 0.0
        self.gaps, self.gaps_ahead, self.drained = [], [], True  # drained: the host waited for the last step

    def now(self) -> float:
        return time.thread_time() + self.waited

    def launch(self, rows: int, decode: bool) -> None:
        now = self.now()
        if self.ready is not None and decode and rows == self.batch:
            self.gaps.append(max(0.0, now - self.ready))
            if not self.drained:
                self.gaps_ahead.append(self.gaps[-1])
        self.ready, self.drained = max(now, self.ready or now) + self.seconds, False

    def wait(self, ready: float) -> None:
        self.waited += max(0.0, ready - self.now())
        self.drained |= ready == self.ready

    def hold(self, engine) -> None:
        """Make `engine`'s runner wait for the device where the host takes a step's tokens."""
        runner = engine.runner
        run = runner.run
        runner.run = lambda batch: (run(batch), self.wait(self.ready))[0]
        if getattr(engine, "overlap", None) is None:
            return
        launch = runner.launch

        def launched(batch):
            step, ready = launch(batch), self.ready
            tokens = step.tokens
            step.tokens = lambda: (self.wait(ready), tokens())[1]
            return step
        runner.launch = launched


def median_round(results: list[dict]) -> dict:
    """The round whose host time per full decode step is the median (the lower one of an even count), with every
    round's time beside it."""
    timed = [r for r in results if "skipped" not in r and r["full_decode_ms"]["host"] is not None]
    if not timed:
        return results[0]
    times = [r["full_decode_ms"]["host"] for r in timed]
    median = sorted(timed, key=lambda r: r["full_decode_ms"]["host"])[(len(timed) - 1) // 2]
    return {**median, "rounds_host_ms": times}


def temperature_ratios(cases: list[dict], rounds: dict[str, list[list[dict]]]) -> dict:
    """Per engine, each temperature case's host time over its greedy twin's (same batch, same detokenization),
    round by round: the two ran minutes apart in the same process, so the ratio is the round's own."""
    greedy = {(c["batch"], c["detok"], c["stub"]): i for i, c in enumerate(cases) if not c["temperature"]}
    out: dict = {}
    for label, rs in rounds.items():
        for i, case in enumerate(cases):
            twin = greedy.get((case["batch"], case["detok"], case["stub"]))
            if not case["temperature"] or twin is None:
                continue
            per = [ratio(r[i], r[twin]) for r in rs]  # temperature over greedy
            per = [x for x in per if x]
            if per:
                out.setdefault(label, {})[case["name"]] = {"rounds": per, "median": statistics.median(per)}
    return out


def ratio(baseline: dict, current: dict) -> float | None:
    if "skipped" in baseline or "skipped" in current:
        return None
    b, c = baseline["full_decode_ms"]["host"], current["full_decode_ms"]["host"]
    return round(b / c, 2) if b and c else None


def print_case(entry: dict) -> None:
    def fmt(r: dict) -> str:
        if "skipped" in r:
            return f"skipped: {r['skipped']}"
        ms = r["full_decode_ms"]
        if ms["host"] is None:
            return f"no full-batch decode step of {r['steps']}; host {r['host_s_all_steps']:.2f} s in all"
        parts = " ".join(f"{p} {ms[p]:.3f}" for p in PARTS)
        detok = r.get("detok_thread_ms_per_step")
        return (f"{parts} | host {ms['host']:.3f} ms/step (wall {ms['wall']:.3f}) over {r['full_decode_steps']} "
                f"full decode steps; all {r['steps']} steps {r['host_s_all_steps']:.2f} s "
                f"({r['host_ms_per_step_all']:.3f} ms/step)"
                + (f"; detokenizer thread {detok:.3f} ms CPU/step" if detok is not None else "")
                + (f"; device idle before a full decode step (exposed host time) {r['exposed_host_ms']:.3f} ms of "
                   f"{r['device_ms']:g} ms steps, {r['overlapped_steps']} steps launched ahead"
                   + (f", {r['exposed_host_ms_ahead']:.3f} ms over the {r['device_gaps_ahead']} launched behind "
                      "an outstanding one" if r.get("device_gaps_ahead") else "")
                   if r.get("device_ms") else ""))
    print(entry["case"]["name"])
    for label in ("baseline", "current"):
        if label in entry:
            print(f"  {label:<8} {fmt(entry[label])}")
    if entry.get("ratio_host_ms"):
        print(f"  baseline/current host per full decode step: {entry['ratio_host_ms']}x")


if __name__ == "__main__":  # until `kvgate bench host` is in the command table: python -m kvgate.bench.host
    _parser = argparse.ArgumentParser(prog="kvgate bench host", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
