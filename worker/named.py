"""A pipeline whose replies come back by the names their commands were queued under, so no party takes a reply by
its place among others."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Named:
    """`named.on(name)` is the pipeline to queue that one command on; `execute` the replies as a dict by name."""

    pipe: Any
    names: list = field(default_factory=list)

    def on(self, name) -> Any:
        self.names.append(name)
        return self.pipe

    def execute(self, **kwargs) -> dict:
        replies = self.pipe.execute(**kwargs)
        if len(replies) != len(self.names) or len(set(self.names)) != len(self.names):
            raise RuntimeError(f"{len(replies)} replies for names {self.names}: queue one command per name, each once")
        return dict(zip(self.names, replies))
