"""OpenAI's /v1/embeddings in kvgate's terms, shared by `kvgate serve` and batch files: the body's inputs as embedding
jobs (task embed, one per input), and their results as OpenAI's response body.

`input` is a string, a list of strings, a list of token ids or a list of such lists; token ids are the serving model's
(a client that tokenizes with another model's tokenizer, as LangChain's OpenAIEmbeddings does with tiktoken unless
`check_embedding_ctx_length=False`, sends ids this model reads as other words). `encoding_format` base64 is the
vector's float32 little-endian bytes, as OpenAI sends them (and the `openai` client asks for by default)."""
from __future__ import annotations

import array
import base64
import sys
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvgate.producer import limits
from kvgate.producer.keys import DEFAULT_MODEL
from kvgate.producer.request import MAX_TOKEN_ID
from kvgate.producer.result import Result

EMBEDDINGS = "/v1/embeddings"
MAX_INPUTS = 2048  # OpenAI's limit of inputs per request

Text = Annotated[str, Field(min_length=1, max_length=limits.MAX_PROMPT_CHARS)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]],
                     Field(min_length=1, max_length=limits.MAX_PROMPT_CHARS)]


class BadEmbeddings(ValueError):
    """A body field that cannot be honoured: `param` names it."""

    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        self.param, self.code = param, code
        super().__init__(message)


class EmbeddingsBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    input: Text | TokenIds | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)] | \
        Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
    model: Annotated[str, Field(min_length=1)] = DEFAULT_MODEL
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=limits.MAX_EMBEDDING_DIMENSIONS)] | None = None
    user: str | None = None  # accepted, as OpenAI's; it changes nothing here

    @property
    def inputs(self) -> list[str | list[int]]:
        one = isinstance(self.input, str) or isinstance(self.input[0], int)
        return [self.input] if one else list(self.input)


def parse_body(body: Any) -> EmbeddingsBody:
    """The body as EmbeddingsBody; BadEmbeddings names its first bad field and value."""
    if not isinstance(body, dict):
        raise BadEmbeddings("body", f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return EmbeddingsBody.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err["loc"] if not ("[" in str(p) or str(p) in ("str", "int", "list"))]
        param = ".".join(loc) or "body"
        if err["type"] == "extra_forbidden":
            raise BadEmbeddings(param, f"{param} is not a field of /v1/embeddings that this gateway honours; leave "
                                       "it out", "unsupported_parameter") from None
        if loc[:1] == ["input"]:
            raise BadEmbeddings("input", f"input must be a non-empty string, a list of token ids, or a list of 1 to "
                                         f"{MAX_INPUTS} of either (strings of 1 to {limits.MAX_PROMPT_CHARS} "
                                         f"characters, ids from 0 to {MAX_TOKEN_ID}): {err['msg']}") from None
        shown = repr(err.get("input"))
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise BadEmbeddings(param, f"{param}: {err['msg']} (got {shown})") from None


def submit_args(body: EmbeddingsBody) -> list[dict[str, Any]]:
    """One embedding job's submit arguments per input, in order."""
    common: dict[str, Any] = {"task": "embed", "model": body.model}
    if body.dimensions is not None:
        common["dimensions"] = body.dimensions
    return [{**common, ("prompt" if isinstance(x, str) else "prompt_token_ids"): x} for x in body.inputs]


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    values = array.array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode()


def response_body(body: EmbeddingsBody, results: list[Result], model: str | None = None) -> dict[str, Any]:
    """OpenAI's answer for the done results of the body's inputs, in order; `model`: the serving worker's name."""
    prompt_tokens = sum(r.usage.prompt_tokens for r in results)
    return {"object": "list", "model": model or body.model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(r.embedding or [], body.encoding_format)}
                     for i, r in enumerate(results)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
