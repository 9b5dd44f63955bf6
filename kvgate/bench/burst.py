"""W-BURST (`kvgate bench gateway --burst N`): N requests at the same moment through one `kvgate serve`, half of them
streamed, with the simulated engine behind it (the worker and the gateway of W-GATEWAY, kvgate/bench/gateway_fleet.py).

Reported: requests that failed (target 0; Redis is healthy, so any failure is the gateway's own), by status and
code; time to the first byte of each answer, p50 and p99 (a whole answer's first byte is its end; a stream's is its
first event); the gateway's resident memory before and at its peak, and its CPU per request. Before the burst (on a
heap the burst has not grown), the memory an idle stream holds: N/2 streams for a model no worker serves (allowed
with --model, so each waits with its first event sent), opened in waves so the figure is memory and not a burst,
and the gateway's RSS growth per open stream past the first wave (which pays the code paths' one-time cost).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

IDLE_MODEL = "bench-idle"  # allowed on the gateway, served by no worker: its streams wait
IDLE_WAVE = 50


@dataclass(slots=True)
class Outcome:
    streamed: bool
    status: int = 0  # 0: no HTTP answer at all
    failure: str = ""  # "" when the answer was whole: 200, and a stream ended in [DONE] with no error event
    first_byte_ms: float | None = None


@dataclass(slots=True)
class RssSampler:
    """The gateway's peak resident memory while a phase runs, from /proc (Linux)."""

    pid: int
    peak_kib: int = 0
    task: asyncio.Task | None = field(default=None, repr=False)

    async def _sample(self) -> None:
        while True:
            self.peak_kib = max(self.peak_kib, rss_kib(self.pid) or 0)
            await asyncio.sleep(0.05)

    def __enter__(self) -> "RssSampler":
        self.task = asyncio.get_running_loop().create_task(self._sample())
        return self

    def __exit__(self, *exc) -> None:
        self.task.cancel()
        self.peak_kib = max(self.peak_kib, rss_kib(self.pid) or 0)


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def run(args: argparse.Namespace) -> int:
    from kvgate.bench.gateway_fleet import Fleet
    from kvgate.bench.queue import environment, redis_for, server_version

    settings = {"burst": args.burst, "max_tokens": args.burst_max_tokens, "sim_step_ms": args.sim_step_ms,
                "idle_streams": args.burst // 2}
    report = {"workload": "W-BURST", "settings": settings, **environment(args)}
    print(f"workload W-BURST  settings {settings}")
    with redis_for(args) as url:
        report["versions"]["redis_server"] = server_version(url)
        ns = f"bench-burst-{uuid.uuid4().hex[:8]}"
        with Fleet(url, ns, args, serve_args=["--model", IDLE_MODEL],
                   max_num_seqs=256) as fleet:
            report["idle_streams"] = asyncio.run(idle_streams(fleet, args.burst // 2))  # first: on a fresh heap
            report["burst"] = asyncio.run(burst(fleet, args.burst, args.burst_max_tokens))
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


def _client(base_url: str):
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=base_url, limits=limits, timeout=300)


async def _request(base_url: str, i: int, max_tokens: int, start: asyncio.Event) -> Outcome:
    """One request on a connection of its own, opened before the start line, so the figures are the gateway's
    and not a TCP accept queue's. h11 over asyncio streams rather than httpx: httpx's pool spends client CPU that
    grows with the connections it holds (seconds at 2,000), which on a small machine is taken from the gateway."""
    import h11

    out = Outcome(streamed=i % 2 == 0)
    parts = urlsplit(base_url)
    body = json.dumps({"model": "simulated", "messages": [{"role": "user", "content": f"burst {i}"}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": out.streamed}).encode()
    conn = h11.Connection(h11.CLIENT)
    head = h11.Request(method="POST", target=parts.path + "/chat/completions",
                       headers=[("Host", parts.netloc), ("Content-Type", "application/json"),
                                ("Content-Length", str(len(body))), ("Connection", "close")])
    chunks: list[bytes] = []
    try:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    except OSError as e:
        out.failure = f"connect {type(e).__name__}"
        return out
    try:
        await start.wait()
        t0 = time.perf_counter()
        writer.write(conn.send(head) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(65536)
                if out.first_byte_ms is None and data:
                    out.first_byte_ms = (time.perf_counter() - t0) * 1000
                conn.receive_data(data)
            elif isinstance(event, h11.Response):
                out.status = event.status_code
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
    except (OSError, h11.ProtocolError) as e:
        out.failure = f"{type(e).__name__}"
        return out
    finally:
        writer.close()
    out.failure = _failure(out, b"".join(chunks))
    return out


def _failure(out: Outcome, raw: bytes) -> str:
    """'' for a whole answer, else '<status> <code>' (the OpenAI error's code, or what was missing)."""
    if out.status != 200:
        try:
            return f"{out.status} {json.loads(raw)['error']['code']}"
        except (ValueError, KeyError, TypeError):
            return f"{out.status}"
    if not out.streamed:
        return ""
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    for e in events:
        if e.startswith(b'{"error"'):
            return f"200 stream error {json.loads(e)['error']['code']}"
    return "" if events[-1:] == [b"[DONE]"] else "200 stream without [DONE]"


async def burst(fleet, n: int, max_tokens: int) -> dict:
    from kvgate.bench.gateway_fleet import cpu_seconds
    from kvgate.bench.queue import percentiles

    pid = fleet.gateway.pid
    rss_before = rss_kib(pid)
    start = asyncio.Event()
    tasks = [asyncio.create_task(_request(fleet.base_url, i, max_tokens, start)) for i in range(n)]
    await asyncio.sleep(2.0)  # every connection is open, and its request at the start line
    cpu_before, client_before, t0 = cpu_seconds(pid), time.process_time(), time.perf_counter()
    with RssSampler(pid) as rss:
        start.set()
        outcomes = await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    cpu_after, client_after = cpu_seconds(pid), time.process_time()
    failures: dict[str, int] = {}
    for o in outcomes:
        if o.failure:
            failures[o.failure] = failures.get(o.failure, 0) + 1

    def ttfb(kept) -> dict | None:
        values = [o.first_byte_ms for o in outcomes if kept(o) and not o.failure and o.first_byte_ms is not None]
        return percentiles(values) if values else None

    return {"requests": n, "streamed": sum(o.streamed for o in outcomes),
            "failures": sum(failures.values()), "failures_by": failures, "elapsed_s": elapsed,
            "first_byte_ms": ttfb(lambda o: True), "first_byte_ms_streamed": ttfb(lambda o: o.streamed),
            "first_byte_ms_whole": ttfb(lambda o: not o.streamed),
            "gateway_rss_mib": {"before": (rss_before or 0) / 1024, "peak": rss.peak_kib / 1024},
            "cpu_ms_per_request": {"gateway": (cpu_after - cpu_before) * 1000 / n if cpu_before is not None else None,
                                   "bench_client": (client_after - client_before) * 1000 / n}}


async def idle_streams(fleet, n: int) -> dict:
    """n streams waiting for a model no worker serves, opened IDLE_WAVE at a time; the RSS they add, per stream."""
    pid = fleet.gateway.pid
    body = {"model": IDLE_MODEL, "messages": [{"role": "user", "content": "wait"}], "max_tokens": 1, "stream": True}
    refused: list[int] = []
    stop = asyncio.Event()

    async def hold(http, ready: asyncio.Event) -> None:
        try:
            async with http.stream("POST", "/chat/completions", json=body) as r:
                if r.status_code != 200:
                    refused.append(r.status_code)
                    return
                async for _ in r.aiter_raw():
                    ready.set()  # the role chunk: the stream is open and waits for its first token
                    break
                await stop.wait()
        finally:
            ready.set()

    async def open_wave(http, size: int) -> list[asyncio.Task]:
        events = [asyncio.Event() for _ in range(size)]
        wave = [asyncio.create_task(hold(http, e)) for e in events]
        await asyncio.gather(*(e.wait() for e in events))
        return wave

    # the first wave warms the stream's code paths up (its fixed cost, a few MiB, is not per stream); the rest
    # is measured against it
    warm = max(1, min(IDLE_WAVE, n // 10))
    async with _client(fleet.base_url) as http:
        rss_before = rss_kib(pid)
        tasks = await open_wave(http, warm)
        await asyncio.sleep(1.0)
        rss_warm, warm_refused = rss_kib(pid), len(refused)
        for start in range(warm, n, IDLE_WAVE):
            tasks += await open_wave(http, min(IDLE_WAVE, n - start))
        await asyncio.sleep(1.0)
        rss_open = rss_kib(pid)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    held, measured = n - len(refused), (n - warm) - (len(refused) - warm_refused)
    return {"streams": n, "open": held, "refused": len(refused), "rss_mib_before": (rss_before or 0) / 1024,
            "rss_mib_warm": (rss_warm or 0) / 1024, "warm_streams": warm, "rss_mib_open": (rss_open or 0) / 1024,
            "rss_kib_per_open_stream": ((rss_open or 0) - (rss_warm or 0)) / measured if measured > 0 else None}


def print_report(report: dict) -> None:
    b, idle = report["burst"], report["idle_streams"]
    print(f"burst {b['requests']} requests ({b['streamed']} streamed) in {b['elapsed_s']:.2f} s: "
          f"{b['failures']} failed {b['failures_by'] or ''}")
    for name in ("first_byte_ms", "first_byte_ms_streamed", "first_byte_ms_whole"):
        p = b[name]
        if p:
            print(f"  {name:<24} p50 {p['p50']:8.1f} ms  p99 {p['p99']:8.1f} ms  (n {p['n']})")
    rss, cpu = b["gateway_rss_mib"], b["cpu_ms_per_request"]
    print(f"  gateway RSS {rss['before']:.1f} MiB before, {rss['peak']:.1f} MiB peak; cpu ms/request: "
          + "  ".join(f"{k} {v:.2f}" for k, v in cpu.items() if v is not None))
    per = idle["rss_kib_per_open_stream"]
    print(f"idle streams: {idle['open']} of {idle['streams']} open ({idle['refused']} refused); gateway RSS "
          f"{idle['rss_mib_before']:.1f} MiB, {idle['rss_mib_warm']:.1f} with the first {idle['warm_streams']}, "
          f"{idle['rss_mib_open']:.1f} with all"
          + (f", {per:.1f} KiB per open stream" if per is not None else ""))
