"""`kvgate bench embed`: W-EMBED. Embedding jobs of W-CPU's prompts through the queue (one worker) against the same
engine driven in process, and the same embeddings mixed with W-CPU generation jobs on that one worker: embeddings/s,
and the generation throughput they cost.

Order: embeddings in process, through the queue, generation alone through the queue, generation with the
embeddings through the queue. A worker's loop and the in-process loop both run on the main thread (where the model was
loaded: see kvgate/bench/queue.py)."""
from __future__ import annotations

import argparse
import json
import time
import uuid
from dataclasses import replace
from pathlib import Path

from kvgate.commands.flags import setting_parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=64, help="embedding jobs (W-CPU's prompts)")
    parser.add_argument("--num-generate", type=int, default=16, help="generation jobs in the mixed run")
    parser.add_argument("--max-output", type=int, default=64, help="cap of the generation jobs' output lengths")
    parser.add_argument("--pooling", choices=("model", "last", "mean", "cls"), default="model")
    parser.add_argument("--simulated", action="store_true", help="SimulatedEngine instead of SmolLM2 (fast)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-num-seqs", type=setting_parser("max_num_seqs"), default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the report here")


def run(args: argparse.Namespace) -> int:
    from kvgate.bench.engine import WORKLOADS, capped
    from kvgate.bench.queue import build_engine, environment, make_requests, redis_for, server_version, vocab_size

    workload = WORKLOADS["cpu"]
    workload = replace(workload, output_len=capped(workload.output_len, args.max_output))
    engine = build_engine(args, workload)
    prompts = [r.prompt_ids for r in make_requests(workload, args.num_requests, vocab_size(engine), args.seed)]
    generate = make_requests(workload, args.num_generate, vocab_size(engine), args.seed + 1)
    report = {"workload": "W-EMBED", "settings": settings_of(args, workload), **environment(args)}
    print(f"workload W-EMBED  settings {report['settings']}\nmachine  {report['machine']}")
    embed_in_process(engine, prompts[:2], args.pooling)  # warm up
    report["in_process"] = embed_in_process(engine, prompts, args.pooling)
    _show("embeddings in process", report["in_process"])
    with redis_for(args) as url:
        report["versions"]["redis_server"] = server_version(url)
        report["queue"] = through_queue(engine, url, args, prompts, [])["embed"]
        _show("embeddings through the queue", report["queue"])
        report["generate_alone"] = through_queue(engine, url, args, [], generate)["generate"]
        _show("generation alone", report["generate_alone"])
        mixed = through_queue(engine, url, args, prompts, generate)
    report["mixed"] = mixed
    _show("mixed: embeddings", mixed["embed"])
    _show("mixed: generation", mixed["generate"])
    report["queue_ratio"] = report["queue"]["embeddings_s"] / report["in_process"]["embeddings_s"]
    report["generation_cost"] = 1 - mixed["generate"]["output_tok_s"] / report["generate_alone"]["output_tok_s"]
    print(f"queue / in process {report['queue_ratio']:.3f}; generation throughput lost to the mixed embeddings "
          f"{100 * report['generation_cost']:.1f}%")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


def settings_of(args, workload) -> dict:
    return {"engine": "simulated" if args.simulated else args.model, "dtype": workload.dtype,
            "embeddings": args.num_requests, "prompt_len": workload.prompt_len, "pooling": args.pooling,
            "generate": args.num_generate, "output_len": workload.output_len, "max_num_seqs": args.max_num_seqs,
            "prompts": f"random ids, seed {args.seed}", "workers": 1, "producer": "SDK submit_many, all at once"}


def _show(name: str, figures: dict) -> None:
    shown = "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
    print(f"{name:<30} {shown}")


def embed_in_process(engine, prompts: list[list[int]], pooling: str) -> dict:
    from kvgate.engine.pooling_params import PoolingParams

    tag, params = uuid.uuid4().hex[:6], PoolingParams(pooling)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_embedding_request(f"{tag}-{i}", ids, params)
    done = 0
    while engine.has_unfinished():
        done += sum(1 for o in engine.step() if o.embedding is not None)
    return rates(done, sum(map(len, prompts)), 0, time.perf_counter() - start)


def rates(embeddings: int, prompt_tokens: int, output_tokens: int, elapsed: float) -> dict:
    figures = {"elapsed_s": elapsed, "prompt_tok_s": prompt_tokens / elapsed}
    if embeddings:
        figures.update(embeddings=embeddings, embeddings_s=embeddings / elapsed)
    if output_tokens:
        figures.update(output_tokens=output_tokens, output_tok_s=output_tokens / elapsed)
    return figures


def through_queue(engine, url: str, args, prompts: list[list[int]], generate: list) -> dict:
    """One worker over `engine` on the main thread; the SDK submits the embedding and the generation jobs at once
    from another thread and times each kind from the submit to its last result."""
    from kvgate.bench.queue import beside_worker

    def produce(client) -> dict:
        jobs = [dict(prompt_token_ids=r.prompt_ids, max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
                for r in generate]
        jobs += [dict(prompt_token_ids=ids, task="embed", pooling=args.pooling) for ids in prompts]
        start = time.perf_counter()
        handles = client.submit_many(jobs, progress=False)
        ends, figures = {}, {}
        for h in client.as_completed(handles, timeout=3600):
            ends[h.job_id] = time.perf_counter() - start
        results = [h.result(timeout=1) for h in handles]
        bad = [r for r in results if r.status != "done"]
        if bad:
            raise RuntimeError(f"{len(bad)} jobs did not finish: {bad[0]}")
        gen, emb = results[:len(generate)], results[len(generate):]
        if gen:
            figures["generate"] = rates(0, sum(r.usage.prompt_tokens for r in gen),
                                        sum(r.usage.completion_tokens for r in gen), max(ends[r.job_id] for r in gen))
        if emb:
            figures["embed"] = rates(len(emb), sum(r.usage.prompt_tokens for r in emb), 0,
                                     max(ends[r.job_id] for r in emb))
        return figures

    return beside_worker(engine, url, args.max_num_seqs, produce)
