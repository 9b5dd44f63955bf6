"""`kvgate bench engine`, scaled down to a tiny model: the JSON has the agreed shape and every contestant produced
exactly the output tokens each request asked for."""
from __future__ import annotations

import json

import pytest
import torch

from kvgate.bench import engine as bench
from kvgate.bench.hf import BenchRequest
from kvgate.commands.cli import main

def test_cpu_workload_scaled_down_gives_every_request_exactly_its_tokens(tiny_model, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "engine", "--model", tiny_model, "--num-requests", "5", "--max-prompt", "24",
                 "--max-output", "7", "--max-num-seqs", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["workload"] == "W-CPU" and report["model"] == tiny_model
    assert {"cpu", "cores", "gpu"} <= report["machine"].keys()
    assert {"torch", "transformers", "triton", "redis_server"} <= report["versions"].keys()
    assert set(report["contestants"]) == set(bench.CONTESTANTS)
    requested = report["contestants"]["kvgate_continuous"]["requested_tokens"]
    assert requested >= 5
    for name, result in report["contestants"].items():
        assert result["requests"] == 5, name
        assert result["requests_with_wrong_length"] == 0, name
        assert result["output_tokens"] == requested, name
        assert result["output_tok_s"] > 0, name
    assert set(report["ratios"]) == {f"kvgate_continuous/{n}" for n in bench.CONTESTANTS[1:]}


def test_gpu_workload_code_path_runs_scaled_down_on_cpu_with_three_rounds_and_the_runs_bound(tiny_model, tmp_path,
                                                                                               capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "engine", "--workload", "gpu", "--device", "cpu", "--dtype", "float32", "--model",
                 tiny_model, "--num-requests", "3", "--max-prompt", "12", "--max-output", "4", "--json", str(out),
                 "--contestants", "kvgate_continuous,hf_static"]) == 0
    report = json.loads(out.read_text())
    assert report["workload"] == "W-GPU" and report["settings"]["output_len"] == [4, 4]
    assert report["settings"]["repeats"] == 3  # W-GPU's own rounds
    entry = report["models"][tiny_model]
    assert set(entry["contestants"]) == {"kvgate_continuous", "hf_static"}
    assert all(r["output_tokens"] == 12 for r in entry["contestants"].values())
    for r in entry["contestants"].values():
        assert len(r["rounds_tok_s"]) == 3 and r["output_tok_s"] == sorted(r["rounds_tok_s"])[1]
    ours = entry["contestants"]["kvgate_continuous"]
    assert entry["bound_tok_s"] == ours["bound_tok_s"] > 0 and entry["binds"] in ("bandwidth", "decode_flops")
    assert entry["fraction_of_bound"] == pytest.approx(ours["output_tok_s"] / ours["bound_tok_s"])
    b = entry["bound"]
    assert b["bound_s"] == pytest.approx(b["prefill_s"] + max(b["weights_s"] + b["kv_s"], b["decode_flop_s"]))
    assert b["decode_steps"] == 3 and b["steps"] >= 4  # 3 more tokens after the first, all three requests at once
    inputs = entry["bound_inputs"]
    assert inputs["copy_bandwidth_gb_s"] > 0 and inputs["peak_source"].startswith("measured")  # a CPU: no datasheet
    assert "bound" not in entry["contestants"]["hf_static"]  # only the engine's own steps are known
    printed = capsys.readouterr().out
    assert "round 1" in printed and "round 3" in printed and "of it, " in printed


def test_repeats_interleave_rounds_and_report_the_median_round_and_engine_steps(tiny_model, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "engine", "--model", tiny_model, "--num-requests", "6", "--max-prompt", "20",
                 "--max-output", "40", "--max-num-seqs", "2", "--repeats", "3", "--json", str(out),
                 "--contestants", "kvgate_continuous,kvgate_static"]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["repeats"] == 3
    results = report["contestants"]
    for result in results.values():
        assert len(result["rounds_tok_s"]) == 3
        assert result["output_tok_s"] == sorted(result["rounds_tok_s"])[1]
    # static waits for each batch's longest request before refilling, so it needs more iterations
    assert results["kvgate_static"]["steps"] > results["kvgate_continuous"]["steps"] > 0
    assert report["step_ratio"] == results["kvgate_static"]["steps"] / results["kvgate_continuous"]["steps"]
    per_round = sorted(c / s for c, s in zip(results["kvgate_continuous"]["rounds_tok_s"],
                                             results["kvgate_static"]["rounds_tok_s"]))
    assert report["ratios"]["kvgate_continuous/kvgate_static"] == pytest.approx(per_round[1])


def test_zero_repeats_are_refused(tiny_model):
    with pytest.raises(SystemExit, match="--repeats 0"):
        main(["bench", "engine", "--model", tiny_model, "--repeats", "0"])


def test_unknown_contestant_is_refused_by_name(tiny_model):
    with pytest.raises(SystemExit, match="vllm"):
        main(["bench", "engine", "--model", tiny_model, "--contestants", "kvgate_continuous,vllm"])


def test_length_caps_scale_the_ranges_down_but_never_up():
    assert bench.capped((100, 1024), 64) == (64, 64)
    assert bench.capped((16, 128), 300) == (16, 128)
    assert bench.capped((8, 256), None) == (8, 256)


def test_prompts_and_lengths_are_the_same_for_every_contestant_and_seeded():
    w = bench.WORKLOADS["cpu"]
    first, again = bench.make_requests(w, 49152, 0), bench.make_requests(w, 49152, 0)
    assert first == again and len(first) == 64
    assert all(16 <= len(r.prompt_ids) <= 128 and 8 <= r.max_tokens <= 256 for r in first)
    assert bench.make_requests(w, 49152, 1) != first


def test_model_cost_reads_every_weight_once_a_step_and_counts_flops_of_the_linear_layers_and_attention(tiny_model):
    from kvgate.bench.bound import ModelCost
    from kvgate.engine.loader import resolve_model

    cost = ModelCost.of(resolve_model(tiny_model).config, torch.bfloat16)
    # the tied embedding is the head: read whole every step; 2 layers of q, k, v, o, gate, up, down, 2 norms; a norm
    assert cost.weight_bytes == (256 * 64 + 2 * (4 * 64 * 16 * 2 + 2 * 64 * 16 * 2 + 3 * 64 * 128 + 2 * 64) + 64) * 2
    assert cost.layer_linear_params == 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)  # 2 KV heads of 16
    assert cost.head_params == 256 * 64
    assert cost.attention_flops_per_position == 4 * 2 * 4 * 16
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 KV heads of 16, bf16


def test_the_trace_of_a_real_run_holds_every_prompt_token_and_every_later_output_token(tiny_model):
    """What kvgate's contestants record: each prompt token once as prefill, each output token after a request's
    first as one decode token at its own context."""
    from dataclasses import replace

    from kvgate.bench.bound import StepTrace
    from kvgate.engine.loader import resolve_model

    requests = [BenchRequest(list(range(1, 6 + 3 * i)), 2 + 2 * i) for i in range(3)]
    m = bench.ModelRun(resolve_model(tiny_model), requests, replace(bench.WORKLOADS["cpu"], max_num_seqs=3),
                       torch.device("cpu"))
    result = bench.run_kvgate(m, "continuous")
    trace: StepTrace = result.trace
    assert sum(s.prefill_tokens for s in trace.steps) == sum(len(r.prompt_ids) for r in requests)
    assert sum(s.prefill_sampled for s in trace.steps) == 3
    assert sum(s.decode_seqs for s in trace.steps) == sum(r.max_tokens - 1 for r in requests)
    # request i decodes at contexts prompt + 1 .. prompt + max_tokens - 1
    assert sum(s.decode_context for s in trace.steps) == sum(
        sum(range(len(r.prompt_ids) + 1, len(r.prompt_ids) + r.max_tokens)) for r in requests)
    assert [s.decode_seqs for s in trace.steps if s.decode_seqs] == [3, 2, 2, 1, 1]  # shrinks as each finishes


def test_hf_static_on_gpu_workload_halves_its_batch_until_it_fits(tiny_model, monkeypatch):
    from dataclasses import replace

    from kvgate.bench import hf as bench_hf
    from kvgate.engine.loader import resolve_model

    tried = []

    def fits_only_two(model, requests, batch_size, pad_token_id):
        tried.append(batch_size)
        if batch_size > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return bench_hf.RunResult([[0] * r.max_tokens for r in requests], 1.0)

    monkeypatch.setattr(bench_hf, "hf_static", fits_only_two)
    workload = replace(bench.WORKLOADS["gpu"], max_num_seqs=8, dtype="float32")
    m = bench.ModelRun(resolve_model(tiny_model), [BenchRequest([1, 2, 3], 2)] * 3, workload, torch.device("cpu"))
    result = bench.run_hf_static(m)
    assert tried == [1, 8, 4, 2] and result.notes == "batch 2"


def test_steps_bench_times_every_step_of_each_policy_and_profiles_decode(tiny_model, tmp_path):
    out = tmp_path / "steps.json"
    assert main(["bench", "steps", "--model", tiny_model, "--num-requests", "5", "--max-prompt", "24",
                 "--max-output", "7", "--max-num-seqs", "2", "--profile", "2", "--json", str(out)]) == 0
    entry = json.loads(out.read_text())["models"][tiny_model]
    assert set(entry) == {"continuous", "static", "profile"}
    for policy in ("continuous", "static"):
        r = entry[policy]
        assert r["prefill_or_mixed"]["steps"] + r["decode"]["steps"] == r["steps"] >= 7
        assert r["seconds"] == pytest.approx(r["prefill_or_mixed"]["seconds"] + r["decode"]["seconds"])
        assert 1 <= r["decode"]["mean_seqs"] <= 2 and set(r["decode"]["mean_ms_by_seqs"]) == {"4"}
    assert entry["continuous"]["steps"] <= entry["static"]["steps"]  # refills never wait for a whole batch
    assert "Self CPU" in entry["profile"]
