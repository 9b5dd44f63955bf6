"""`kvgate get JOB_ID`: print a finished job's result, or say where the job is (running on which worker,
unknown, lost)."""
from __future__ import annotations

import argparse
import sys

from kvgate.producer.client import Client
from kvgate.commands.submit import print_json

EXIT_NO_RESULT = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job_id", help="the job id that submit printed or JobHandle.job_id holds")
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")


def run(args: argparse.Namespace) -> int:
    with Client(args.redis_url, args.namespace) as client:
        result = client.get(args.job_id)
        status = client.status(args.job_id) if result is None else None
    if status is not None:
        print(f"kvgate get: no result in namespace {args.namespace}; {status}", file=sys.stderr)
        return EXIT_NO_RESULT
    if args.json:
        print_json(result)
    else:
        print(result.text)
    if result.status != "done":
        print(f"job {result.job_id} {result.status}: {result.error or result.finish_reason}", file=sys.stderr)
        return 1
    return 0
