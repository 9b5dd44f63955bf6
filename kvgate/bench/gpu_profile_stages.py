"""The in-process stages of `make gpu-profile` (gpu_profile.py runs each in its own process under its own limit): what
one short GPU run must say to decide issue 41's next step. Each writes its JSON the moment it has a result.

On a CPU (KVGATE_DEVICE=cpu, `make gpu-profile-rehearsal`) every stage runs at toy sizes: 2-layer models, the Triton
kernels in the interpreter, CPU timers, and every figure that only a GPU has (GPU time, kernels, idle share, copy
bandwidth, SDPA's flash and cuDNN backends) given as null with the reason, so the plumbing is tested, never a figure."""
from __future__ import annotations

import json
import statistics
import subprocess
import time
from dataclasses import replace
from pathlib import Path

from kvgate.bench.gpu_checks import RANDOM_MODELS, Scale, free_device, held_source, preflight, write

PROFILE_STEPS = {"cuda": 20, "cpu": 3}  # decode steps under torch.profiler
TOP_KERNELS = 15
SPLITS = (1, 2, 4, 8, 16, 32)
SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def cuda(sc: Scale) -> bool:
    return sc.device.startswith("cuda")


def dtype_of(sc: Scale):
    import torch

    return torch.bfloat16 if cuda(sc) else torch.float32


def merge(out: Path, section: str, data: dict) -> dict:
    """One section of profile.json (the stages after the W-GPU run share it: fewer files back)."""
    whole = json.loads(out.read_text()) if out.exists() else {}
    whole[section] = data
    write(out, whole)
    return data


def stage_preflight(out: Path, sc: Scale) -> dict:
    """The check's preflight (versions, the GPU, entry points, one kernel) plus clocks and whether CUPTI records."""
    info = preflight(out, sc)
    info["clocks"] = nvidia_smi() if cuda(sc) else "not on a CPU"
    info["cupti"] = cupti_records(sc)
    write(out, info)
    return info


def nvidia_smi() -> dict | str:
    fields = "name,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,power.limit,temperature.gpu,pstate"
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=10).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi gave nothing ({type(e).__name__}: {e})"
    return dict(zip(fields.split(","), (v.strip() for v in line.split(","))))


def cupti_records(sc: Scale) -> dict:
    """Whether torch.profiler sees device kernels here (CUPTI through kineto): the profile stage needs them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    found = {"kineto": torch.autograd.kineto_available()}
    if not cuda(sc):
        return {**found, "device_kernels": None, "reason": "a CPU has no CUPTI"}
    x = torch.randn(256, 256, device=sc.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        (x @ x).sum().item()
    return {**found, "device_kernels": len(device_events(prof))}


def device_events(prof) -> list:
    from torch.autograd import DeviceType

    return [e for e in prof.events() if e.device_type == DeviceType.CUDA]


def stage_w_gpu_warm(out: Path, sc: Scale) -> dict:
    """W-GPU on qwen2.5, kvgate continuous, one warm round (bench engine's warm-up first) with every step's host and
    GPU time: wall (host) per step, GPU span per step (CUDA events around the runner), input building per step."""
    import torch

    from kvgate.bench import engine as bench

    workload = replace(bench.WORKLOADS["gpu"], models=RANDOM_MODELS[:1], **{"rounds": 1, **sc.w_gpu})
    device = torch.device(sc.device)
    clock = StepClock(device)
    with bench.after_warm_up(clock.install):
        entry = bench.run_model(held_source(RANDOM_MODELS[0], sc), workload, ["kvgate_continuous"], device, seed=0)
    r = entry["contestants"]["kvgate_continuous"]
    result = {"device": sc.device, "settings": bench.settings_of(workload, device), "output_tok_s": r["output_tok_s"],
              "triton_compiles": r.get("triton_compiles"), "allocator_growth_bytes": r.get("allocator_growth_bytes"),
              "bound_tok_s": entry.get("bound_tok_s"), "fraction_of_bound": entry.get("fraction_of_bound"),
              "binds": entry.get("binds"), "steps": clock.summary(), "ok": r["requests_with_wrong_length"] == 0}
    write(out, result)
    return result


class StepClock:
    """Each timed step's host wall time, GPU span (CUDA events) and input-building time, by kind."""

    def __init__(self, device) -> None:
        self.device, self.rows = device, []

    def install(self, llm, m) -> None:
        import torch

        runner = llm.engine.runner
        run, prepare = runner.run, getattr(runner, "prepare", None)
        building = [0.0]

        def timed_prepare(batch, *args, **kwargs):
            start = time.perf_counter()
            try:
                return prepare(batch, *args, **kwargs)
            finally:
                building[0] += time.perf_counter() - start

        def timed_run(batch):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.device.type == "cuda" else None
            building[0], start = 0.0, time.perf_counter()
            if events:
                events[0].record()
            out = run(batch)
            if events:
                events[1].record()
                events[1].synchronize()
            tokens = sum(n for _, n in batch)
            self.rows.append({"kind": "decode" if tokens == len(batch) else "mixed", "seqs": len(batch),
                              "wall_ms": 1e3 * (time.perf_counter() - start), "prepare_ms": 1e3 * building[0],
                              "gpu_ms": events[0].elapsed_time(events[1]) if events else None})
            return out
        if prepare is not None:
            runner.prepare = timed_prepare
        runner.run = timed_run

    def summary(self) -> dict:
        found = {}
        for kind in ("decode", "mixed"):
            rows = [r for r in self.rows if r["kind"] == kind]
            if not rows:
                continue
            entry = {"steps": len(rows), "mean_seqs": statistics.fmean(r["seqs"] for r in rows)}
            for key in ("wall_ms", "prepare_ms", "gpu_ms"):
                values = [r[key] for r in rows if r[key] is not None]
                entry[key] = {"total": sum(values), "mean": statistics.fmean(values),
                              "p50": statistics.median(values)} if values else None
            entry["gpu_share_of_wall"] = (entry["gpu_ms"]["total"] / entry["wall_ms"]["total"]
                                          if entry["gpu_ms"] else "no GPU time on a CPU")
            found[kind] = entry
        return found


def w_gpu_engine(sc: Scale):
    """qwen2.5 as W-GPU runs it (its batch cap, its max_model_len, so its graphs' block tables), decode graphs
    captured (on a CPU: their twin); the workload beside it."""
    from kvgate.bench import engine as bench
    from kvgate.engine import LLMEngine

    workload = replace(bench.WORKLOADS["gpu"], **sc.w_gpu)
    source = held_source(RANDOM_MODELS[0], sc)
    free_device()
    engine = LLMEngine(source, device=sc.device, dtype="bfloat16" if cuda(sc) else "float32",
                       max_num_seqs=workload.max_num_seqs, max_model_len=workload.prompt_len[1] + outputs(workload),
                       kv_cache_memory=sc.kv_cache_memory, enforce_eager=not cuda(sc))
    if engine.runner.graphs is None:
        engine.runner.capture_graphs()
    return engine, source, workload


def outputs(workload) -> int:
    """Tokens each profiled request may generate: W-GPU's longest, and always enough for the profiled steps."""
    return max(workload.output_len[1], 2 * max(PROFILE_STEPS.values()) + 8)


def full_batch_engine(sc: Scale):
    """W-GPU's engine with a full decode batch prefilled (W-GPU's prompt lengths) and a few warm decode steps."""
    from kvgate.bench import engine as bench
    from kvgate.engine import SamplingParams

    engine, source, workload = w_gpu_engine(sc)
    n = workload.max_num_seqs
    params = SamplingParams(temperature=0, max_tokens=outputs(workload), ignore_eos=True)
    for i, r in enumerate(bench.make_requests(replace(workload, num_requests=n), source.config.vocab_size, 0)):
        engine.add_request(str(i), r.prompt_ids, params)
    while sum(s.num_output_tokens > 0 for s in engine.scheduler.running) < n:
        engine.step()
    for _ in range(3):  # warm decode steps: compiles and allocator outside the profile
        engine.step()
    return engine, source


def stage_torch_profile(out: Path, sc: Scale) -> dict:
    """PROFILE_STEPS decode steps at the full batch under torch.profiler: top kernels by device time, kernels per
    step (and per layer), and the share of the profiled span in which the GPU ran no kernel."""
    from torch.profiler import ProfilerActivity, profile

    engine, source = full_batch_engine(sc)
    steps, layers = PROFILE_STEPS["cuda" if cuda(sc) else "cpu"], source.config.num_hidden_layers
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda(sc) else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
    batch = len(engine.scheduler.running)  # every request still running: each profiled step decoded all of them
    result = {"device": sc.device, "decode_steps": steps, "batch": batch, "layers": layers,
              "ok": batch == engine.config.max_num_seqs}
    kernels = device_events(prof) if cuda(sc) else []
    if kernels:
        spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
        top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
        result.update({"top_kernels": [{"name": k[:120], "total_us": sum(v), "calls": len(v)} for k, v in top],
                       "kernels_per_step": len(kernels) / steps, "kernels_per_step_per_layer": len(kernels) / steps
                       / layers, "gpu_idle_share": 1 - busy_us(spans) / (spans[-1][1] - spans[0][0])})
    else:
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:TOP_KERNELS]
        result.update({"top_kernels": None, "kernels_per_step": None, "gpu_idle_share": None,
                       "reason": "no device kernels recorded (a CPU, or CUPTI absent): top host ops instead",
                       "top_host_ops": [{"name": e.key[:120], "self_cpu_us": e.self_cpu_time_total,
                                         "calls": e.count} for e in ops]})
    del engine
    free_device()
    return merge(out, "torch_profile", result)


def busy_us(spans: list[tuple[float, float]]) -> float:
    """Time covered by the union of sorted intervals."""
    total, end = 0.0, float("-inf")
    for s, e in spans:
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def stage_graph_floor(out: Path, sc: Scale) -> dict:
    """Each captured decode bucket replayed on its padding rows (context 0: no KV read): the floor of a decode step
    of that size (weights, GEMMs, launches), in ms, and the weight bandwidth it implies."""
    import torch

    from kvgate.bench.bound import ModelCost

    engine, source, _ = w_gpu_engine(sc)
    graphs, weight_bytes = engine.runner.graphs, ModelCost.of(source.config, dtype_of(sc)).weight_bytes
    floor = {}
    with torch.inference_mode():
        for size in graphs.sizes:
            ms = median_ms(graphs.replays[size], sc, repeats=20 if cuda(sc) else 3)
            floor[size] = {"ms": ms, "weight_gb_s": weight_bytes / ms / 1e6}
    del engine
    free_device()
    return merge(out, "graph_floor", {"device": sc.device, "weight_bytes": weight_bytes, "by_bucket": floor})


def median_ms(fn, sc: Scale, repeats: int) -> float:
    import torch

    fn()
    times = []
    for _ in range(repeats):
        if cuda(sc):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def layouts(sc: Scale) -> dict:
    from kvgate.bench.kernels import MODELS, TINY

    return {name: dims[:3] for name, dims in MODELS.items()} if cuda(sc) else {"tiny": TINY[:3]}


def stage_split_sweep(out: Path, sc: Scale) -> dict:
    """Decode attention at B=256, context U[100, 2048] (toy on a CPU) for each head layout, with each forced split
    count and the kernel's own choice: ms and GB/s of KV read, beside a same-run device copy."""
    import random

    import torch

    from kvgate.bench.kernels import attention_inputs, copy_bandwidth, timer
    from kvgate.kernels.decode_attention import MAX_SPLITS, decode_attention, decode_splits

    on_gpu, dtype = cuda(sc), dtype_of(sc)
    measure, rng = timer(on_gpu), random.Random(0)
    batch, span, page = (256, (100, 2048), 16) if on_gpu else (4, (10, 40), 8)
    copy = copy_bandwidth(torch, sc.device, not on_gpu, measure) if on_gpu else None
    result = {"device": sc.device, "batch": batch, "context": list(span), "copy_gb_s": copy, "layouts": {}}
    for name, heads in layouts(sc).items():
        context = [rng.randint(*span) for _ in range(batch)]
        args = attention_inputs(torch, [1] * batch, context, heads, page, dtype, sc.device)
        kv_bytes = sum(context) * 2 * heads[1] * heads[2] * torch.tensor([], dtype=dtype).element_size()
        auto = decode_splits(args[0], args[1], args[3])
        rows = {}
        for splits in [s for s in SPLITS if s <= MAX_SPLITS] + ["auto"]:
            forced = None if splits == "auto" else splits
            ms = measure(lambda: decode_attention(*args, num_splits=forced))
            rows[str(splits)] = {"ms": ms, "gb_s": kv_bytes / ms / 1e6,
                                 "share_of_copy": kv_bytes / ms / 1e6 / copy if copy else None}
        result["layouts"][name] = {"heads": list(heads), "auto": f"{auto.num_splits}x{auto.chunk}", "splits": rows}
        merge(out, "split_sweep", result)
    return merge(out, "split_sweep", result)


def stage_prefill_sdpa(out: Path, sc: Scale) -> dict:
    """kvgate's paged prefill attention against torch SDPA on equal shapes (fresh prompts, causal, GQA): each SDPA
    backend that runs here (flash, cuDNN, efficient, math), TFLOP/s of the causal attention FLOPs, as an anchor
    inside the image."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    from kvgate.bench.kernels import attention_inputs, timer
    from kvgate.kernels.prefill_attention import prefill_attention

    on_gpu, dtype = cuda(sc), dtype_of(sc)
    measure = timer(on_gpu)
    seqs, length = (4, 1024) if on_gpu else (2, 16)
    result = {"device": sc.device, "sequences": seqs, "length": length, "layouts": {}}
    for name, (heads, kv_heads, head_dim) in layouts(sc).items():
        args = attention_inputs(torch, [length] * seqs, [length] * seqs, (heads, kv_heads, head_dim), 16, dtype,
                                sc.device)
        flops = 4 * heads * head_dim * seqs * length * (length + 1) / 2  # QK^T and PV over the causal triangle
        row = {"kvgate_prefill": tflops(flops, measure(lambda: prefill_attention(*args)))}
        q = torch.randn(seqs, heads, length, head_dim, device=sc.device, dtype=dtype)
        k = torch.randn(seqs, kv_heads, length, head_dim, device=sc.device, dtype=dtype)
        v = torch.randn_like(k)
        for backend in SDPA_BACKENDS if on_gpu else ("MATH",):
            try:
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    ms = measure(lambda: scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
                row[f"sdpa_{backend.lower()}"] = tflops(flops, ms)
            except (RuntimeError, AttributeError) as e:
                row[f"sdpa_{backend.lower()}"] = {"ms": None, "reason": f"{type(e).__name__}: {str(e)[:200]}"}
        result["layouts"][name] = row
        merge(out, "prefill_vs_sdpa", result)
    return merge(out, "prefill_vs_sdpa", result)


def tflops(flops: float, ms: float) -> dict:
    return {"ms": ms, "tflop_s": flops / ms / 1e9}


STAGES = {"preflight": stage_preflight, "w-gpu-warm": stage_w_gpu_warm, "torch-profile": stage_torch_profile,
          "graph-floor": stage_graph_floor, "split-sweep": stage_split_sweep, "prefill-sdpa": stage_prefill_sdpa}
