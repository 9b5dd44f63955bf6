"""`kvgate worker`: load a model (or the simulated engine), then serve jobs from Redis until SIGTERM/SIGINT.

Imports stay light at module level: torch loads inside `run`, only when a real engine is built.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time

from kvgate.worker.settings import WorkerSettings

ENGINE_FLAGS = ("model", "device", "dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                "kv_cache_memory", "scheduling", "seed")
WORKER_FLAGS = ("worker_id", "metrics_port", "drain_timeout_s", "reclaim_idle_ms", "max_deliveries", "local_queue_size",
                "sim_num_blocks", "sim_step_ms", "sim_per_token_ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", help="model alias, HF folder or GGUF file (env KVGATE_MODEL; default smollm2-135m)")
    add("--device"), add("--dtype")
    add("--max-num-seqs", type=int), add("--max-num-batched-tokens", type=int), add("--max-model-len", type=int)
    add("--block-size", type=int), add("--kv-cache-memory", help="KV cache size, e.g. 2GiB")
    add("--no-prefix-caching", dest="prefix_caching", action="store_false", default=None)
    add("--scheduling", choices=("continuous", "static")), add("--seed", type=int)
    add("--worker-id", help="stable consumer name (env KVGATE_WORKER_ID; default hostname-pid)")
    add("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    add("--drain-timeout", dest="drain_timeout_s", type=float, help="seconds to finish running jobs on SIGTERM")
    add("--reclaim-idle-ms", type=int, help="pending entries idle this long are taken over from dead workers")
    add("--max-deliveries", type=int, help="deliveries after which a job goes to the dead stream")
    add("--local-queue-size", type=int)
    add("--simulated", action="store_true", default=None, help="cost-model engine without a model (W-FLEET)")
    add("--sim-num-blocks", type=int), add("--sim-step-ms", type=float), add("--sim-per-token-ms", type=float)
    add("--log-level", default="INFO")


def settings_from(args: argparse.Namespace) -> WorkerSettings:
    given = {k: getattr(args, k, None) for k in (*ENGINE_FLAGS, *WORKER_FLAGS, "prefix_caching", "simulated",
                                                  "redis_url", "namespace")}
    return WorkerSettings(**{k: v for k, v in given.items() if v is not None})


def build_engine(s: WorkerSettings):
    if s.simulated:
        from kvgate.engine.simulated import SimulatedEngine

        return SimulatedEngine(s.sim_num_blocks, s.block_size, s.max_num_seqs, s.sim_step_ms / 1000,
                               s.sim_per_token_ms / 1000, s.seed)
    print(f"kvgate worker: loading {s.model} (importing torch)...", file=sys.stderr, flush=True)
    started = time.monotonic()
    from kvgate.engine import LLMEngine

    print(f"kvgate worker: building the engine for {s.model} on device={s.device}...", file=sys.stderr, flush=True)
    engine = LLMEngine(s.model, device=s.device, dtype=s.dtype, max_num_seqs=s.max_num_seqs,
                       max_num_batched_tokens=s.max_num_batched_tokens, max_model_len=s.max_model_len,
                       block_size=s.block_size, kv_cache_memory=s.kv_cache_memory,
                       enable_prefix_caching=s.prefix_caching, scheduling=s.scheduling, seed=s.seed)
    stats = engine.stats
    print(f"kvgate worker: {s.model} ready in {time.monotonic() - started:.1f}s "
          f"({stats.total_blocks} KV blocks of {stats.block_size} tokens)", file=sys.stderr, flush=True)
    return engine


def install_signals(stop: threading.Event) -> None:
    def on_signal(signum, _frame):
        if stop.is_set():  # a second signal: stop waiting for running jobs
            raise KeyboardInterrupt
        logging.getLogger("kvgate.worker").info("signal %s: draining", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(args, "log_level", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    s = settings_from(args)
    stop = threading.Event()
    install_signals(stop)
    engine = build_engine(s)
    from kvgate.worker.worker import Worker

    worker = Worker(s.redis_url, engine, namespace=s.namespace, worker_id=s.worker_id, settings=s)
    if s.metrics_port:
        worker.metrics.serve(s.metrics_port)
    print(f"kvgate worker {worker.worker_id}: serving {s.redis_url} namespace {s.namespace}",
          file=sys.stderr, flush=True)
    return worker.run(stop)
