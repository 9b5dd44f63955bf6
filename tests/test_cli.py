"""The `kvgate` command as users run it, in a subprocess: bad input and unreachable or refusing services get
exactly one line on stderr and a non-zero exit, never a traceback; --debug shows the traceback."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support import free_port

ROOT = Path(__file__).parents[1]
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}


def kvgate(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvgate.commands.cli", *argv], capture_output=True, text=True, cwd=ROOT,
                          env={**CLEAN_ENV, **(env or {})}, timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The single stderr line of a refused command (after asserting it is one line and no traceback)."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0, proc
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    return lines[0]


def dead_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


# ---- the command itself -------------------------------------------------------------------------------------

def test_version_prints_the_installed_version():
    from kvgate import __version__

    proc = kvgate("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"kvgate {__version__}"


def test_help_starts_with_a_one_line_description_of_kvgate():
    from kvgate.commands.cli import DESCRIPTION

    first = kvgate("--help").stdout.split("\n\n")[1]  # after the usage line: the description, wrapped
    assert " ".join(first.split()) == DESCRIPTION and DESCRIPTION.startswith("kvgate: asynchronous LLM inference")
    assert "subcommand" not in DESCRIPTION


def test_an_unknown_flag_is_one_line_pointing_at_help():
    line = one_line_error(kvgate("stats", "--colour"))
    assert "unrecognized arguments: --colour" in line and "kvgate stats --help" in line


# ---- Redis URL, reachability and permissions ----------------------------------------------------------------

@pytest.mark.parametrize("command", ["stats", "top", "exporter", "get", "worker"])
def test_a_url_without_a_scheme_is_refused_in_one_line(command):
    argv = [command, "--redis-url", "localhost:6379"] + (["some-job"] if command == "get" else [])
    line = one_line_error(kvgate(*argv))
    assert "'localhost:6379' must start with redis://" in line


@pytest.mark.parametrize("command", ["stats", "top --once", "submit hello", "get some-job", "cancel some-job"])
def test_an_unreachable_redis_is_one_line_naming_the_url(command):
    url = dead_url()
    line = one_line_error(kvgate(*command.split(), "--redis-url", url))
    assert url in line


def test_every_command_defaults_to_the_same_url_and_honours_the_env_var():
    url = dead_url()
    assert url in one_line_error(kvgate("stats", env={"KVGATE_REDIS_URL": url}))
    assert url in one_line_error(kvgate("top", "--once", env={"KVGATE_REDIS_URL": url}))
    assert url in one_line_error(kvgate("worker", "--simulated", env={"KVGATE_REDIS_URL": url}))
    from kvgate.producer.connection import DEFAULT_URL

    assert f"default {DEFAULT_URL}" in " ".join(kvgate("stats", "--help").stdout.split())


def test_a_database_index_out_of_range_is_one_line(redis_server):
    url = redis_server.url.rsplit("/", 1)[0] + "/999"
    for argv in (["stats"], ["top", "--once"], ["exporter", "--port", "0"]):
        line = one_line_error(kvgate(*argv, "--redis-url", url))
        assert "DB index is out of range" in line and url in line


def test_stats_as_a_user_without_permission_is_one_line_naming_the_acl(acl_server):
    port = acl_server("monitor").connection_pool.connection_kwargs["port"]
    url = f"redis://keda:CHANGE_ME_keda@127.0.0.1:{port}/0"
    line = one_line_error(kvgate("stats", "--redis-url", url))
    assert "refused a command to this user" in line and "acl" in line.lower()
    assert "CHANGE_ME_keda" not in line  # the password is masked
    assert "Traceback" in kvgate("stats", "--redis-url", url, "--debug").stderr


# ---- worker settings --------------------------------------------------------------------------------------

def test_worker_help_documents_every_setting_with_its_default_and_env_var():
    from kvgate.commands.flags import flags_of
    from kvgate.worker.settings import WorkerSettings

    text = " ".join(kvgate("worker", "--help").stdout.split())
    for name, field in WorkerSettings.model_fields.items():
        if name not in ("redis_url", "namespace"):
            assert flags_of(name, field)[0] in text and f"env KVGATE_{name.upper()}; default" in text, name
    assert "--gpu-memory-utilization" in text and "(env KVGATE_GPU_MEMORY_UTILIZATION; default 0.9)" in text


@pytest.mark.parametrize("argv, env, named", [
    (["--max-num-seqs", "0"], {}, "--max-num-seqs '0': input should be greater than or equal to 1"),
    (["--kv-cache-memory", "lots"], {}, "--kv-cache-memory 'lots'"),
    (["--gpu-memory-utilization", "1.5"], {}, "--gpu-memory-utilization '1.5'"),
    ([], {"KVGATE_SCHEDULING": "fast"}, "KVGATE_SCHEDULING='fast': not allowed; allowed values: continuous, static"),
    ([], {"KVGATE_DTYPE": "half"}, "KVGATE_DTYPE='half': not allowed; allowed values: auto, float32, float16"),
    (["--scheduling", "fast"], {}, "--scheduling 'fast': not allowed; allowed values: continuous, static"),
    (["--device", "gpu"], {}, "--device 'gpu': must be auto, cpu, mps, cuda or cuda:N"),
    ([], {"KVGATE_MAX_NUM_SEQS": "many"}, "KVGATE_MAX_NUM_SEQS='many'"),
])
def test_a_bad_worker_setting_from_a_flag_or_env_var_is_one_line_naming_it(argv, env, named):
    proc = kvgate("worker", "--redis-url", dead_url(), *argv, env=env)
    line = one_line_error(proc)
    assert proc.returncode == 2 and named in line, line


def test_an_unknown_model_alias_is_one_line_listing_the_known_ones(redis_server):
    line = one_line_error(kvgate("worker", "--redis-url", redis_server.url, "--model", "smollm3-9b"))
    assert "model 'smollm3-9b' not found" in line and "smollm2-135m" in line


def test_cuda_on_a_cpu_only_torch_is_one_line(redis_server):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch has a GPU")
    line = one_line_error(kvgate("worker", "--redis-url", redis_server.url, "--device", "cuda"))
    assert "device 'cuda' is not available" in line and "--device cpu" in line


def test_a_worker_that_cannot_reach_redis_says_so_with_the_url_and_never_serving():
    url = dead_url()
    proc = kvgate("worker", "--simulated", "--redis-url", url)
    line = one_line_error(proc)
    assert f"cannot use Redis at {url}" in line and "serving" not in proc.stderr


def test_a_worker_says_serving_only_once_connected(redis_server):
    proc = subprocess.Popen([sys.executable, "-m", "kvgate.commands.cli", "worker", "--simulated", "--redis-url",
                             redis_server.url, "--namespace", "cli-serving"], stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=CLEAN_ENV)
    try:
        line = proc.stderr.readline()
        assert f"serving {redis_server.url} namespace cli-serving" in line
        key = "cli-serving:worker:" + line.split()[2].rstrip(":")
        assert any(redis_server.client().exists(key) or time.sleep(0.05) for _ in range(100))
    finally:
        proc.terminate()
        proc.wait(20)


def test_debug_shows_the_traceback():
    proc = kvgate("stats", "--redis-url", dead_url(), "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


# ---- get and cancel ---------------------------------------------------------------------------------------

def test_get_of_an_unknown_job_says_it_has_no_result_and_is_unknown(redis_server):
    line = one_line_error(kvgate("get", "no-such-job", "--redis-url", redis_server.url))
    assert "no result" in line and "job no-such-job: unknown" in line


def test_submit_no_wait_then_get_prints_the_answer_and_cancel_refuses_a_finished_job(redis_server):
    from kvgate.commands.worker import build_engine
    from kvgate.worker.settings import WorkerSettings
    from kvgate.worker.worker import Worker

    submitted = kvgate("submit", "hello", "--no-wait", "--max-tokens", "4", "--redis-url", redis_server.url)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert kvgate("get", job_id, "--redis-url", redis_server.url).returncode == 3  # not finished: no worker yet
    settings = WorkerSettings(redis_url=redis_server.url, simulated=True, sim_step_ms=0, sim_per_token_ms=0)
    worker, stop = Worker(build_engine(settings), settings), threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        for _ in range(100):
            got = kvgate("get", job_id, "--redis-url", redis_server.url, "--json")
            if got.returncode == 0:
                break
        assert got.returncode == 0 and f'"job_id": "{job_id}"' in got.stdout and '"status": "done"' in got.stdout
        line = one_line_error(kvgate("cancel", job_id, "--redis-url", redis_server.url))
        assert "already finished (done)" in line
    finally:
        stop.set()
        thread.join(10)


def test_cancel_sets_the_cancel_flag_of_a_running_job(redis_server):
    proc = kvgate("cancel", "job-123", "--redis-url", redis_server.url)
    assert proc.returncode == 0 and proc.stdout.strip() == "cancellation requested for job job-123"
    assert redis_server.client().get("kvgate:cancel:job-123") == b"1"


def test_help_works_whatever_the_environment_holds():
    assert kvgate("worker", "--help", env={"KVGATE_REDIS_URL": "nonsense", "KVGATE_SCHEDULING": "x"}).returncode == 0


def test_flags_win_over_env_vars_which_win_over_defaults(monkeypatch):
    from kvgate.commands.cli import build_parser
    from kvgate.commands.worker import settings_from

    monkeypatch.setenv("KVGATE_MAX_NUM_SEQS", "12")
    monkeypatch.setenv("KVGATE_BLOCK_SIZE", "32")
    args = build_parser().parse_args(["worker", "--max-num-seqs", "5", "--kv-cache-memory", "2GiB",
                                      "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching"])
    s = settings_from(args)
    assert (s.max_num_seqs, s.block_size, s.seed) == (5, 32, 0)
    assert s.kv_cache_memory == 2 * 2**30 and s.gpu_memory_utilization == 0.5 and s.enable_prefix_caching is False


def test_a_real_worker_takes_its_kv_cache_size_in_units_and_beats_the_engines_capacity(redis_server):
    """`kvgate worker --kv-cache-memory 64MiB` once crashed with a TypeError: the string reached the engine."""
    proc = subprocess.Popen([sys.executable, "-m", "kvgate.commands.cli", "worker", "--model", "random:smollm2-135m",
                             "--device", "cpu", "--kv-cache-memory", "64MiB", "--max-model-len", "256",
                             "--worker-id", "units", "--redis-url", redis_server.url, "--namespace", "cli-units"],
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=CLEAN_ENV)
    try:
        lines = []
        while not (lines and "serving" in lines[-1]):
            lines.append(proc.stderr.readline())
            assert lines[-1], "".join(lines)  # the worker exited before serving
        key = "cli-units:worker:units"
        assert any(redis_server.client().exists(key) or time.sleep(0.05) for _ in range(200))
        beat = redis_server.client().hgetall(key)
        bytes_per_block = 2 * 30 * 3 * 64 * 16 * 4  # k and v, 30 layers, 3 KV heads of 64, 16 tokens, float32
        assert int(beat[b"total_blocks"]) == 64 * 2**20 // bytes_per_block
        assert int(beat[b"max_num_seqs"]) == 256  # the engine's default, the same for LLM() and the worker
    finally:
        proc.terminate()
        proc.wait(30)


def test_submit_many_is_quiet_unless_asked_for_a_progress_bar(redis_server, capsys):
    from kvgate.producer import Client

    with Client(redis_server.url, namespace="quiet") as client:
        client.submit_many([{"prompt": "x", "max_tokens": 1}] * 3)
        assert capsys.readouterr().err == ""
        client.submit_many([{"prompt": "x", "max_tokens": 1}] * 3, progress=True)
        assert "submit" in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", [
    (["bench", "engine", "--device", "gpu"], "--device: 'gpu': must be auto, cpu, mps, cuda or cuda:N"),
    (["bench", "engine", "--dtype", "half"], "--dtype: 'half': allowed values: auto, float32, float16, bfloat16"),
    (["bench", "queue", "--max-num-seqs", "0"], "--max-num-seqs: '0': input should be greater than or equal to 1"),
])
def test_benchmarks_check_the_engine_settings_they_take_as_the_engine_does(argv, named):
    line = one_line_error(kvgate(*argv))
    assert named.lower() in line.lower() and f"see kvgate {argv[0]} {argv[1]} --help" in line
