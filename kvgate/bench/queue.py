"""`kvgate bench queue`: W-QUEUE. W-CPU's requests through Redis with one worker, against the same engine
driven in process, in the same run; plus the per-job overhead the queue adds when the worker is idle.

Order: in-process, queue, in-process again; the queue's throughput is divided by the mean of the two
in-process runs so that drift on a shared machine (other load, thermal) cancels out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

from kvgate.commands.flags import setting_parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--probes", type=int, default=50, help="sequential one-token jobs to time the overhead")
    parser.add_argument("--simulated", action="store_true", help="SimulatedEngine instead of SmolLM2 (fast)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-num-seqs", type=setting_parser("max_num_seqs"), default=32,
                        help="the engine's batch cap (default 32, the published W-QUEUE runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--tracing", action="store_true",
                        help="also a queue pass with OpenTelemetry tracing on at 100%% sampling (the SDK's enqueue "
                             "spans and the worker's, sent over OTLP/HTTP to a local receiver), beside the plain one")


def run(args: argparse.Namespace) -> int:
    from kvgate.bench.engine import WORKLOADS

    workload = WORKLOADS["cpu"]
    engine = build_engine(args, workload)
    requests = make_requests(workload, args.num_requests, vocab_size(engine), args.seed)
    report = {"workload": "W-QUEUE", "settings": settings_of(args, workload), **environment(args)}
    print_header(report)
    warm_up(engine, requests[0])
    first = run_in_process(engine, requests)
    print(f"in-process        {first['output_tok_s']:9.1f} output tok/s  ({first['elapsed_s']:.1f}s)")
    with redis_for(args) as url:
        report["versions"]["redis_server"] = server_version(url)
        queued, overhead = run_through_queue(engine, requests, url, args)
        print(f"through the queue {queued['output_tok_s']:9.1f} output tok/s  ({queued['elapsed_s']:.1f}s)")
        if args.tracing:
            report["tracing"] = traced_pass(engine, requests, url, args, queued)
    second = run_in_process(engine, requests)
    print(f"in-process again  {second['output_tok_s']:9.1f} output tok/s  ({second['elapsed_s']:.1f}s)")
    baseline = (first["output_tok_s"] + second["output_tok_s"]) / 2
    report.update(throughput_ratio=queued["output_tok_s"] / baseline, overhead_ms=overhead["total"],
                  overhead_parts_ms={k: v for k, v in overhead.items() if k != "total"},
                  in_process=[first, second], queue=queued,
                  targets={"throughput_ratio": ">= 0.95", "overhead_ms.p50": "<= 2", "overhead_ms.p99": "<= 10"})
    print(f"throughput ratio  {report['throughput_ratio']:.3f}  (queue / mean in-process; target >= 0.95)")
    for name, p in overhead.items():
        print(f"overhead {name:<17} p50 {p['p50']:.2f} ms  p99 {p['p99']:.2f} ms")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


# ---- set-up ------------------------------------------------------------------------------------
def build_engine(args, workload):
    if args.simulated:
        from kvgate.engine.simulated import SimulatedEngine

        return SimulatedEngine(num_blocks=4096, block_size=16, max_num_seqs=args.max_num_seqs, step_overhead_s=0.01,
                               per_token_s=0.0002)
    from kvgate.engine import LLMEngine

    print(f"loading {args.model} ({workload.dtype}) ...", file=sys.stderr, flush=True)
    return LLMEngine(args.model, dtype=workload.dtype, max_num_seqs=args.max_num_seqs,
                     max_model_len=workload.prompt_len[1] + workload.output_len[1], seed=0)


def vocab_size(engine) -> int:
    tokenizer = engine.tokenizer
    return getattr(tokenizer, "vocab_size", None) or len(tokenizer)


def make_requests(workload, n: int, vocab: int, seed: int) -> list:
    from dataclasses import replace

    from kvgate.bench.engine import make_requests as w_cpu_requests

    return w_cpu_requests(replace(workload, num_requests=n), vocab, seed)


def settings_of(args, workload) -> dict:
    return {"engine": "simulated" if args.simulated else args.model, "dtype": workload.dtype,
            "num_requests": args.num_requests, "prompt_len": workload.prompt_len, "output_len": workload.output_len,
            "max_num_seqs": args.max_num_seqs, "sampling": "greedy, ignore_eos", "prompts": f"random ids, seed {args.seed}",
            "workers": 1, "producer": "SDK submit_many, all at once", "probes": args.probes}


def environment(args) -> dict:
    from kvgate.bench.report import machine_info, versions

    return {"machine": machine_info(), "versions": versions()}


def print_header(report: dict) -> None:
    print(f"workload W-QUEUE  settings {report['settings']}")
    print(f"machine  {report['machine']}")
    print(f"versions {report['versions']}")


class redis_for:
    """The given --redis-url, or an embedded redis-server for the duration of the run."""

    def __init__(self, args):
        self.url, self.embedded = args.redis_url, None

    def __enter__(self) -> str:
        if self.url:
            return self.url
        from kvgate.redis_server import EmbeddedRedis

        self.embedded = EmbeddedRedis().start()
        return self.embedded.url

    def __exit__(self, *exc) -> None:
        if self.embedded is not None:
            self.embedded.stop()


def server_version(url: str) -> str:
    from kvgate.producer.redis_url import connect

    info = connect(url).info("server")
    info = next(iter(info.values())) if "redis_version" not in info else info  # a cluster answers per node
    return info["redis_version"]


# ---- the contestants -----------------------------------------------------------------------------
def params_for(request):
    from kvgate.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=request.max_tokens, ignore_eos=True)


def warm_up(engine, request) -> None:
    from kvgate.engine.sampling_params import SamplingParams

    engine.add_request("warmup", request.prompt_ids[:8], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def run_in_process(engine, requests) -> dict:
    """On the main thread, where the model was loaded and where `kvgate worker` steps it: stepped on another,
    every step ran ~50% slower on a 2-core VM (ModelRunner warns why)."""
    tag = uuid.uuid4().hex[:6]
    start = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(f"{tag}-{i}", r.prompt_ids, params_for(r))
    tokens, shown = 0, time.monotonic()
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        if time.monotonic() - shown > 15:
            shown = time.monotonic()
            print(f"  ... {tokens} tokens in {time.perf_counter() - start:.0f}s", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - start
    return {"output_tokens": tokens, "elapsed_s": elapsed, "output_tok_s": tokens / elapsed}


def run_through_queue(engine, requests, url: str, args, tracing=None) -> tuple[dict, dict]:
    """The worker loop on the main thread (see run_in_process); the SDK submits and collects from another."""
    return beside_worker(engine, url, args.max_num_seqs,
                         lambda client: (submit_all(client, requests), probe_overhead(client, requests[0], args.probes)),
                         tracing)


def traced_pass(engine, requests, url: str, args, plain: dict) -> dict:
    """The queue pass again with tracing on: the application's tracer provider (the SDK's enqueue spans) and the
    worker's, both sending every span to a local OTLP receiver; its throughput against the plain pass's."""
    from opentelemetry import trace

    from kvgate.bench.otlp_sink import OtlpSink
    from kvgate.worker.tracing import JobTracing, make_provider

    sink = OtlpSink()
    app_provider, _ = make_provider("w-queue-producer", endpoint=sink.url)
    trace.set_tracer_provider(app_provider)  # once per process: this pass comes last
    provider, ids = make_provider("w-queue-worker", endpoint=sink.url)
    try:
        traced, overhead = run_through_queue(engine, requests, url, args, JobTracing(provider, ids, "bench-worker"))
    finally:
        app_provider.force_flush()
        sink.close()
    ratio = traced["output_tok_s"] / plain["output_tok_s"]
    print(f"traced queue      {traced['output_tok_s']:9.1f} output tok/s  ({traced['elapsed_s']:.1f}s)  "
          f"ratio {ratio:.3f} (target >= 0.97); {sink.requests} exports, {sink.bytes / 1e6:.2f} MB")
    for name, p in overhead.items():
        print(f"traced overhead {name:<17} p50 {p['p50']:.2f} ms  p99 {p['p99']:.2f} ms")
    return {"queue": traced, "overhead_ms": overhead, "ratio": ratio, "target": ">= 0.97",
            "exports": sink.requests, "export_bytes": sink.bytes}


def beside_worker(engine, url: str, max_num_seqs: int, produce, tracing=None):
    """One worker over `engine` in a fresh namespace on this thread (torch steps fastest on the thread that loaded
    the model) until `produce(client)`, run on another thread with an SDK client of that namespace, returns: its
    value, or its exception raised here."""
    from kvgate.producer.client import Client
    from kvgate.worker.settings import WorkerSettings
    from kvgate.worker.null_metrics import NullMetrics
    from kvgate.worker.worker import Worker

    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    settings = WorkerSettings(redis_url=url, namespace=namespace, worker_id="bench-worker", max_num_seqs=max_num_seqs)
    worker = Worker(engine, settings, metrics=NullMetrics(), tracing=tracing)
    stop, box = threading.Event(), {}

    def run() -> None:
        client = Client(url, namespace=namespace)
        try:
            box["value"] = produce(client)
        except BaseException as e:  # re-raised on this thread below
            box["error"] = e
        finally:
            client.close()
            stop.set()

    producer = threading.Thread(target=run, name="bench-producer", daemon=True)
    producer.start()
    worker.run(stop)
    producer.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def submit_all(client, requests) -> dict:
    jobs = [dict(prompt_token_ids=r.prompt_ids, max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
            for r in requests]
    start = time.perf_counter()
    handles = client.submit_many(jobs, progress=False)
    results = [h.result(timeout=3600) for h in handles]
    elapsed = time.perf_counter() - start
    bad = [r for r in results if r.status != "done"]
    if bad:
        raise RuntimeError(f"{len(bad)} jobs did not finish: {bad[0]}")
    tokens = sum(len(r.token_ids) for r in results)
    return {"output_tokens": tokens, "elapsed_s": elapsed, "output_tok_s": tokens / elapsed}


def probe_overhead(client, request, probes: int) -> dict:
    """One-token jobs, one at a time, against an idle worker: enqueue -> admission, and the final token ->
    the result in the client's hands. Same machine, same clock."""
    admit, deliver = [], []
    for _ in range(probes):
        handle = client.submit(prompt_token_ids=request.prompt_ids[:16], max_tokens=1, temperature=0.0,
                               ignore_eos=True)
        result = handle.result(timeout=120)
        received = time.time()
        t = result.timings
        admit.append((t.admitted - t.queued) * 1000)
        deliver.append((received - t.finished) * 1000)
        time.sleep(0.01)
    total = [a + d for a, d in zip(admit, deliver)]
    return {"total": percentiles(total), "enqueue_to_admission": percentiles(admit),
            "final_token_to_result": percentiles(deliver)}


def percentiles(values: list[float]) -> dict:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": statistics.median(ordered), "p99": p99, "max": ordered[-1], "n": len(ordered)}
