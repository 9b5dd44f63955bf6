"""`kvgate cancel JOB_ID`: ask the fleet to stop a job; its final event then says 'cancelled'."""
from __future__ import annotations

import argparse
import sys

from kvgate.producer.client import Client


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job_id", help="the job id that submit printed or JobHandle.job_id holds")


def run(args: argparse.Namespace) -> int:
    with Client(args.redis_url, args.namespace) as client:
        finished = client.get(args.job_id)
        if finished is not None:
            print(f"kvgate cancel: job {args.job_id!r} already finished ({finished.status}); nothing to cancel",
                  file=sys.stderr)
            return 1
        client.attach(args.job_id).cancel()
    print(f"cancellation requested for job {args.job_id}")
    return 0
