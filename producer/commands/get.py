"""`kvgate get JOB_ID`: print a finished job's result, or say that there is none (yet)."""
from __future__ import annotations

import argparse
import sys

from ..client import Client
from .submit import print_json

EXIT_NO_RESULT = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job_id", help="the job id that submit printed or JobHandle.job_id holds")
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")


def run(args: argparse.Namespace) -> int:
    with Client(args.redis_url, args.namespace) as client:
        result = client.get(args.job_id)
    if result is None:
        print(f"kvgate get: no result for job {args.job_id!r} in namespace {args.namespace}: it is unknown, "
              "not finished yet, or its result expired", file=sys.stderr)
        return EXIT_NO_RESULT
    if args.json:
        print_json(result)
    else:
        print(result.text)
    if result.status != "done":
        print(f"job {result.job_id} {result.status}: {result.error or result.finish_reason}", file=sys.stderr)
        return 1
    return 0
