"""The model set `{ns}:models`: the names the fleet knows, besides those live workers serve now.

Workers add the names they serve when they start, operators the names they expect (the gateway's `--model` when it
starts, `kvgate models add` at any time, for a model whose autoscaler has never started a worker); a producer's submit
never does. So a typo never becomes a known model (the gateway answers it with a 404 at once), and the set stays as
small as the fleet's real models: stats, backlog reads, the exporter and GET /v1/models read every stream of every
known model, whatever names producers invent. A job for a name nobody added waits in its streams, unread and not
counted, until a worker of that name starts.
"""
from __future__ import annotations

from .keys import DEFAULT_MODEL, Keys, as_text
from .protocol import check_model_name
from .steps import Steps, call

MAX_KNOWN_MODELS = 1_000  # each costs reads of its 3 priorities x (lanes + 1) streams on every stats and backlog read


def known_models(r, keys: Keys) -> Steps:
    """Every model a worker served or an operator added (`{ns}:models`), and `default`, sorted."""
    return sorted({as_text(m) for m in (yield call(r.smembers, keys.models()))} | {DEFAULT_MODEL})


def add_models(r, keys: Keys, names) -> Steps:
    """Make models known before any worker serves them; how many were new. Refuses a bad name and a set that would
    grow past MAX_KNOWN_MODELS, naming the value."""
    names = sorted({check_model_name(n) for n in names})
    if not names:
        return 0
    have = {as_text(m) for m in (yield call(r.smembers, keys.models()))}
    if len(have | set(names)) > MAX_KNOWN_MODELS:
        raise ValueError(f"adding {len(set(names) - have)} models would make {len(have | set(names))} known models, "
                         f"over the limit of {MAX_KNOWN_MODELS}; remove unused ones first (kvgate models remove NAME)")
    return (yield call(r.sadd, keys.models(), *names))


def remove_models(r, keys: Keys, names) -> Steps:
    """Forget models (their streams and jobs stay; a worker that serves one adds it again when it starts); how many
    were known."""
    names = sorted(set(names))
    return (yield call(r.srem, keys.models(), *names)) if names else 0
