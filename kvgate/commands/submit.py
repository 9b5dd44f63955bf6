"""`kvgate submit "prompt"`: submit one prompt and print (or stream) its answer."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import msgspec

from kvgate.producer.client import Client
from kvgate.producer.errors import ResultTimeout
from kvgate.openai.shapes import chat_logprobs
from kvgate.producer.stream import Restart

EXIT_BY_STATUS = {"done": 0, "error": 1, "expired": 1, "cancelled": 1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the user message ('-' reads it from stdin)")
    parser.add_argument("--system", help="a system message before the prompt")
    parser.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    parser.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="OpenAI's, in [-2, 2]: lowers a token's logit by this per earlier use in the answer")
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="OpenAI's, in [-2, 2]: lowers a token's logit by this once it is in the answer")
    parser.add_argument("--logprobs", type=int, metavar="N",
                        help="report each token's logprob and its N most likely alternatives (0 to 20)")
    parser.add_argument("--stop", action="append", help="a stop string (repeatable)")
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
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    seed=args.seed, stop=args.stop, priority=args.priority, ttl_s=args.ttl_s, model=args.model,
                    stream=args.stream and not args.json, frequency_penalty=args.frequency_penalty,
                    presence_penalty=args.presence_penalty, logprobs=args.logprobs)
    if args.raw:
        if args.system:
            raise SystemExit("kvgate submit: --system needs the chat template; drop --raw")
        return {"prompt": prompt, **sampling}
    system = [{"role": "system", "content": args.system}] if args.system else []
    return {"messages": [*system, {"role": "user", "content": prompt}], **sampling}


def run(args: argparse.Namespace) -> int:
    try:
        with Client(args.redis_url, args.namespace) as client:
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
