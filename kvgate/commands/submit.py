"""`kvgate submit "prompt"`: submit one prompt and print (or stream) its answer."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing

import msgspec

from kvgate.producer.client import Client
from kvgate.producer.errors import ResultTimeout
from kvgate.producer.fields import Entries, Range, Shape
from kvgate.producer.protocol import SAMPLING_FIELDS
from kvgate.openai.shapes import chat_logprobs
from kvgate.producer.stream import Restart

EXIT_BY_STATUS = {"done": 0, "error": 1, "expired": 1, "cancelled": 1}
# A chat command's usual temperature; the SDK keeps OpenAI's 1.0. Every other default is the wire's own.
COMMAND_DEFAULTS = {"temperature": 0.7}


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field of the wire's Sampling (the one declaration): its type, default and bounds come from
    there, so a new request field is a flag here without being written again. Lists are repeatable flags."""
    for spec in SAMPLING_FIELDS:
        flag = "--" + spec.name.replace("_", "-")
        default = COMMAND_DEFAULTS.get(spec.name, spec.default)
        rule = f"must {spec.bounds.rule()}" if isinstance(spec.bounds, Range) else ""
        if spec.type is bool:  # --skip-special-tokens defaults to on: --no-skip-special-tokens turns it off
            parser.add_argument(flag, action=argparse.BooleanOptionalAction if default else "store_true",
                                default=default, help=f"default {default}")
        elif isinstance(spec.bounds, Entries):  # logit_bias: JSON with token ids as keys, as OpenAI's body has it
            parser.add_argument(flag, type=token_map, metavar="JSON", help='token id -> number: \'{"198": -100}\'')
        elif isinstance(spec.bounds, Shape):  # the output's constraint, as JSON
            parser.add_argument(flag, type=json.loads, default=default, metavar="JSON",
                                help="the answer follows it: '{\"kind\": \"regex\", \"spec\": \"[0-9]+\"}' "
                                     "(kinds: json_schema, json_object, regex, choice with \"choices\", grammar)")
        elif isinstance(spec.default, list):
            item = typing.get_args(spec.type)[0]
            parser.add_argument(flag, action="append", type=item, metavar=item.__name__.upper(),
                                help="repeatable")
        else:
            kind = next(t for t in (*typing.get_args(spec.type), spec.type) if t in (int, float))
            parser.add_argument(flag, type=kind, default=default,
                                help="; ".join(part for part in (rule, f"default {default}") if part))


def token_map(text: str) -> dict[int, float]:
    """A JSON object of token ids (its keys, strings in JSON) to numbers, as the SDK takes it."""
    try:
        return {int(k): float(v) for k, v in json.loads(text).items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object of token ids to numbers ({e})") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the user message ('-' reads it from stdin)")
    parser.add_argument("--system", help="a system message before the prompt")
    parser.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    parser.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    add_sampling_flags(parser)
    parser.add_argument("--priority", choices=("high", "normal", "low"), default="normal")
    parser.add_argument("--model", help="the model to ask (its workers' name or alias); default: the 'default' "
                                        "model, which every worker serves unless started with --no-serve-default")
    parser.add_argument("--ttl", type=float, dest="ttl_s", help="seconds before the job expires unanswered")
    parser.add_argument("--timeout", type=float, help="seconds to wait for the answer (default: forever)")
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")
    parser.add_argument("--no-wait", action="store_true",
                        help="print the job id and exit; `kvgate get JOB_ID` fetches the answer later")


def request_from(args: argparse.Namespace) -> dict:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    sampling = {spec.name: getattr(args, spec.name) for spec in SAMPLING_FIELDS if getattr(args, spec.name) is not None}
    sampling |= dict(priority=args.priority, ttl_s=args.ttl_s, model=args.model, stream=args.stream and not args.json)
    if args.raw:
        if args.system:
            raise SystemExit("kvgate submit: --system needs the chat template; drop --raw")
        return {"prompt": prompt, **sampling}
    system = [{"role": "system", "content": args.system}] if args.system else []
    return {"messages": [*system, {"role": "user", "content": prompt}], **sampling}


def run(args: argparse.Namespace) -> int:
    try:
        with Client(args.redis_url, args.namespace, tenant=args.tenant) as client:
            handle = client.submit(**request_from(args))
            if args.no_wait:
                print(handle.job_id)
                return 0
            try:
                return _answer(handle, args)
            except KeyboardInterrupt:
                handle.cancel()
                print(f"\ncancelled job {handle.job_id}", file=sys.stderr)
                return 130
    except ResultTimeout as e:
        print(f"kvgate submit: {e}", file=sys.stderr)
        return 3


def print_json(result) -> None:
    body = msgspec.to_builtins(dataclasses.asdict(result))
    logprobs = chat_logprobs(result.logprobs)
    body["logprobs"] = None if logprobs is None else logprobs["content"]  # OpenAI's chat shape, not wire arrays
    prompt = chat_logprobs(result.prompt_logprobs)
    if prompt is not None:
        prompt["content"][0]["logprob"] = None  # the first prompt token: nothing before it to score it (NaN)
    body["prompt_logprobs"] = None if prompt is None else prompt["content"]
    print(json.dumps({**body, "latency_s": result.latency_s}, ensure_ascii=False))


def print_logprobs(result) -> None:
    """One line per token on stderr: the token, its logprob, the alternatives asked for."""
    for t in result.logprobs or []:
        top = ", ".join(f"{a.text!r} {a.logprob:.3f}" for a in t.top)
        print(f"{t.text!r}\t{t.logprob:.3f}" + (f"\t[{top}]" if top else ""), file=sys.stderr)


def _answer(handle, args: argparse.Namespace) -> int:
    if args.stream and not args.json:
        for item in handle.stream(timeout=args.timeout):
            if isinstance(item, Restart):  # a redelivered job starts its text anew
                print(f"\n[{item.reason}; restarting the answer]", flush=True)
            print(item.text, end="", flush=True)
        print()
    result = handle.result(timeout=args.timeout)
    if args.json:
        print_json(result)
    elif not args.stream:
        print(result.text)
    if not args.json:
        print_logprobs(result)
    if result.status != "done":
        print(f"job {result.job_id} {result.status}: {result.error or result.finish_reason}", file=sys.stderr)
    elif not args.json:
        tokens = result.usage.completion_tokens
        latency = f", {result.latency_s:.2f} s" if result.latency_s is not None else ""
        served = f", {result.model}" if result.model else ""
        print(f"[{result.status}, {tokens} tokens{latency}, {result.worker}{served}]", file=sys.stderr)
    return EXIT_BY_STATUS.get(result.status, 1)
