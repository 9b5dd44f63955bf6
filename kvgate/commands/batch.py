"""`kvgate batch in.jsonl -o out.jsonl`: an OpenAI Batch file through the fleet, resumable.

Lines already answered in the output file are skipped on restart; the rest are submitted with
idempotency keys derived from the input file's digest and their custom_id (and the input's place, for an
/v1/embeddings line of several inputs: one job each), so lines whose jobs are still in flight from the
interrupted run reuse those jobs instead of computing them again. A line is written once, when every job
it owns is final.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import IO

from tqdm.auto import tqdm

from kvgate.producer.client import Client
from kvgate.producer.loras import Lora, list_loras
from kvgate.producer.model_set import known_models
from kvgate.producer.steps import run as run_steps
from kvgate.producer.errors import ResultTimeout
from kvgate.openai.batch import BatchRequest, file_digest, file_problems, plan_line, request_lines, unknown_model_line
from kvgate.openai.batch_runs import line_runs, submit_jobs
from kvgate.openai.completion_window import BadWindow, window_seconds

MAX_PROBLEMS = 20  # listed when a file is refused; the message says how many more there are


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", type=Path, help="OpenAI Batch input file (JSONL)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="output JSONL (appended to on resume)")
    parser.add_argument("--priority", choices=("high", "normal", "low"), default="low",
                        help="queue for these jobs (default low, so interactive work goes first)")
    parser.add_argument("--completion-window", metavar="WINDOW",
                        help="finish the lines within this window, as OpenAI's completion_window ('24h', '90m', 1h to "
                             "7d): every job carries the window's end as its deadline, so the fleet serves it "
                             "earliest deadline first, and a line not started by then is answered batch_expired "
                             "(default: no window). It starts when the command starts, on a resume too")
    parser.add_argument("--timeout", type=float, help="seconds to wait for all results (default: forever)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def answered_ids(output: Path) -> set[str]:
    """custom_ids already in the output; a torn last line from an interrupted write is cut off."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[:data.rfind(b"\n") + 1]
        output.write_bytes(data)
    done = set()
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            done.add(row.get("custom_id"))
    return done


def gateway_translators() -> dict:
    """The endpoints the gateway's managed batches take beside chat, completions and embeddings (/v1/responses: its
    Responses parser and Response object), where the gateway's extra is installed; without it none, and such lines
    are answered with an invalid_url error line that says so."""
    try:
        from kvgate.gateway.responses.batch_line import TRANSLATORS
    except ImportError:  # no starlette: pip install 'kvgate[gateway]'
        return {}
    return TRANSLATORS


def read_requests(data: bytes, digest: str, done: set[str], priority: str, out: IO[str],
                  client: Client) -> tuple[list[BatchRequest], int]:
    """Parse and validate the lines still to do (`digest`: the file's, which seeds their idempotency keys and names
    their lines); bad lines get their error line now, and are counted. A line for a model the fleet does not know
    (no worker served it, no operator added it) is one of them, as the gateway answers it: a typo would otherwise
    wait in streams nobody reads until --timeout."""
    todo, rejected = [], 0
    known = set(run_steps(known_models(client.redis, client.keys)))
    loras = run_steps(list_loras(client.redis, client.keys))
    translators = gateway_translators()
    for line_no, raw in request_lines(data):
        planned = plan_line(line_no, raw, digest, priority, client.keys, client.client_id, translators)
        if isinstance(planned, BatchRequest) and planned.model and (problem := refusal(planned.model, known, loras)):
            planned = unknown_model_line(planned, problem, digest)
        if isinstance(planned, BatchRequest):
            if planned.custom_id not in done:
                todo.append(planned)
        elif planned["custom_id"] not in done:
            _write(out, planned)
            rejected += 1
    return todo, rejected


def refusal(model: str, known: set[str], loras: dict[str, Lora]) -> str | None:
    """Why a line's model would wait forever, or None: a model the fleet does not know, or a LoRA adapter (a
    registered one is a known model, its jobs on its own streams) of a base model it does not know, as the gateway
    refuses them."""
    if (adapter := loras.get(model)) is not None and adapter.base not in known:
        return (f"model {model!r} is a LoRA adapter of {adapter.base!r}, which is not known to the fleet: no worker "
                f"has served it and no operator added it (`kvgate models add {adapter.base}` if its workers are on "
                "the way)")
    if model in known:
        return None
    return (f"model {model!r} is not known to the fleet: no worker has served it and no operator added it (known: "
            f"{', '.join(sorted(known))}; `kvgate models add {model}` if its workers are on the way, or `kvgate loras "
            f"add {model} PATH --base MODEL` for a LoRA adapter)")


def _write(out: IO[str], row: dict) -> None:
    out.write(json.dumps(row, ensure_ascii=False) + "\n")
    out.flush()  # a line on disk is a line a resumed run skips


def run(args: argparse.Namespace) -> int:
    try:
        data = args.input.read_bytes()
    except OSError as e:
        print(f"kvgate batch: cannot read {args.input}: {e}", file=sys.stderr)
        return 2
    try:
        window_s = None if args.completion_window is None else window_seconds(args.completion_window)
    except BadWindow as e:
        print(f"kvgate batch: --completion-window: {e}", file=sys.stderr)
        return 2
    problems = file_problems(request_lines(data))
    if problems:  # as /v1/batches fails such a file: every line needs its own custom_id to be answered under
        more = f"\n  ... and {len(problems) - MAX_PROBLEMS} more" if len(problems) > MAX_PROBLEMS else ""
        listed = "".join(f"\n  {p.message}" for p in problems[:MAX_PROBLEMS])
        print(f"kvgate batch: {args.input}: nothing was submitted; fix these lines and run again:{listed}{more}",
              file=sys.stderr)
        return 2
    done = answered_ids(args.output)
    try:
        with Client(args.redis_url, args.namespace, tenant=args.tenant) as client, args.output.open("a", encoding="utf-8") as out:
            digest = file_digest(data)  # once: hashing a large file twice cost as much again
            todo, rejected = read_requests(data, digest, done, args.priority, out, client)
            deadline = None if window_s is None else time.time() + window_s
            failed = _process(client, todo, out, args, digest, deadline)
    except ResultTimeout as e:
        print(f"kvgate batch: {e}; run the same command again to resume", file=sys.stderr)
        return 3
    skipped = f"; {len(done)} already in the output were skipped" if done else ""
    print(f"kvgate batch: {len(todo) + rejected} lines written: {len(todo) - failed} succeeded, "
          f"{failed + rejected} failed ({rejected} rejected before submission, {failed} failed on the fleet)"
          f"{skipped}; output in {args.output}", file=sys.stderr)
    return 0


def _process(client: Client, todo: list[BatchRequest], out: IO[str], args: argparse.Namespace, digest: str,
             deadline: float | None) -> int:
    """Submit the lines to do (each job due by `deadline`, the window's end, where there is a window) and write each
    line's answer once all its jobs are final; returns how many lines failed on the fleet. `digest`: the input
    file's, which names the lines a window expired."""
    show = not args.no_progress
    handles = client.submit_many(submit_jobs(todo, **({} if deadline is None else {"deadline": deadline})),
                                 progress=show)
    by_job = {job_id: run for run in line_runs(todo, [h.job_id for h in handles]) for job_id in run.job_ids}
    models: dict[str, str | None] = {}
    failed = 0
    with tqdm(total=len(todo), unit="line", desc="batch", disable=not show) as bar:
        for handle in client.as_completed(list(handles), timeout=args.timeout):
            run, result = by_job[handle.job_id], handle.result(timeout=0)
            if not run.add(result):
                continue
            first = run.results[run.job_ids[0]]
            row = run.answer(digest, first.model or _served_by(client, first.worker, models))
            failed += row["error"] is not None
            _write(out, row)
            bar.update(1)
    return failed


def _served_by(client: Client, worker_id: str | None, models: dict[str, str | None]) -> str | None:
    """The model name the worker's heartbeat reports, for results of workers that predate Final.model; None when
    it is gone."""
    if not worker_id:
        return None
    if worker_id not in models:
        raw = client.redis.hget(client.keys.worker(worker_id), "model")
        models[worker_id] = raw.decode() if isinstance(raw, bytes) else raw
    return models[worker_id]
