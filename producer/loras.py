"""The fleet's LoRA adapters (`{ns}:loras`): name -> where its PEFT folder is and its base model.

An adapter is served like a model of its own: its jobs go on its own streams `{ns}:jobs:<adapter>:<priority>` (a
request's `model` is the adapter's name, as OpenAI clients send it), read by the workers of its base model, so the
backlog of each adapter stays visible and its jobs gather where it is loaded. Registering one also makes its name
known (`{ns}:models`, model_set.py): the gateway accepts it and stats count its backlog; removing it forgets both, and
the workers answer the jobs still waiting for it with an error result. `kvgate loras`, the clients' `add_lora`,
`loras` and `remove_lora`, workers' `--lora NAME=PATH` and the gateway's /v1/load_lora_adapter all write here.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import FieldError, InvalidRequest
from .job_checks import ProtocolError, check_model_name
from .keys import Keys, as_text, lora_entry, lora_removed_entry, parse_lora_entry
from .model_set import add_models
from .steps import Steps, call

MAX_LORA_PATH_CHARS = 4096


@dataclass(slots=True, frozen=True)
class Lora:
    name: str
    path: str  # the adapter's PEFT folder (adapter_config.json + adapter_model.safetensors), on the workers' disks
    base: str  # the base model's name: the workers serving it load the adapter


def check_lora(name: object, path: object, base: object) -> Lora:
    """The adapter as registered, or InvalidRequest naming the field, the value and the rule."""
    errors = []
    for field, value in (("name", name), ("base", base)):
        try:
            check_model_name(value)
        except ProtocolError as e:
            errors.append(FieldError(field, value, str(e)))
    if not isinstance(path, str) or not 0 < len(path) <= MAX_LORA_PATH_CHARS or not path.isprintable():
        errors.append(FieldError("path", path, f"an adapter's path must be 1 to {MAX_LORA_PATH_CHARS} printable "
                                               "characters: its PEFT folder on the workers' file system"))
    if not errors and name == base:
        errors.append(FieldError("name", name, "an adapter's name must differ from its base model's"))
    if errors:
        raise InvalidRequest(errors)
    return Lora(name, path, base)


def add_lora(r, keys: Keys, name: str, path: str, base: str) -> Steps:
    """Register (or re-point) an adapter fleet-wide; whether it was new."""
    lora = check_lora(name, path, base)
    had = yield from get_lora(r, keys, lora.name)
    yield from add_models(r, keys, [lora.name])
    yield call(r.hset, keys.loras(), lora.name, lora_entry(lora.path, lora.base))
    return had is None


def list_loras(r, keys: Keys) -> Steps:
    """Every registered adapter, by name (entries that are not an adapter's, written by hand, are left out)."""
    raw = yield call(r.hgetall, keys.loras())
    loras = (_lora_of(as_text(name), value) for name, value in raw.items())
    return {lora.name: lora for lora in sorted(filter(None, loras), key=lambda lora: lora.name)}


def get_lora(r, keys: Keys, name: str) -> Steps:
    """One registered adapter, or None."""
    return _lora_of(name, (yield call(r.hget, keys.loras(), name)))


def remove_lora(r, keys: Keys, name: str) -> Steps:
    """Unregister an adapter and forget its name; whether it was registered. Its entry becomes a tombstone
    (`lora_removed_entry`): the workers of its base answer the jobs still waiting for it with an error result,
    also those of a base no worker serves yet."""
    lora = yield from get_lora(r, keys, name)
    if lora is None:
        return False
    yield call(r.hset, keys.loras(), name, lora_removed_entry(lora.base))
    yield call(r.srem, keys.models(), name)
    return True


def on_adapters(r, keys: Keys, requests: list, wheres: list[str]) -> Steps:
    """Submit arguments with their `lora=NAME` resolved: such a request's `model` becomes the adapter (its own
    streams, as OpenAI clients name it), or InvalidRequest, before anything is enqueued, naming each request
    (`wheres`: its argument prefix) whose adapter nobody registered or whose `model` is neither the adapter nor its
    base. One read of the registry for all of them; `lora=None` names none, and what is not a dict is left to
    validation."""
    asked = [a.get("lora") if isinstance(a, dict) else None for a in requests]
    named = sorted({name for name in asked if isinstance(name, str)})
    values = (yield call(r.hmget, keys.loras(), named)) if named else []
    found = {name: lora for name, value in zip(named, values) if (lora := _lora_of(name, value)) is not None}
    registered = list((yield from list_loras(r, keys)))[:20] if any(
        name is not None and (not isinstance(name, str) or name not in found) for name in asked) else []
    out, errors = [], []
    for args, name, where in zip(requests, asked, wheres):
        if isinstance(args, dict) and "lora" in args:
            args = {k: v for k, v in args.items() if k != "lora"}
        if name is None:
            out.append(args)
        elif (lora := found.get(name) if isinstance(name, str) else None) is None:
            errors.append(FieldError(f"{where}lora", name, f"no LoRA adapter of that name is registered (registered: "
                                                           f"{registered}); register it first: kvgate loras add NAME "
                                                           "PATH --base MODEL, or Client.add_lora"))
        elif args.get("model") not in (None, lora.name, lora.base):
            errors.append(FieldError(f"{where}model", args["model"], f"lora={lora.name!r} is an adapter of "
                                                                      f"{lora.base!r}: name that model or none"))
        else:
            out.append({**args, "model": lora.name})
    if errors:
        raise InvalidRequest(errors)
    return out


def _lora_of(name: str, value) -> Lora | None:
    """A registry entry as the adapter it registers; None for none, a removed adapter's tombstone or a bad entry."""
    entry = parse_lora_entry(value) if value is not None else None
    return Lora(name, *entry) if entry is not None and entry[0] is not None else None
