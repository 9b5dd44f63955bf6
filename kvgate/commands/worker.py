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
from pathlib import Path


from kvgate.engine.config import EngineConfig, check_device
from kvgate.producer.urls import mask_url
from kvgate.commands.flags import add_settings_arguments, settings_of
from kvgate.worker.settings import WorkerSettings


class WorkerStartError(ValueError):
    """Settings, model, device or Redis that keep the worker from starting; the message says which."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # --redis-url and --namespace come with every command (kvgate/commands/cli.py)
    add_settings_arguments(parser, WorkerSettings, skip={"redis_url", "namespace"})
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        type=str.upper, help="worker log level (default INFO)")


def settings_from(args: argparse.Namespace) -> WorkerSettings:
    return settings_of(args, WorkerSettings, WorkerStartError)


def check_model(name: str) -> None:
    """The cheap part of the loader's lookup, so a typo fails in a line before torch and the model load."""
    from kvgate.engine.loader import ALIASES, ModelLoadError, random_names

    if name in ALIASES or Path(name).expanduser().exists():
        return
    if name.startswith("random:") and name.removeprefix("random:") in random_names():
        return
    raise ModelLoadError(f"model {name!r} not found: pass an HF folder, a .gguf file, one of {sorted(ALIASES)}, "
                         f"or random:<name> with <name> in {random_names()}")


def engine_kwargs(s: WorkerSettings) -> dict:
    return s.model_dump(include=set(EngineConfig.model_fields))


def build_engine(s: WorkerSettings):
    if s.simulated:
        from kvgate.engine.simulated import SimulatedEngine

        return SimulatedEngine(s.sim_num_blocks, s.block_size, s.max_num_seqs, s.sim_step_ms / 1000,
                               s.sim_per_token_ms / 1000, s.seed, max_loras=s.max_loras,
                               max_cpu_loras=s.max_cpu_loras, lora_load_s=s.sim_lora_load_ms / 1000)
    check_model(s.model)
    check_device(s.device)
    print(f"kvgate worker: loading {s.model} (importing torch)...", file=sys.stderr, flush=True)
    started = time.monotonic()
    from kvgate.engine import LLMEngine

    print(f"kvgate worker: building the engine for {s.model} on device={s.device}...", file=sys.stderr, flush=True)
    engine = LLMEngine(s.model, **engine_kwargs(s))
    stats = engine.stats
    print(f"kvgate worker: {s.model} ready in {time.monotonic() - started:.1f}s "
          f"({stats.total_blocks} KV blocks of {stats.block_size} tokens)", file=sys.stderr, flush=True)
    return engine


def check_redis(url: str) -> None:
    """Connect once before loading anything: a wrong URL or password fails in a line that names the URL."""
    import redis

    from kvgate.producer.redis_url import connect

    client = connect(url, socket_connect_timeout=5, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as e:
        raise WorkerStartError(f"cannot use Redis at {mask_url(url)}: {e}") from e
    finally:
        client.close()


def install_signals(stop: threading.Event) -> None:
    def on_signal(signum, _frame):
        if stop.is_set():  # a second signal: stop waiting for running jobs
            raise KeyboardInterrupt
        logging.getLogger("kvgate.worker").info("signal %s: draining", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    s = settings_from(args)
    check_redis(s.redis_url)
    stop = threading.Event()
    install_signals(stop)
    engine = build_engine(s)
    from kvgate.worker.served import ServedModelError
    from kvgate.worker.worker import Worker

    try:
        worker = Worker(engine, s)
    except ServedModelError as e:
        raise WorkerStartError(str(e)) from None
    if s.metrics_port:
        worker.metrics.serve(s.metrics_port)
    check_redis(s.redis_url)  # the model load can take minutes; say "serving" only while Redis answers
    print(f"kvgate worker {worker.worker_id}: serving {mask_url(s.redis_url)} namespace {s.namespace}, "
          f"models {', '.join(worker.served.names)}",
          file=sys.stderr, flush=True)
    return worker.run(stop)
