"""Limits an issue set that keep holding after it ends: a file's size in lines, a function's length. Each row names
the issue that set it; a change that passes one either stays under it or changes the row on purpose, in review. The
measure is proved on a synthetic source first, so a row that passes is not passing by a wrong count."""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import ROOT


@dataclass(frozen=True, slots=True)
class Limit:
    """At most `most` lines: of the file at `path`, or of its function `function` ("Class.method"), counted from the
    def line through the last line of the body (decorators aside)."""

    issue: int
    path: str
    most: int
    function: str = ""

    def __str__(self) -> str:
        return f"{self.path}{'::' + self.function if self.function else ''} <= {self.most} lines (issue {self.issue})"


# The SDK's modules, each one concept (issue 43 split the wire by concept: protocol, constraints, limits, keys, urls)
PRODUCER_FILES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "producer").rglob("*.py"))

LIMITS = (
    Limit(43, "engine/llm_engine.py", 400),  # the engine's loop reads as nano-vllm's: its parts live in their modules
    Limit(43, "engine/llm_engine.py", 20, "LLMEngine.step"),
    *(Limit(43, path, 450) for path in PRODUCER_FILES),  # every file in producer/, those added later too
    Limit(43, "worker/reader.py", 300),  # the read: each feature's part of its script lives beside its owner
    Limit(43, "worker/worker.py", 400),  # the loop composes parts; a feature's rule lives in its part
)


WORKER_FILES = sorted((ROOT / "worker").rglob("*.py"))
# a reply taken by its place among others: a slice, or counted from the end
POSITIONAL = re.compile(r"\breplies\[(-|[^\]]*:)")
PROBE = re.compile(r"getattr\(\s*getattr\(|getattr\(\s*self\.engine\b")  # an object asked for attributes it may lack
# KEYS or ARGV by a number or by index arithmetic, rather than by the name the inputs give
BY_PLACE = re.compile(r"ARGV\[(?!1\])|#ARGV|#KEYS|KEYS\[[^\]]*[-+*\d][^\]]*\]")


def lines_of(source: str, function: str = "") -> int:
    """`source`'s lines, or its function `function`'s (a dotted path through classes and functions)."""
    if not function:
        return len(source.splitlines())
    scope: list[ast.stmt] = ast.parse(source).body
    node = None
    for name in function.split("."):
        node = next((n for n in scope if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == name), None)
        if node is None:
            raise LookupError(f"{function!r} not found (no {name!r}): fix the limit's row or the name it moved to")
        scope = node.body
    return node.end_lineno - node.lineno + 1


SYNTHETIC = '''\
import x


class Engine:
    @property
    def step(self):
        a = 1

        return a
'''


def test_the_measure_counts_a_files_lines_and_a_function_from_its_def_through_its_body():
    assert lines_of(SYNTHETIC) == 9
    assert lines_of(SYNTHETIC, "Engine.step") == 4  # the decorator is not the function's
    assert lines_of(SYNTHETIC, "Engine") == 6
    with pytest.raises(LookupError, match="'Engine.run' not found"):
        lines_of(SYNTHETIC, "Engine.run")


def test_the_producer_rows_cover_every_module_of_the_sdk():
    assert len(PRODUCER_FILES) > 30 and "producer/protocol.py" in PRODUCER_FILES  # the walk found the folder


@pytest.mark.parametrize("limit", LIMITS, ids=str)
def test_each_limit_an_issue_set_still_holds(limit: Limit):
    n = lines_of(Path(ROOT, limit.path).read_text(), limit.function)
    assert n <= limit.most, (f"{limit} is {n} lines: move a concept of its own into its own module (or a step of a "
                             "long function into a function of its own) rather than raising the limit")


def test_the_read_script_reads_its_inputs_by_name_and_fair_share_lives_in_its_own_module():
    from kvgate.worker.reader import READ_LUA

    assert BY_PLACE.search("local x = ARGV[2]") and BY_PLACE.search("KEYS[total + 2 * j]") and \
        BY_PLACE.search("KEYS[1]") and not BY_PLACE.search("KEYS[stream.key] .. ARGV[1]")  # the measure itself
    assert "cjson.decode(ARGV[1])" in READ_LUA and "-- @" not in READ_LUA  # every feature's part spliced in
    assert BY_PLACE.findall(READ_LUA) == [], "the read script takes an input by its place: name it in ARGV[1]"
    mentions = len(re.findall("fair", Path(ROOT, "worker/reader.py").read_text(), re.IGNORECASE))
    assert mentions <= 5, f"worker/reader.py mentions fair share {mentions} times: its part belongs in worker/fair.py"


@pytest.mark.parametrize("pattern", [POSITIONAL, PROBE], ids=["positional replies", "getattr probes"])
def test_the_worker_takes_replies_by_name_and_asks_no_object_for_attributes_it_may_lack(pattern):
    assert pattern.search("a = replies[-1]" if pattern is POSITIONAL else 'getattr(getattr(e, "t", None), "c")')
    assert len(WORKER_FILES) > 30  # the walk found the folder
    found = [f"{p.relative_to(ROOT)}:{i}" for p in WORKER_FILES
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == [], f"{pattern.pattern!r} at {found}: name the replies (worker/named.py), type the object"
