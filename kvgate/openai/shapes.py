"""A result's choice in OpenAI's two response shapes, logprobs included; shared by `kvgate serve` and
`kvgate batch` so both answer alike.

Chat (choices[i].logprobs):  {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}],
                              "refusal": None}
Completions (legacy):        {"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}
"""
from __future__ import annotations

import json
from typing import Any

from kvgate.producer.quoting import shown
from kvgate.producer.bounded_json import BadJson, parse_json
from kvgate.producer.limits import MAX_LOGPROBS
from kvgate.producer.protocol import TokenLogprob, ToolCall, TopLogprob
from kvgate.producer.result import Result

# JSON has no -inf; a token the model rules out entirely is reported at this floor, as vLLM does
LOGPROB_FLOOR = -9999.0


class BadLogprobs(ValueError):
    def __init__(self, param: str, message: str):
        self.param = param
        super().__init__(message)


def requested_logprobs(chat: bool, body: dict[str, Any]) -> int | None:
    """How many alternatives per token a request body asks for; None: no logprobs. Chat asks with
    `logprobs: true` and `top_logprobs: N`, the legacy completions API with `logprobs: N` (0: the chosen
    token only)."""
    wanted = body.get("logprobs")
    if not chat:
        return None if wanted is None else _count("logprobs", wanted)
    top = body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise BadLogprobs("logprobs", f"logprobs={shown(wanted)} must be true or false (top_logprobs sets how many "
                                      "alternatives)")
    if top is not None:
        _count("top_logprobs", top)
        if top and not wanted:
            raise BadLogprobs("top_logprobs", f"top_logprobs={shown(top)} needs logprobs=true")
    return (top or 0) if wanted else None


def _count(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS:
        raise BadLogprobs(name, f"{name}={shown(value)} must be an integer from 0 to {MAX_LOGPROBS}")
    return value


def logit_bias_of(bias: Any) -> dict[int, Any]:
    """OpenAI's logit_bias as JSON spells it (token ids are an object's keys, so strings) -> token id -> bias; the
    SDK then checks the bounds and names the entry. A ValueError says what is wrong with the shape."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be an object mapping token ids to numbers, got {bias!r:.80}")
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ValueError(f"logit_bias key {key!r:.40} is not a token id (an integer, as a string in JSON)") \
                from None
    return out


def _finite(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN to the floor


def _chat_token(t: TokenLogprob | TopLogprob) -> dict[str, Any]:
    return {"token": t.text, "logprob": _finite(t.logprob), "bytes": list(t.utf8)}


def chat_logprobs(tokens: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if tokens is None:
        return None
    return {"content": [_chat_token(t) | {"top_logprobs": [_chat_token(a) for a in t.top]} for t in tokens],
            "refusal": None}


def completion_logprobs(tokens: list[TokenLogprob] | None, offset: int = 0,
                        prompt: list[TokenLogprob] | None = None) -> dict[str, Any] | None:
    """`offset`: where the first token's text starts in the completion (a stream chunk continues the text).
    As OpenAI documents for the legacy API, each top_logprobs entry also holds the sampled token. `prompt` (echo):
    the prompt's tokens come first, the very first with null logprobs (nothing comes before it to score it)."""
    if tokens is None:
        return None
    tokens = [*(prompt or ()), *tokens]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
    out = {"tokens": [t.text for t in tokens], "token_logprobs": [_finite(t.logprob) for t in tokens],
           "top_logprobs": [{a.text: _finite(a.logprob) for a in t.top} | {t.text: _finite(t.logprob)}
                            for t in tokens],
           "text_offset": offsets}
    if prompt:
        out["token_logprobs"][0] = out["top_logprobs"][0] = None
    return out


def prompt_text(prompt: list[TokenLogprob]) -> str:
    """A prompt's text from its tokens' own bytes (an echoed prompt given as token ids)."""
    return b"".join(t.utf8 for t in prompt).decode("utf-8", errors="replace")


def text_length(tokens: list[TokenLogprob] | None) -> int:
    """How far a stream chunk's tokens move the text offset of the next."""
    return sum(len(t.text) for t in tokens or [])


def tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """A message's calls in OpenAI's shape."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def finish_reason(r: Result) -> str:
    """OpenAI's name for how a job's answer ended: "abort" (stopped early) has none; "stop" is what a client can act
    on; "tool_calls" where the answer made calls and ended by itself."""
    return r.finish_reason if r.finish_reason in ("length", "tool_calls") else "stop"


def choice(chat: bool, index: int, text: str, finish_reason: str | None,
           logprobs: list[TokenLogprob] | None, calls: list[ToolCall] | None = None,
           content: str | None = None) -> dict[str, Any]:
    """One choice of a whole (not streamed) chat.completion or text_completion body; `calls`: the tool calls the
    answer makes, `content` then its text outside them."""
    if chat:
        message = {"role": "assistant", "content": text, "refusal": None}
        if calls:
            message |= {"content": content, "tool_calls": tool_calls(calls)}
        return {"index": index, "message": message, "logprobs": chat_logprobs(logprobs), "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": completion_logprobs(logprobs), "finish_reason": finish_reason}


# ---- structured output: OpenAI's response_format and vLLM's guided_* / structured_outputs --------------------------

STRUCTURED_BODY_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                          "structured_outputs")


class BadStructured(ValueError):
    def __init__(self, param: str, message: str):
        self.param = param
        super().__init__(message)


def _schema_text(param: str, schema: Any) -> str:
    if isinstance(schema, str):  # vLLM takes a schema as JSON text too: parsed within the body's own limits
        try:
            schema = parse_json(schema)
        except BadJson as e:
            raise BadStructured(param, f"{param} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise BadStructured(param, f"{param} must be a JSON schema object, got {type(schema).__name__}")
    return json.dumps(schema)


def _output_format(value: Any, param: str, nested: bool) -> dict[str, Any] | None:
    """OpenAI's output format, as the wire's Structured in dict form: {"type": "text"} (nothing), {"type":
    "json_object"} (any JSON object) or {"type": "json_schema", ...} (its schema; strict or not, the output follows
    it). Chat's `response_format` nests the schema's name and schema under `json_schema` (`nested`); the Responses
    API's `text.format` holds them flat."""
    inner = '"name": ..., "schema": {...}'
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        schema_form = f'"json_schema": {{{inner}}}' if nested else inner
        raise BadStructured(param, f'{param} must be {{"type": "text"}}, {{"type": "json_object"}} or {{"type": '
                                   f'"json_schema", {schema_form}}}')
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return {"kind": "json_object"}
    holder, where = (value.get("json_schema"), f"{param}.json_schema") if nested else (value, param)
    if not isinstance(holder, dict) or "schema" not in holder:
        raise BadStructured(where if nested else f"{param}.schema",
                            f"{param} json_schema needs {'json_schema.schema' if nested else 'schema'}, a JSON schema "
                            "object")
    return {"kind": "json_schema", "spec": _schema_text(f"{where}.schema", holder["schema"])}


def _choice(param: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise BadStructured(param, f"{param} must be a non-empty list of non-empty strings")
    return {"kind": "choice", "choices": value}


def _text(param: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise BadStructured(param, f"{param} must be a non-empty string")
    return value


def _structured_outputs(value: Any) -> dict[str, Any]:
    """vLLM's newer extra body: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} |
    {"json_object": true}, exactly one."""
    param = "structured_outputs"
    known = {"json", "regex", "choice", "grammar", "json_object"}
    if not isinstance(value, dict):
        raise BadStructured(param, f"{param} must be an object with one of {', '.join(sorted(known))}")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = set(given) - known
    if unknown or len(given) != 1:
        raise BadStructured(param, f"{param} must give exactly one of {', '.join(sorted(known))}; got "
                                   f"{', '.join(sorted(given)) or 'none'}")
    (key, item), = given.items()
    where = f"{param}.{key}"
    if key == "json":
        return {"kind": "json_schema", "spec": _schema_text(where, item)}
    if key == "json_object":
        return {"kind": "json_object"}
    if key == "choice":
        return _choice(where, item)
    return {"kind": key, "spec": _text(where, item)}


def structured_of_body(body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The one output constraint a request body asks for, as the wire's Structured in dict form, with the body
    field that asked; None: free text. More than one of the fields is a BadStructured naming them."""
    given = [name for name in STRUCTURED_BODY_FIELDS if body.get(name) is not None]
    made = []
    for name in given:
        value = body[name]
        if name == "response_format":
            got = _output_format(value, name, nested=True)
        elif name == "guided_json":
            got = {"kind": "json_schema", "spec": _schema_text(name, value)}
        elif name == "guided_choice":
            got = _choice(name, value)
        elif name == "structured_outputs":
            got = _structured_outputs(value)
        else:
            got = {"kind": name.removeprefix("guided_"), "spec": _text(name, value)}
        if got is not None:
            made.append((name, got))
    if len(made) > 1:
        raise BadStructured(made[1][0], f"give one output constraint; got {', '.join(n for n, _ in made)}")
    return made[0] if made else None


def structured_of_text_format(value: Any, param: str = "text.format") -> dict[str, Any] | None:
    """The Responses API's `text.format` (_output_format, flat)."""
    return _output_format(value, param, nested=False)
