"""The in-process checks that the offline GPU check's runner (gpu_check_runner.py) runs, each as one step in its own
process: preflight, graphs, parity and the W-GPU figures. Each writes its JSON the moment it has a result (a step
killed at its limit keeps what it finished), frees its engines before the next one sizes its KV cache, and gives that
cache an explicit size.

`Scale` says how big each check is: full size on a GPU, 2-layer models and a few short requests for the CPU
rehearsal (KVGATE_DEVICE=cpu), which runs the same code paths (CUDA graphs as their CPU twin)."""
from __future__ import annotations

import gc
import importlib
import importlib.metadata
import json
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvgate.engine.loader import ModelSource

RANDOM_MODELS = ("random:qwen2.5-0.5b", "random:qwen3-0.6b", "random:llama-3.2-1b")
# bf16 replay pads the batch to its bucket, which changes GEMM tiling and the decode split count: the same inputs
# give logits a few bf16 ulps apart, so ids may part at a near-tie. Compared on the same inputs step by step, a real
# fault (a padding row leaking, a stale block table, a wrong bucket) moves logprobs by far more than this.
BF16_LOGPROB_TOLERANCE = 0.1
PARITY_TOLERANCE = 2e-3  # float32 logprobs against HF's forward over the same tokens
# What the preflight imports: every entry point a step runs, and what the GPU test files import
ENTRY_POINTS = ("kvgate.engine.model_runner", "kvgate.engine.cuda_graphs", "kvgate.kernels.ops",
                "kvgate.kernels.decode_attention", "kvgate.kernels.prefill_attention", "kvgate.bench.engine",
                "kvgate.bench.bound", "kvgate.bench.hf", "kvgate.bench.kernels", "kvgate.bench.report",
                "kvgate.bench.compiles", "kvgate.bench.gpu_profile_stages", "tests.support",
                "tests.engine.helpers", "tests.kernels.kernel_testing")
VERSIONS = ("torch", "triton", "transformers", "tokenizers", "numpy", "numba", "safetensors", "huggingface-hub",
            "accelerate", "pydantic", "pydantic-core", "typing-extensions", "redis", "msgspec", "pytest",
            "pytest-xdist", "pytest-timeout")


@dataclass(slots=True, frozen=True)
class Scale:
    device: str
    layers: int | None  # None: the model's own
    vocab: int | None  # None: the model's own
    graph_requests: int
    graph_prompt: tuple[int, int]
    graph_lengths: tuple[int, int]  # request i asks for first + step * i tokens: the batch shrinks bucket by bucket
    parity_prompts: int
    parity_prompt: tuple[int, int]
    parity_tokens: int
    kv_cache_memory: str
    w_gpu: dict = field(default_factory=dict)  # Workload fields replaced (the rehearsal's tiny run)


def scale(device: str | None = None) -> Scale:
    device = device or os.environ.get("KVGATE_DEVICE", "cuda")
    if device.startswith("cuda"):
        # HF on 32 of the 256 requests: its step (50 s) runs static and generate_batch, each about 1,000 launch-bound
        # steps of ~20 ms for the longest of 32 outputs in U[100, 1024]; 64 (`kvgate bench engine`'s) would not fit.
        return Scale(device, None, None, 48, (20, 200), (8, 3), 4, (16, 120), 16, "8GiB", dict(hf_num_requests=32))
    return Scale(device, 2, 4096, 5, (4, 12), (3, 2), 2, (8, 24), 4, "64MiB",
                 dict(num_requests=3, prompt_len=(8, 16), output_len=(3, 6), max_num_seqs=4, dtype="float32"))


@dataclass(slots=True)
class HeldWeights(ModelSource):
    """A random: source whose tensors are generated once per dtype and read by every consumer (the engine, then
    HF's reference): the same seeded values, built once instead of once per reader."""
    held: dict = field(default_factory=dict)

    def weights(self, dtype):
        if dtype not in self.held:
            self.held.clear()  # one dtype in host memory at a time
            self.held[dtype] = dict(ModelSource.weights(self, dtype))
        return iter(self.held[dtype].items())


def held_source(name: str, sc: Scale) -> HeldWeights:
    from kvgate.engine.loader import resolve_model

    src = resolve_model(name)
    config = src.config
    if sc.layers is not None:  # the rehearsal's twin of the same config: fewer layers, a smaller vocabulary
        config.num_hidden_layers = sc.layers
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:sc.layers]
    if sc.vocab is not None:
        config.vocab_size = sc.vocab
        for special in ("bos_token_id", "eos_token_id", "pad_token_id"):  # HF pads with them: keep them in range
            if isinstance(getattr(config, special, None), int) and getattr(config, special) >= sc.vocab:
                setattr(config, special, sc.vocab - 1)
    return HeldWeights(src.name, src.config, src.tokenizer, src.path, src.seed)


def free_device() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def write(path: Path, data: dict) -> None:
    """Atomically, so a kill between two writes leaves the last whole document."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
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
    return [ids[r] for r in order], [lps.get(r, []) for r in order]


def engine_for(source, sc: Scale, dtype: str, max_num_seqs: int, eager: bool):
    """An engine with an explicit KV size (never a share of what the previous engine left), its decode graphs
    captured unless eager (on a CPU: their twin, the same plan run eagerly)."""
    from kvgate.engine import LLMEngine

    free_device()
    engine = LLMEngine(source, device=sc.device, dtype=dtype, max_num_seqs=max_num_seqs,
                       kv_cache_memory=sc.kv_cache_memory, enforce_eager=eager or not sc.device.startswith("cuda"))
    if not eager and engine.runner.graphs is None:
        engine.runner.capture_graphs()
    return engine


class ReplayProbe:
    """Wraps a graphed engine's decode replay: after each replayed step the same inputs run eagerly, and the two
    log-softmaxes are compared at the replay's greedy token (teacher forcing: both see the same context)."""

    def __init__(self, runner) -> None:
        self.runner, self.replay = runner, runner.graphs.run
        self.steps = self.rows = self.same_argmax = 0
        self.max_diff = 0.0
        runner.graphs.run = self

    def __call__(self, batch):
        import torch

        out = self.replay(batch)
        model = self.runner.model
        with torch.inference_mode():
            graphed = out.logits.float().log_softmax(-1)  # the graph's own logits, and its own argmax below
            # the ids the graph fed the model (a token still on the device taken in) and its static inputs
            eager = model.compute_logits(model(out.input_ids, batch.positions, batch.meta)).log_softmax(-1)
        token = out.tokens[:, None]
        self.max_diff = max(self.max_diff, (graphed.gather(-1, token) - eager.gather(-1, token)).abs().max().item())
        self.same_argmax += int((eager.argmax(-1, keepdim=True) == token).sum().item())
        self.steps, self.rows = self.steps + 1, self.rows + token.shape[0]
        return out


def check_graphs(out: Path, sc: Scale) -> dict:
    """float32: graph replay gives eager's ids for every request; bfloat16: replay against eager on the same
    inputs at every decode step (logprobs within BF16_LOGPROB_TOLERANCE)."""
    source = held_source(RANDOM_MODELS[0], sc)
    n = sc.graph_requests
    prompts = random_prompts(n, *sc.graph_prompt, source.config.vocab_size)
    first, step = sc.graph_lengths
    lengths = [first + step * i for i in range(n)]  # the batch shrinks through every bucket
    result: dict = {"model": source.name, "layers": source.config.num_hidden_layers,
                    "vocab": source.config.vocab_size, "requests": n,
                    "device": sc.device}
    engine = engine_for(source, sc, "bfloat16", n, eager=False)
    probe = ReplayProbe(engine.runner)
    greedy_ids(engine, prompts, lengths)
    result["bfloat16"] = {"replayed_steps": probe.steps, "rows": probe.rows, "same_argmax_rows": probe.same_argmax,
                          "max_abs_logprob_diff": probe.max_diff, "tolerance": BF16_LOGPROB_TOLERANCE,
                          "ok": probe.steps > 0 and probe.max_diff <= BF16_LOGPROB_TOLERANCE}
    del engine, probe
    write(out, result)
    eager_ids, _ = greedy_ids(engine_for(source, sc, "float32", n, eager=True), prompts, lengths)
    engine = engine_for(source, sc, "float32", n, eager=False)
    graphed_ids, _ = greedy_ids(engine, prompts, lengths)
    result["float32"] = {"identical_requests": sum(a == b for a, b in zip(eager_ids, graphed_ids)),
                         "replayed_steps_by_bucket": engine.runner.graphs.replayed}
    result["float32"]["ok"] = result["float32"]["identical_requests"] == n
    del engine
    result["ok"] = result["bfloat16"]["ok"] and result["float32"]["ok"]
    write(out, result)
    return result


def hf_on_device(source, dtype, device: str):
    """HF's reference holding the engine's weights; its throw-away init runs on the device, not the host CPU."""
    import torch

    from kvgate.engine.loader import hf_reference_model

    try:
        with torch.device(device):
            return hf_reference_model(source, dtype)
    except Exception as e:  # noqa: BLE001 - a transformers that cannot build there: the slow way, said so
        print(f"HF's model could not be built on {device} ({type(e).__name__}: {e}); built on the CPU instead",
              flush=True)
        return hf_reference_model(source, dtype).to(device)


def check_parity(out: Path, sc: Scale) -> dict:
    """kvgate's greedy tokens and top-5 logprobs against HF's forward over the same tokens (float32)."""
    import torch

    result: dict = {"device": sc.device, "tolerance": PARITY_TOLERANCE}
    for name in RANDOM_MODELS:
        source = held_source(name, sc)
        prompts = random_prompts(sc.parity_prompts, *sc.parity_prompt, source.config.vocab_size)
        engine = engine_for(source, sc, "float32", sc.parity_prompts, eager=False)
        ids, lps = greedy_ids(engine, prompts, [sc.parity_tokens] * len(prompts), logprobs=5)
        del engine
        free_device()
        hf = hf_on_device(source, torch.float32, sc.device)
        worst = 0.0
        with torch.no_grad():
            for prompt, new, lp in zip(prompts, ids, lps):
                full = torch.tensor([prompt + new], device=sc.device)
                logp = hf(full).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
                for pos, row in enumerate(lp):
                    for token, value in row.items():
                        worst = max(worst, abs(value - logp[pos, token].item()))
        del hf, source
        result[name] = {"max_abs_logprob_diff": worst, "positions": sum(len(x) for x in lps),
                        "ok": worst < PARITY_TOLERANCE}
        write(out, result)
    result["ok"] = all(result[m]["ok"] for m in RANDOM_MODELS)
    write(out, result)
    return result


CHECK_ROUNDS = 1


def check_w_gpu(out: Path, sc: Scale, models: list[str], contestants: list[str]) -> dict:
    """`kvgate bench engine --workload gpu` for these models and contestants (CHECK_ROUNDS rounds, each figure the
    median round, with the bound of kvgate's run), the JSON rewritten after each model."""
    import torch

    from kvgate.bench import engine as bench
    from kvgate.bench.report import machine_info, versions

    # One round: the check's step limits (60 s / 50 s of its 480 s) were sized for one, and a model killed at its
    # limit loses its whole entry. Three warm rounds, their median the figure, are `kvgate bench engine --workload
    # gpu`'s (issue 41); the check says whether the run works and what one round gives.
    workload = replace(bench.WORKLOADS["gpu"], models=tuple(models), **{"rounds": CHECK_ROUNDS, **sc.w_gpu})
    device = torch.device(sc.device)
    report = {"workload": workload.name, "machine": machine_info(device), "versions": versions(),
              "settings": {**bench.settings_of(workload, device), "contestants": contestants,
                           "repeats": workload.rounds, "layers": sc.layers or "the model's own",
                           "vocab": sc.vocab or "the model's own"},
              "notes": bench.notes_of(device, workload), "models": {}}
    for name in models:
        source = held_source(name, sc)
        report["models"][name] = bench.run_model(source, workload, contestants, device, seed=0)
        del source
        free_device()
        write(out, report)
    report["ok"] = all(all(r["requests_with_wrong_length"] == 0 for r in e["contestants"].values())
                       for e in report["models"].values())
    write(out, report)
    return report


def preflight(out: Path, sc: Scale) -> dict:
    """In seconds, before any long step: versions, the device, every entry point imports, one kernel against its
    twin on the GPU. `ok` false with `reason` stops the run."""
    started = time.monotonic()
    info: dict = {"python": platform.python_version(), "executable": sys.executable, "device": sc.device,
                  "versions": {}, "import_errors": {}}
    for package in VERSIONS:
        try:
            info["versions"][package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info["versions"][package] = None
    write(out, info)
    for module in ENTRY_POINTS:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - every failure is the finding
            info["import_errors"][module] = f"{type(e).__name__}: {e}"
    import torch

    reasons = [f"{m} does not import ({e})" for m, e in info["import_errors"].items()]
    if sc.device.startswith("cuda"):
        if not torch.cuda.is_available():
            reasons.append(f"torch {torch.__version__} sees no GPU (torch.version.cuda={torch.version.cuda}); "
                           "run on a CUDA machine, or KVGATE_DEVICE=cpu for the rehearsal")
        else:
            p = torch.cuda.get_device_properties(0)
            free, total = torch.cuda.mem_get_info()
            info["gpu"] = {"name": p.name, "sm": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                           "total_gib": round(total / 2**30, 1), "free_gib": round(free / 2**30, 1),
                           "torch_cuda": torch.version.cuda}
            if free < 20 * 2**30:
                reasons.append(f"only {free / 2**30:.1f} GiB of GPU memory free; the checks need about 20 GiB")
            if not reasons:
                from kvgate.kernels import activation, reference

                x = torch.randn(4, 2 * 4864, device="cuda", dtype=torch.bfloat16)
                info["smoke_silu_max_diff"] = (activation.silu_and_mul(x).float()
                                               - reference.silu_and_mul(x).float()).abs().max().item()
    info["ok"], info["reason"] = not reasons, "; ".join(reasons) or None
    info["seconds"] = round(time.monotonic() - started, 1)
    write(out, info)
    return info


CHECKS = {"preflight": preflight, "graphs": check_graphs, "parity": check_parity}
