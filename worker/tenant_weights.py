"""Tenants' fair-share weights: the one range a weight may take, and the two places one is set (a worker's weights
file, `kvgate worker --tenant-weights`, checked at start; the namespace's `{ns}:tenants` hash, read with every
heartbeat).

The range, 0.001 to 1000 (1: a tenant without a weight), is what the share arithmetic handles exactly:
- Shares of a worker's jobs (fair.Occupancy) divide by the running tenants' weights, a sum of 0.001 at least, so a
  share is (jobs + 1) * 1e6 at most, never inf and never a division by 0. 1e-308 passed the old checks (a positive
  number): 5 / 1e-308 overflowed to inf and math.floor(inf) raised OverflowError in every worker that ran the tenant.
- Virtual token counters rise by a job's tokens over its tenant's weight (the read script, Fair.flush), and the
  band's virtual time, the counter last served, never falls. An increment smaller than the counter's float spacing
  is lost: one token over 1000 still moves a counter up to 2^52 / 1000 (4.5e12 tokens over weights); over 1,000,000
  (the file's old ceiling) a counter stopped moving at 4.5e9, and a tenant whose counter stands still is read first
  for ever.
- The read script already takes a weight below 0.001 as 0.001 (reader.py): the worker's own shares now agree.
A ratio of 1,000,000 between the lightest and heaviest tenant is far past any share an operator can tell apart.
"""
from __future__ import annotations

import math
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package (pyproject's dependencies)
    import tomli as tomllib

from kvgate.producer.keys import as_text
from kvgate.producer.job_checks import ProtocolError, check_tenant_name

MIN_WEIGHT, MAX_WEIGHT = 0.001, 1000.0
MAX_WEIGHTS = 1000  # `{ns}:tenants` entries a worker reads, and tenants a weights file may name
RANGE = f"a number from {MIN_WEIGHT:g} to {MAX_WEIGHT:g}"


def clamp_weight(weight: float) -> float:
    """Any float as a weight the arithmetic handles: outside the range its nearer end, nan 1 (no weight)."""
    return 1.0 if math.isnan(weight) else min(max(weight, MIN_WEIGHT), MAX_WEIGHT)


def check_weight(weight: object) -> str | None:
    """What is wrong with a weight set by an operator (None: nothing)."""
    number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
    if number and MIN_WEIGHT <= weight <= MAX_WEIGHT:
        return None
    return (f"weight {repr(weight)[:40]} must be {RANGE}: set it within that range (1 is the share of a tenant "
            f"with no weight; shares and virtual token counters are exact only within it)")


def read_weights(path: str) -> dict[str, float]:
    """A tenant weights file (`kvgate worker --tenant-weights`): TOML with one table, `[weights]`, of tenant name =
    weight. ValueError names the file and what is wrong in it: a worker must not start on weights it cannot keep."""
    where = f"tenant weights file {path}"
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"{where}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{where}: not TOML ({e}); it holds one table: [weights] with lines like team-a = 2") from None
    for name in data:
        if name != "weights":
            raise ValueError(f"{where}: unknown table [{name}]: the file has one table, [weights], of tenant = weight")
    table = data.get("weights", {})
    if not isinstance(table, dict):
        raise ValueError(f"{where}: weights must be a table, [weights], of tenant = weight lines")
    if len(table) > MAX_WEIGHTS:
        raise ValueError(f"{where}: {len(table)} tenants; workers read {MAX_WEIGHTS} at most (name only those whose "
                         f"weight is not 1)")
    weights: dict[str, float] = {}
    for tenant, weight in table.items():
        try:
            check_tenant_name(tenant)
        except ProtocolError as e:
            raise ValueError(f"{where}: {e}") from None
        if (problem := check_weight(weight)) is not None:
            raise ValueError(f"{where}: {tenant}: {problem}")
        weights[tenant] = float(weight)
    return weights


def parse_weights(raw: dict) -> tuple[dict[str, float], dict[str, str]]:
    """`{ns}:tenants` -> (the weights that are not 1, each within the range; the entries taken otherwise than they
    read, tenant -> 'value (as weight)'). The hash is the operator's, but a typo there must not stop a worker: a
    number outside the range is clamped to its nearer end (a tiny weight stays the least share there is, a huge one
    the most), and what is no positive finite number (0, -1, inf, nan, 'two') counts as 1, as no weight."""
    weights: dict[str, float] = {}
    odd: dict[str, str] = {}
    for key, value in list((raw or {}).items())[:MAX_WEIGHTS]:
        tenant, text = as_text(key), as_text(value)
        try:
            read = float(text)
        except ValueError:
            read = math.nan
        weight = clamp_weight(read) if math.isfinite(read) and read > 0 else 1.0
        if weight != read:
            odd[tenant] = f"{text[:40]} (as {weight:g})"
        if weight != 1:
            weights[tenant] = weight
    return weights, odd
