"""The torch-free tests (SDK, wire protocol, URLs, gateway) on every Python kvgate claims and on the distribution's
own interpreter, each in a virtual environment of its own that uv makes in seconds from its cache.

`make test` runs everything on .venv's interpreter; this covers the others, where the standard library differs
from release to release (urllib refused multi-host netlocs with bracketed IPv6 from 3.11.12 on, and distributions
patch their builds; asyncio changes between 3.10 and 3.13). Usage, from the repository root:

    .venv/bin/python .ci/test_pythons.py                   # 3.10 3.12 3.13 and /usr/bin/python3
    PYTHONS="3.13 /opt/python3.14/bin/python3" .venv/bin/python .ci/test_pythons.py

Each version is found as pythonX.Y on the PATH or under pyenv's versions folder; a path is taken as it is. A Python
that cannot be found fails the run with what to install, never a silent skip.
"""
from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLAIMED = "3.10 3.12 3.13 /usr/bin/python3"  # 3.11 is .venv's, which `make test` runs
TESTS = ["tests/producer", "tests/gateway", "tests/test_openai_json.py", "tests/reliability/test_sentinel_url.py",
         "tests/reliability/test_sdk_bad_input.py"]
# the SDK and the gateway, without the worker's torch; pytest and the clients the gateway tests drive
REQUIREMENTS = ["-e", ".[gateway,embedded]", "pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "openai>=1.40",
                "httpx>=0.27", "trustme>=1.1"]
PARALLEL = 4  # interpreters at a time: the tests mostly wait on Redis, child processes and timeouts


@dataclass(frozen=True, slots=True)
class Outcome:
    python: str
    version: str
    ok: bool
    seconds: float
    summary: str
    log: Path


def find_python(spec: str) -> Path:
    """`spec` is a path, or a version X.Y looked up as pythonX.Y on the PATH and then under pyenv's versions."""
    if "/" in spec:
        if not os.access(spec, os.X_OK):
            raise SystemExit(f"test_pythons: {spec} is not an executable Python; fix PYTHONS (now {PYTHONS!r})")
        return Path(spec)
    candidates = [shutil.which(f"python{spec}")]
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates += sorted(pyenv_root.glob(f"{spec}.*/bin/python{spec}"), reverse=True)
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "-c", "import sys"], capture_output=True).returncode == 0:  # not a pyenv shim
            return Path(candidate)
    raise SystemExit(f"test_pythons: no Python {spec} found (pythonX.Y on the PATH or under {pyenv_root}); install "
                     f"it (`pyenv install {spec}`, or the distribution's python{spec}) or choose others with "
                     f"PYTHONS=\"3.12 /usr/bin/python3\"")


def run_one(spec: str, uv: Path, home: Path) -> Outcome:
    python = find_python(spec)
    name = spec.strip("/").replace("/", "-")
    venv, log = home / name, home / f"{name}.log"
    env = {**os.environ, "VIRTUAL_ENV": str(venv), "UV_PYTHON_DOWNLOADS": "never"}
    env.pop("PYTHONPATH", None)
    started = time.monotonic()
    with log.open("w") as out:
        steps = [[uv, "venv", "-q", "--allow-existing", "--python", python, venv],
                 [uv, "pip", "install", "-q", *REQUIREMENTS],
                 [venv / "bin" / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]]
        for step in steps:
            out.write(f"$ {' '.join(map(str, step))}\n")
            out.flush()
            if subprocess.run(step, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                break
        else:
            step = None
    version = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                             capture_output=True, text=True).stdout.strip()
    lines = log.read_text().splitlines()
    summary = next((line.strip("= ") for line in reversed(lines) if " in " in line and ("passed" in line or
                    "failed" in line or "error" in line)), lines[-1] if lines else "no output")
    return Outcome(spec, version, step is None, time.monotonic() - started, summary, log)


def main() -> int:
    uv = Path(sys.executable).parent / "uv"
    if not uv.exists():
        raise SystemExit(f"test_pythons: {uv} is missing; `make install` puts uv in .venv (the dev extra)")
    home = ROOT / ".venv-pythons"
    home.mkdir(exist_ok=True)
    specs = PYTHONS.split()
    print(f"torch-free tests on {', '.join(specs)} ({PARALLEL} at a time; logs in {home.relative_to(ROOT)}/)",
          flush=True)
    failed = []
    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        for outcome in pool.map(lambda spec: run_one(spec, uv, home), specs):
            print(f"  {'ok  ' if outcome.ok else 'FAIL'} Python {outcome.version or '?'} ({outcome.python}): "
                  f"{outcome.summary} [{outcome.seconds:.0f} s]", flush=True)
            if not outcome.ok:
                failed.append(outcome)
    for outcome in failed:
        print(f"\n---- the end of {outcome.log.relative_to(ROOT)} ----")
        print("\n".join(outcome.log.read_text().splitlines()[-60:]))
    return 1 if failed else 0


PYTHONS = os.environ.get("PYTHONS", CLAIMED)

if __name__ == "__main__":
    sys.exit(main())
