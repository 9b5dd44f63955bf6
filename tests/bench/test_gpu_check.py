"""The GPU check plan: every check the issue lists, within 9 minutes, each command one the tools accept."""
from __future__ import annotations

from pathlib import Path

from kvgate.bench import gpu_check
from kvgate.commands.cli import build_parser


def test_gpu_check_runs_every_issue_check_within_nine_minutes(tmp_path):
    steps = gpu_check.steps(tmp_path)
    names = [name for name, _, _ in steps]
    assert names == ["pytest-gpu", "graphs", "parity", "kernels", "w-gpu-qwen2.5", "w-gpu-others"]
    assert sum(limit for _, _, limit in steps) <= 9 * 60
    commands = {name: command for name, command, _ in steps}
    assert "-m" in commands["pytest-gpu"] and "gpu" in commands["pytest-gpu"]
    models = [c[i + 1] for name in ("w-gpu-qwen2.5", "w-gpu-others") for c in [commands[name]]
              for i, a in enumerate(c) if a == "--model"]
    assert sorted(models) == sorted(gpu_check.RANDOM_MODELS)


def test_gpu_check_bench_commands_parse_with_the_kvgate_command():
    for name, command, _ in gpu_check.steps(Path("out")):
        if "kvgate.commands.cli" in command:
            args = build_parser().parse_args(command[command.index("kvgate.commands.cli") + 1:])
            assert args.workload == "gpu" and args.json.name.endswith(".json"), name
