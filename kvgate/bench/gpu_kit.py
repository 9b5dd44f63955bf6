"""`make gpu-kit`: the wheels a bare GPU image lacks, for the offline GPU check (`make gpu-check`), resolved from the
project's own requirements on a machine with PyPI; and `make gpu-rehearsal`'s stand-in for that image on a CPU.

The image is described once, in deploy/gpu-image.txt: what it has (pinned where known) and what it lacks. The kit is
pyproject's base and `worker` requirements plus the test runner's, resolved for the image's Python and platform with
the image's pins as constraints (so what is resolved works beside them), less what the image has and whatever only
the image's packages need (torch's CUDA wheels, numba's llvmlite): a package is in the kit when a requirement of
ours reaches it without passing through one of the image's. Wheels only, cp312 manylinux x86-64, into KIT/wheels;
KIT/requirements.txt says which and why. Nothing here runs on the GPU machine: there `make gpu-check` installs the
wheels with `pip --no-index --target KIT/site` and puts that folder on PYTHONPATH.

    python -m kvgate.bench.gpu_kit kit .gpu-kit             # needs PyPI and uv (the dev extra)
    python -m kvgate.bench.gpu_kit image .gpu-rehearsal/image   # a Python 3.12 venv pinned like the image"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
IMAGE_FILE = ROOT / "deploy" / "gpu-image.txt"
PYTHON_VERSION = "3.12"
# The image's C library: a wheel built for it or older installs (Python 3.12.3 is Ubuntu 24.04's, glibc 2.39;
# 2.35 keeps a 22.04-based image in reach). llguidance's wheels need 2.31.
GLIBC_MINOR = 35
PLATFORMS = (*(f"manylinux_2_{m}_x86_64" for m in range(GLIBC_MINOR, 16, -1)), "manylinux2014_x86_64")
EXTRAS = ("worker",)
TEST_NEEDS = ("pytest", "pytest-timeout")  # from the dev extra: what the four GPU test files run under


def name_of(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[@]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def image() -> tuple[list[str], list[str], list[str]]:
    """deploy/gpu-image.txt: (requirements it has, packages it lacks, older versions it holds) - the last two only
    shape the rehearsal's stand-in."""
    has, lacks, older = [], [], []
    for line in IMAGE_FILE.read_text().splitlines():
        if line.startswith("# lacks:"):  # comments to pip, so that pip install -r takes the file as it is
            lacks += line.removeprefix("# lacks:").split()
        elif line.startswith("# older:"):
            older += line.removeprefix("# older:").split()
        elif line.split("#", 1)[0].strip():
            has.append(line.split("#", 1)[0].strip())
    return has, lacks, older


def requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for extra in EXTRAS for r in project["optional-dependencies"][extra]]
    tests = [r for r in project["optional-dependencies"]["dev"] if name_of(r) in TEST_NEEDS]
    return list(dict.fromkeys(project["dependencies"] + extras + tests))


def resolve(work: Path) -> dict[str, tuple[str, set[str]]]:
    """name -> (pinned requirement, the names that require it; '-r' for ours) for the image's Python and platform."""
    has, _, _ = image()
    (work / "requirements.in").write_text("\n".join(requirements()) + "\n")
    (work / "image.txt").write_text("\n".join(has) + "\n")
    uv = shutil.which("uv", path=os.path.dirname(sys.executable)) or shutil.which("uv")
    if uv is None:
        raise SystemExit("gpu-kit: uv not found; install the dev extra (make install)")
    done = subprocess.run([uv, "pip", "compile", str(work / "requirements.in"), "-c", str(work / "image.txt"),
                           "--python-version", PYTHON_VERSION, "--python-platform", f"x86_64-manylinux_2_{GLIBC_MINOR}",
                           "--annotation-style", "line", "--no-header"], capture_output=True, text=True,
                          env={**os.environ, "UV_PYTHON_DOWNLOADS": "never"})
    if done.returncode != 0:
        raise SystemExit(f"gpu-kit: uv could not resolve the requirements:\n{done.stderr}")
    resolved = {}
    for line in done.stdout.splitlines():
        pin, _, via = line.partition("# via")
        if pin.strip():
            vias = {"-r" if v.strip().startswith("-r") else name_of(v) for v in via.split(",") if v.strip()}
            resolved[name_of(pin)] = (pin.strip(), vias - {"-c"})
    return resolved


def kit_of(resolved: dict[str, tuple[str, set[str]]], image_names: set[str]) -> list[str]:
    """The resolved packages our requirements reach without passing through one of the image's."""
    kit: set[str] = set()
    grew = True
    while grew:
        grew = False
        for name, (_, via) in resolved.items():
            if name not in kit and name not in image_names and ("-r" in via or via & kit):
                kit.add(name)
                grew = True
    return sorted(resolved[n][0] for n in kit)


def build_kit(folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    wheels = folder / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir()
    resolved = resolve(folder)
    has, _, _ = image()
    pins = kit_of(resolved, {name_of(r) for r in has})
    (folder / "requirements.txt").write_text(
        "# make gpu-kit: what the GPU image lacks of pyproject's requirements (resolved beside its pins)\n"
        + "\n".join(f"{p}  # via {', '.join(sorted(resolved[name_of(p)][1]))}" for p in pins) + "\n")
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                           "--python-version", PYTHON_VERSION, "--implementation", "cp", *platforms,
                           "--abi", "cp312", "--abi", "abi3", "--abi", "none",
                           "--dest", str(wheels), *pins])
    if done.returncode != 0:
        return done.returncode
    got = sorted(p.name for p in wheels.glob("*.whl"))
    size = sum(p.stat().st_size for p in wheels.glob("*.whl")) / 2**20
    print(f"gpu-kit: {len(got)} wheels ({size:.1f} MiB) in {wheels}:\n  " + "\n  ".join(got))
    return 0 if len(got) == len(pins) else 1


def build_image(folder: Path, python: str) -> int:
    """A Python 3.12 venv holding what the GPU image holds (a CPU machine's stand-in), without what it lacks."""
    has, lacks, older = image()
    uv = shutil.which("uv", path=os.path.dirname(sys.executable)) or shutil.which("uv")
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    steps = [[uv, "venv", "-q", "--allow-existing", "-p", python, str(folder)],
             # compiled as pip would: a process that may not write bytecode (PYTHONDONTWRITEBYTECODE) would
             # otherwise compile torch and transformers from source at every start (~25 s each here)
             [uv, "pip", "install", "-q", "--compile-bytecode", "-p", str(folder / "bin" / "python"), "pip", *has,
              *older]]
    for step in steps:
        if subprocess.run(step, env=env).returncode != 0:
            return 1
    present = [p for p in lacks if subprocess.run([uv, "pip", "show", "-q", "-p", str(folder / "bin" / "python"), p],
                                                  capture_output=True, env=env).returncode == 0]
    if present:
        subprocess.run([uv, "pip", "uninstall", "-q", "-p", str(folder / "bin" / "python"), *present], env=env)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-kit", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("kit", "image"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--python", default=f"python{PYTHON_VERSION}", help="image: the interpreter of the venv")
    args = parser.parse_args(argv)
    return build_kit(args.folder) if args.what == "kit" else build_image(args.folder, args.python)


if __name__ == "__main__":
    sys.exit(main())
