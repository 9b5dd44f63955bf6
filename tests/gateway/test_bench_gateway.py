"""`kvgate bench gateway` end to end at a tiny size: the report holds every figure it promises."""
from __future__ import annotations

import argparse
import json

from kvgate.bench import gateway as bench
from kvgate.commands.cli import add_connection_arguments


def run_bench(redis_server, out, *argv: str) -> dict:
    """`kvgate bench gateway` with these flags, its JSON report written to `out` and returned."""
    parser = argparse.ArgumentParser()
    add_connection_arguments(parser)
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--redis-url", redis_server.url, *argv, "--json", str(out)])) == 0
    return json.loads(out.read_text())


def test_bench_gateway_reports_added_latency_first_event_delay_and_requests_per_s(redis_server, tmp_path):
    report = run_bench(redis_server, tmp_path / "gw.json", "--probes", "6", "--concurrency", "1,4", "--duration", "0.5")
    seq = report["sequential"]
    assert set(seq["latency_ms"]) == {"sdk", "gateway_http", "gateway", "stream_first_event", "stream_first_token", "stream_done"}
    assert all(p["n"] == 6 and 0 < p["p50"] <= p["p99"] for p in seq["latency_ms"].values())
    first = seq["latency_ms"]
    assert first["stream_first_event"]["p50"] <= first["stream_done"]["p50"]
    assert seq["added_latency_ms"]["n"] == seq["added_with_openai_client_ms"]["n"] == 6
    assert [level["clients"] for level in report["concurrent"]] == [1, 4]
    for level in report["concurrent"]:
        for path in ("sdk", "gateway"):
            assert level[path]["requests"] > 0 and level[path]["requests_per_s"] > 0
        assert level["gateway"]["cpu_ms_per_request"]["gateway"] > 0  # the gateway process did the work


def test_bench_gateway_burst_reports_failures_first_byte_times_memory_per_stream_and_cpu(redis_server, tmp_path):
    report = run_bench(redis_server, tmp_path / "burst.json", "--burst", "40", "--burst-max-tokens", "2")
    assert report["workload"] == "W-BURST" and report["settings"]["burst"] == 40
    burst = report["burst"]
    assert (burst["requests"], burst["streamed"], burst["failures"], burst["failures_by"]) == (40, 20, 0, {})
    for name, n in (("first_byte_ms", 40), ("first_byte_ms_streamed", 20), ("first_byte_ms_whole", 20)):
        assert burst[name]["n"] == n and 0 < burst[name]["p50"] <= burst[name]["p99"]
    assert 0 < burst["gateway_rss_mib"]["before"] <= burst["gateway_rss_mib"]["peak"]
    assert burst["cpu_ms_per_request"]["gateway"] > 0
    idle = report["idle_streams"]
    assert (idle["streams"], idle["open"], idle["refused"]) == (20, 20, 0)
    assert idle["rss_mib_open"] > 0 and idle["rss_kib_per_open_stream"] is not None


def test_burst_defaults_to_2000_requests_and_leaves_w_gateway_alone():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args(["--burst"]).burst == 2000
    assert parser.parse_args([]).burst is None
