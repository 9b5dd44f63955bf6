"""`kvgate models [add|remove NAME...]`: the models the fleet knows (`{ns}:models`), and an operator's changes to them.

A model is known once a worker served it or an operator added it; only then do `kvgate stats`, `top`, the exporter
and the gateway see its backlog and accept its name while no worker serves it (scale from zero). A producer's submit
never adds one, so a typo stays a typo: run `kvgate models add NAME` before an SDK user's jobs for a model no worker
has served yet should show as waiting for scale-up.
"""
from __future__ import annotations

import argparse
import sys

from kvgate.commands.namespace import namespace_redis
from kvgate.producer.model_set import add_models, known_models, remove_models
from kvgate.producer.steps import run as run_steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=("list", "add", "remove"), default="list",
                        help="list the known models (the default), add some, or remove some")
    parser.add_argument("names", nargs="*", metavar="NAME", help="model names, for add and remove")


def run(args: argparse.Namespace) -> int:
    if args.action != "list" and not args.names:
        print(f"kvgate models {args.action}: name at least one model (for example kvgate models {args.action} "
              "Qwen/Qwen2.5-7B-Instruct)", file=sys.stderr)
        return 2
    with namespace_redis(args.redis_url, args.namespace) as (r, keys):
        try:
            if args.action == "add":
                print(f"added {run_steps(add_models(r, keys, args.names))} of {len(set(args.names))} models")
            elif args.action == "remove":
                print(f"removed {run_steps(remove_models(r, keys, args.names))} of {len(set(args.names))} models")
            else:
                print("\n".join(run_steps(known_models(r, keys))))
        except ValueError as e:  # a bad name, or too many models
            print(f"kvgate models {args.action}: {e}", file=sys.stderr)
            return 2
    return 0
