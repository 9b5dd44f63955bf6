"""How an embedding request turns its prompt's final hidden states into one vector: the pooling, whether the
vector is scaled to unit length, and how many of its leading dimensions are kept. Torch-free: the engine's
scheduler and the worker hold these; engine/pooler.py computes them.

An embedding request is a prefill with no output: it takes KV blocks only while its prompt is computed (chunk by
chunk, as any prompt), never reads or fills the prefix cache (a mean needs every token's hidden state, so none may be
skipped, and a one-off document must not evict the prefixes generation jobs share), and it finishes in the step that
computes its last prompt token."""
from __future__ import annotations

from dataclasses import dataclass

POOLINGS = ("model", "last", "mean", "cls")  # model: the model's own choice (sentence-transformers' config), else last


@dataclass(slots=True, frozen=True)
class PoolingParams:
    pooling: str = "model"
    normalize: bool = True
    # keep the first `dimensions` values (then scale to unit length again when normalizing). Allowed for any model:
    # a model trained with Matryoshka loss keeps its quality there; for others it is the caller's choice
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling={self.pooling!r} must be one of {', '.join(POOLINGS)}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize={self.normalize!r} must be true or false")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions={self.dimensions!r} must be a positive integer or None (every dimension)")

    def resolved(self, model_pooling: str) -> "PoolingParams":
        """These settings with `model` replaced by the model's own pooling."""
        if self.pooling != "model":
            return self
        return PoolingParams(model_pooling, self.normalize, self.dimensions)
