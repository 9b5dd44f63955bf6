"""`kvgate loras [add NAME PATH --base MODEL | remove NAME | list]`: the fleet's LoRA adapters (`{ns}:loras`).

A registered adapter is a model name of its own: requests name it as `model` (OpenAI clients do), its jobs wait on its
own streams, and any worker of its base model with adapter slots (`--max-loras`) loads it from PATH on first use. PATH
is the adapter's PEFT folder as the workers see it. Removing an adapter answers its waiting jobs with an error result.
"""
from __future__ import annotations

import argparse
import sys

from kvgate.commands.namespace import namespace_redis
from kvgate.producer.errors import InvalidRequest
from kvgate.producer.loras import add_lora, list_loras, remove_lora
from kvgate.producer.steps import run as run_steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=("list", "add", "remove"), default="list",
                        help="list the registered adapters (the default), add one, or remove one")
    parser.add_argument("name", nargs="?", metavar="NAME", help="the adapter's name, for add and remove")
    parser.add_argument("path", nargs="?", metavar="PATH", help="the adapter's PEFT folder on the workers, for add")
    parser.add_argument("--base", metavar="MODEL", help="the base model the adapter was trained on, for add")


def _usage(args: argparse.Namespace) -> str | None:
    if args.action == "add" and not (args.name and args.path and args.base):
        return "name the adapter, its folder and its base model (kvgate loras add NAME PATH --base MODEL)"
    if args.action == "remove" and (not args.name or args.path):
        return "name one adapter (kvgate loras remove NAME)"
    if args.action == "list" and (args.name or args.base):
        return "list takes no names (kvgate loras list)"
    return None


def run(args: argparse.Namespace) -> int:
    if (problem := _usage(args)) is not None:
        print(f"kvgate loras {args.action}: {problem}", file=sys.stderr)
        return 2
    with namespace_redis(args.redis_url, args.namespace) as (r, keys):
        try:
            if args.action == "add":
                new = run_steps(add_lora(r, keys, args.name, args.path, args.base))
                print(f"{'added' if new else 'updated'} adapter {args.name} of {args.base} at {args.path}")
            elif args.action == "remove":
                if not run_steps(remove_lora(r, keys, args.name)):
                    print(f"kvgate loras remove: no adapter {args.name!r} is registered (kvgate loras list)",
                          file=sys.stderr)
                    return 1
                print(f"removed adapter {args.name}")
            else:
                for lora in run_steps(list_loras(r, keys)).values():
                    print(f"{lora.name}\t{lora.base}\t{lora.path}")
        except (InvalidRequest, ValueError) as e:  # a bad name or path, or too many known models
            print(f"kvgate loras {args.action}: {e}", file=sys.stderr)
            return 2
    return 0
