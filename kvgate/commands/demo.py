"""`kvgate demo`: the whole path in one command. Embedded Redis, one worker with the bundled
SmolLM2-135M-Instruct, a handful of chat prompts through the SDK; one answer streamed token by token."""
from __future__ import annotations

import argparse
import threading
import time
from contextlib import ExitStack

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Give me three tips for staying focused while studying.",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a cat watching the rain.",
    "What are the benefits of drinking water?",
    "Suggest a name for a friendly robot and say why.",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model the demo worker serves")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per answer")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), choices=range(1, len(PROMPTS) + 1),
                        metavar=f"1..{len(PROMPTS)}", help="how many of the demo prompts to send")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    with ExitStack() as stack:
        url = args.redis_url or start_embedded_redis(stack, console)
        start_worker(stack, console, url, args)
        from kvgate.producer import Client, Restart

        client = stack.enter_context(Client(url, namespace=args.namespace))
        handles = [client.submit(messages=[{"role": "user", "content": p}], max_tokens=args.max_tokens,
                                 temperature=0.0, stream=(i == 0)) for i, p in enumerate(PROMPTS[: args.prompts])]
        console.rule(f"{len(handles)} jobs queued; streaming the first answer")
        console.print(f"[bold]user:[/] {PROMPTS[0]}\n[bold]assistant:[/] ", end="")
        for item in handles[0].stream(timeout=300):
            if isinstance(item, Restart):  # a redelivered job starts its text anew
                console.print(f"\n[dim]({item.reason}; restarting the answer)[/] ", end="")
            console.print(item.text, end="", markup=False, highlight=False)
        console.print()
        results = [h.result(timeout=300) for h in handles]
        print_results(console, results)
        return 0 if all(r.status == "done" and r.text.strip() for r in results) else 1


def start_embedded_redis(stack: ExitStack, console) -> str:
    from kvgate.redis_server import EmbeddedRedis

    server = stack.enter_context(EmbeddedRedis())
    console.print(f"[bold]redis[/]   embedded redis-server at {server.url} (stopped on exit)")
    return server.url


def start_worker(stack: ExitStack, console, url: str, args: argparse.Namespace) -> None:
    from kvgate.commands.worker import build_engine
    from kvgate.worker.settings import WorkerSettings
    from kvgate.worker.worker import Worker

    settings = WorkerSettings(redis_url=url, namespace=args.namespace, model=args.model, max_num_seqs=8,
                              drain_timeout_s=2.0, worker_id="demo-worker")
    stop, loaded, box = threading.Event(), threading.Event(), {}

    def serve() -> None:
        # load and step the model on this one thread: stepped on another it runs ~50% slower (ModelRunner warns why)
        try:
            box["worker"] = Worker(build_engine(settings), settings)
        except BaseException as e:
            box["error"] = e
            return
        finally:
            loaded.set()
        box["worker"].run(stop)

    started = time.monotonic()
    thread = threading.Thread(target=serve, name="demo-worker", daemon=True)
    thread.start()
    with console.status(f"loading {args.model} (first run converts the bundled GGUF once)..."):
        loaded.wait()
    if "error" in box:
        raise box["error"]
    console.print(f"[bold]worker[/]  {args.model} loaded in {time.monotonic() - started:.1f}s")

    def stop_worker() -> None:
        stop.set()
        thread.join(timeout=10)

    stack.callback(stop_worker)


def print_results(console, results) -> None:
    from rich.table import Table

    table = Table(title="answers", show_lines=True)
    for column in ("#", "status", "answer", "tokens", "latency s", "tokens/s"):
        table.add_column(column, overflow="fold")
    total_tokens = 0
    for i, r in enumerate(results, 1):
        tokens = r.usage.completion_tokens
        total_tokens += tokens
        busy = (r.timings.finished or 0) - (r.timings.admitted or r.timings.queued)
        table.add_row(str(i), f"{r.status} ({r.finish_reason})", r.text.strip() or r.error or "",
                      str(tokens), f"{r.latency_s:.2f}", f"{tokens / busy:.1f}" if busy > 0 else "-")
    console.print(table)
    first = min(r.timings.queued for r in results)
    wall = max(r.timings.finished or first for r in results) - first
    console.print(f"[bold]summary[/] {len(results)} jobs, {total_tokens} tokens in {wall:.1f}s "
                  f"= {total_tokens / wall:.1f} tokens/s through the queue with continuous batching")
