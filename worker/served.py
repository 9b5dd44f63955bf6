"""Which models a worker serves: the names jobs ask for, whose streams `{ns}:jobs:<name>:<priority>` it reads.

The canonical name is what results report (Final.model) and metrics carry: `served_model_name` where set, else
the engine's own name for what it loaded. Aliases let one worker answer several names for the same weights
(`qwen` and `Qwen/Qwen2.5-0.5B-Instruct`); `default` is the stream of jobs that name no model.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvgate.producer.keys import DEFAULT_MODEL
from kvgate.producer.job_checks import ProtocolError, check_model_name


class ServedModelError(ValueError):
    """A model name the worker cannot serve under; the message says which and what to set."""


@dataclass(slots=True, frozen=True)
class ServedModels:
    canonical: str
    names: tuple[str, ...]  # canonical first, then aliases, then `default`: the order the worker reads them

    @property
    def heartbeat(self) -> str:
        return ",".join(self.names)


def served_models(engine_name: str, served_model_name: str | None, aliases: list[str],
                  serve_default: bool) -> ServedModels:
    canonical = served_model_name or engine_name
    try:
        check_model_name(canonical)
    except ProtocolError as e:
        raise ServedModelError(f"{e}; the engine names its model {engine_name!r}: set --served-model-name "
                               "(KVGATE_SERVED_MODEL_NAME) to a valid name") from None
    names = [canonical, *aliases, *([DEFAULT_MODEL] if serve_default else [])]
    return ServedModels(canonical, tuple(dict.fromkeys(names)))
