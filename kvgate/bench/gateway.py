"""`kvgate bench gateway`: what the HTTP gateway adds over the SDK, with the simulated engine behind both.

One `kvgate worker --simulated` and one `kvgate serve` run as subprocesses on one Redis. Sequential
one-token jobs go in turn through the SDK, through the gateway with a bare keep-alive HTTP client, and
through the gateway with the official openai client (whole answers, and streamed chats timed to their first
SSE event), so drift on a shared machine hits all alike. The latency the gateway adds is the bare HTTP
time minus the SDK's, pair by pair; the openai client's own parsing and validation (several hundred
microseconds of client CPU) is reported beside it, since a user of that client pays it too. Then C
concurrent clients send one-token jobs for a fixed time, through each path, for requests per second.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from pathlib import Path

from kvgate.bench.gateway_fleet import Fleet, cpu_seconds

PROMPT_IDS = list(range(1, 17))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--probes", type=int, default=200, help="sequential one-token jobs through each path")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated numbers of concurrent clients")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds each concurrency level runs per path")
    parser.add_argument("--sim-step-ms", type=float, default=1.0, help="the simulated engine's step time")
    parser.add_argument("--port", type=int, default=0, help="gateway port (default: a free one)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--burst", type=int, nargs="?", const=2000, metavar="N",
                        help="W-BURST instead (kvgate/bench/burst.py): N simultaneous requests, half streamed "
                             "(N default 2000)")
    parser.add_argument("--burst-max-tokens", type=int, default=8, help="tokens of each W-BURST answer")


def run(args: argparse.Namespace) -> int:
    if args.burst is not None:
        from kvgate.bench import burst

        return burst.run(args)
    import openai

    from kvgate.bench.queue import environment, redis_for, server_version
    from kvgate.producer import Client

    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    report = {"workload": "W-GATEWAY", "settings": {"probes": args.probes, "concurrency": levels,
                                                    "duration_s": args.duration, "sim_step_ms": args.sim_step_ms},
              **environment(args)}
    print(f"workload W-GATEWAY  settings {report['settings']}")
    with redis_for(args) as url:
        report["versions"]["redis_server"] = server_version(url)
        ns = f"bench-gw-{uuid.uuid4().hex[:8]}"
        with Fleet(url, ns, args) as fleet, Client(url, namespace=ns) as sdk:
            oai = openai.OpenAI(base_url=fleet.base_url, api_key="bench", max_retries=0, timeout=60)
            report["sequential"] = sequential(sdk, oai, args.probes)
            print_sequential(report["sequential"])
            report["concurrent"] = [concurrent(url, ns, fleet, c, args.duration) for c in levels]
            oai.close()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


# ---- one request at a time -----------------------------------------------------------------------
def sequential(sdk, oai, probes: int) -> dict:
    from kvgate.bench.queue import percentiles

    times: dict[str, list[float]] = {k: [] for k in ("sdk", "gateway_http", "gateway", "stream_first_event",
                                                     "stream_first_token", "stream_done")}
    http = BareHttp(oai.base_url)
    clients = {"sdk": sdk, "gateway_http": http, "gateway": oai, "stream": oai}
    paths = [("sdk", _sdk_once), ("gateway_http", _http_once), ("gateway", _gateway_once), ("stream", _stream_once)]
    for i in range(probes + 5):  # the first 5 rounds warm connections and code paths up, and are dropped
        for name, once in paths if i % 2 else paths[::-1]:  # alternate the order: no path always goes first
            measured = once(clients[name])
            if i >= 5:
                for key, ms in measured.items():
                    times[key].append(ms)
    http.close()
    added = [g - s for g, s in zip(times["gateway_http"], times["sdk"])]
    with_openai = [g - s for g, s in zip(times["gateway"], times["sdk"])]
    return {"latency_ms": {k: percentiles(v) for k, v in times.items()}, "added_latency_ms": percentiles(added),
            "added_with_openai_client_ms": percentiles(with_openai)}


class BareHttp:
    """One keep-alive connection and no client library: what is left is the gateway's own time."""

    def __init__(self, base_url) -> None:
        import http.client
        from urllib.parse import urlsplit

        parts = urlsplit(str(base_url))
        self.prefix = parts.path.rstrip("/")
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)

    def post(self, path: str, body: dict) -> dict:
        self.conn.request("POST", self.prefix + path, json.dumps(body),
                          {"Content-Type": "application/json", "Authorization": "Bearer bench"})
        response = self.conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"gateway answered {response.status}: {data[:200]!r}")
        return json.loads(data)

    def close(self) -> None:
        self.conn.close()


def _sdk_once(sdk) -> dict[str, float]:
    start = time.perf_counter()
    result = sdk.submit(prompt_token_ids=PROMPT_IDS, max_tokens=1, temperature=0.0, ignore_eos=True).result(60)
    assert result.status == "done", result
    return {"sdk": (time.perf_counter() - start) * 1000}


def _http_once(http: BareHttp) -> dict[str, float]:
    start = time.perf_counter()
    out = http.post("/completions", {"model": "simulated", "prompt": PROMPT_IDS, "max_tokens": 1, "temperature": 0})
    assert out["usage"]["completion_tokens"] == 1, out
    return {"gateway_http": (time.perf_counter() - start) * 1000}


def _gateway_once(oai) -> dict[str, float]:
    start = time.perf_counter()
    out = oai.completions.create(model="simulated", prompt=PROMPT_IDS, max_tokens=1, temperature=0)
    assert out.usage.completion_tokens == 1, out
    return {"gateway": (time.perf_counter() - start) * 1000}


def _stream_once(oai) -> dict[str, float]:
    start = time.perf_counter()
    first_event = first_token = None
    for chunk in oai.chat.completions.create(model="simulated", max_tokens=1, temperature=0, stream=True,
                                             messages=[{"role": "user", "content": "hi"}]):
        now = time.perf_counter()
        first_event = first_event or now
        if first_token is None and chunk.choices and chunk.choices[0].delta.content:
            first_token = now
    done = time.perf_counter()
    return {"stream_first_event": (first_event - start) * 1000, "stream_first_token": (first_token - start) * 1000,
            "stream_done": (done - start) * 1000}


def print_sequential(seq: dict) -> None:
    for name, p in seq["latency_ms"].items():
        print(f"sequential {name:<19} p50 {p['p50']:7.2f} ms  p99 {p['p99']:7.2f} ms")
    p = seq["added_latency_ms"]
    print(f"added by the gateway           p50 {p['p50']:7.2f} ms  p99 {p['p99']:7.2f} ms  (bare HTTP - SDK, paired)")
    p = seq["added_with_openai_client_ms"]
    print(f"  with the openai client       p50 {p['p50']:7.2f} ms  p99 {p['p99']:7.2f} ms  (openai client - SDK)")


# ---- concurrent clients --------------------------------------------------------------------------
def concurrent(url: str, ns: str, fleet: Fleet, clients: int, duration: float) -> dict:
    """Both paths at one concurrency, with the CPU each process spent per request: on a small machine the
    clients, the gateway, the worker and Redis share the cores, and this says who spent them."""
    out = {"clients": clients}
    for name, load in (("sdk", lambda: _through_sdk(url, ns, clients, duration)),
                       ("gateway", lambda: _through_gateway(fleet.base_url, clients, duration))):
        before = {"bench_client": time.process_time(), "gateway": cpu_seconds(fleet.gateway.pid)}
        r = out[name] = asyncio.run(load())
        after = {"bench_client": time.process_time(), "gateway": cpu_seconds(fleet.gateway.pid)}
        r["cpu_ms_per_request"] = {k: (after[k] - before[k]) * 1000 / max(1, r["requests"])
                                   for k in before if before[k] is not None and after[k] is not None}
        cpu = "  ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_request"].items())
        print(f"{clients:3d} clients {name:<8} {r['requests_per_s']:8.1f} req/s  p50 {r['latency_ms']['p50']:7.2f} ms"
              f"  p99 {r['latency_ms']['p99']:7.2f} ms  cpu ms/request: {cpu}")
    return out


async def _through_sdk(url: str, ns: str, clients: int, duration: float) -> dict:
    from kvgate.gateway.app import close_client
    from kvgate.producer import AsyncClient

    sdk = await AsyncClient(url, namespace=ns).start()

    async def once() -> None:
        handle = await sdk.submit(prompt_token_ids=PROMPT_IDS, max_tokens=1, temperature=0.0, ignore_eos=True)
        assert (await handle.result(60)).status == "done"

    try:
        return await _load(once, clients, duration)
    finally:
        await close_client(sdk)


async def _through_gateway(base_url: str, clients: int, duration: float) -> dict:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=60) as oai:
        async def once() -> None:
            await oai.completions.create(model="simulated", prompt=PROMPT_IDS, max_tokens=1, temperature=0)

        return await _load(once, clients, duration)


async def _load(once, clients: int, duration: float) -> dict:
    from kvgate.bench.queue import percentiles

    latencies: list[float] = []
    start = time.perf_counter()
    stop_at = start + duration

    async def client() -> None:
        while time.perf_counter() < stop_at:
            t = time.perf_counter()
            await once()
            latencies.append((time.perf_counter() - t) * 1000)

    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.perf_counter() - start
    return {"requests": len(latencies), "elapsed_s": elapsed, "requests_per_s": len(latencies) / elapsed,
            "latency_ms": percentiles(latencies)}
