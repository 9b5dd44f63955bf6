"""A Responses API body (POST /v1/responses) as the chat body it asks for, so it is planned, validated and submitted
by the one chat path (translate.plan): `input` and `instructions` become messages, `max_output_tokens` max_tokens,
`text.format` the structured constraint, `include` logprobs; every sampling field of the wire passes as for chat.

What a Response object repeats back (instructions, max_output_tokens, text, ...) is kept as its `echo`. Every body
field is honoured, accepted only at a value that asks for nothing the engine lacks, or refused with a 400 naming it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kvgate.openai.shapes import BadStructured, structured_of_text_format

from .errors import ApiError, invalid, unsupported
from .translate import DIRECT

LOGPROBS = "message.output_text.logprobs"  # the one `include` the engine can answer
ROLES = ("user", "assistant", "system", "developer")
PART_TYPES = ("input_text", "output_text")  # text parts; an assistant's output_text comes back as input
# keys of an earlier output item or part sent back as input: what it was, not something asked for
ITEM_KEYS = {"type", "role", "content", "id", "status", "phase"}
PART_KEYS = {"type", "text", "annotations", "logprobs"}

NO_OP: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (lambda v: v in (None, []), " on /v1/responses (no tool calling yet)"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), " (no tools to call)"),
    "parallel_tool_calls": (lambda v: v is None or isinstance(v, bool), ""),
    "max_tool_calls": (lambda v: v is None, " (no tools to call)"),
    "truncation": (lambda v: v in (None, "disabled"), " (a conversation over the model's length is refused, "
                                                      "never truncated)"),
    "reasoning": (lambda v: v is None or (isinstance(v, dict) and not any(v.values())), " (no reasoning models)"),
    "service_tier": (lambda v: v in (None, "auto", "default"), ""),
    "stream_options": (lambda v: v in (None, {}) or v == {"include_obfuscation": False}, " (no obfuscation)"),
    "prompt_cache_retention": (lambda v: v in (None, "in_memory"), " (the workers' prefix cache is in memory)"),
}
OWN = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "stream", "background",
       "store", "previous_response_id", "metadata", "user", "safety_identifier", "prompt_cache_key", "top_logprobs",
       "include"}
FIELDS = OWN | NO_OP.keys() | DIRECT.keys()
# chat plan's parameter -> the Responses field it came from, for the errors plan raises
RENAMED = {"messages": "input", "max_tokens": "max_output_tokens", "structured": "text.format",
           "logprobs": "include", "stream_options": "stream_options"}


@dataclass(slots=True)
class Asked:
    """A Responses request taken apart: the chat body to plan, the conversation it continues or starts (without
    `instructions`, which previous_response_id does not carry over, as OpenAI's), and what the Response repeats."""

    chat: dict[str, Any]
    conversation: list[dict[str, str]]
    echo: dict[str, Any] = field(default_factory=dict)
    background: bool = False
    store: bool = True
    inputs: int = 0  # the conversation's last `inputs` messages are this request's `input`


def take(body: Any, earlier: list[dict[str, str]] | None = None) -> Asked:
    """`earlier`: the conversation of previous_response_id, its answer last (the caller looked it up)."""
    if not isinstance(body, dict):
        raise invalid("body", "the request body must be a JSON object")
    for name, value in body.items():
        if name not in FIELDS:
            raise unsupported(name, value, " on /v1/responses")
        if name in NO_OP and not NO_OP[name][0](value):
            raise unsupported(name, value, NO_OP[name][1])
    background, store = _flag(body, "background", False), _flag(body, "store", True)
    if background and not store:
        raise invalid("store", "background=true needs store=true: a background response is read back by its id")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", f"instructions must be a string, got {type(instructions).__name__}")
    own = input_messages(body.get("input"))
    conversation = [*(earlier or []), *own]
    chat = {k: v for k, v in body.items() if k in DIRECT and v is not None}
    chat |= {"model": body.get("model"), "stream": body.get("stream"),
             "messages": ([{"role": "system", "content": instructions}] if instructions else []) + conversation}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if (metadata := _metadata(body)) is not None:
        chat["metadata"] = metadata
    if body.get("user") is not None:
        chat["user"] = body["user"]  # kept in the job's metadata, as chat keeps it
    structured = _structured(body.get("text"))
    if structured is not None:
        if body.get("structured") is not None:
            raise invalid("text.format", "give text.format or structured, not both")
        chat["structured"] = structured
    chat |= _logprobs(body.get("include"), body.get("top_logprobs"))
    echo = {k: body.get(k) for k in ("instructions", "max_output_tokens", "user", "safety_identifier",
                                      "prompt_cache_key", "top_logprobs", "previous_response_id")}
    echo |= {"temperature": _number(body, "temperature"), "top_p": _number(body, "top_p"),
             "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
             "tool_choice": body.get("tool_choice") or "none",
             "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
             "background": background, "store": store, "metadata": body.get("metadata") or {}}
    return Asked(chat, conversation, echo, background, store, len(own))


def input_messages(value: Any) -> list[dict[str, str]]:
    """`input`: a string (one user message) or a list of message items, each {role, content} (a string or text
    parts), `type: message` optional; other item types (tool calls and their outputs, reasoning, references) are
    refused by name."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input", "input must be a string or a non-empty array of message items {role, content}",
                      code="missing_required_parameter" if value is None else None)
    return [_item(i, item) for i, item in enumerate(value)]


def _item(i: int, item: Any) -> dict[str, str]:
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise invalid(where, f"{where} must be a message item, an object with role and content")
    kind = item.get("type", "message")
    if kind != "message":
        raise unsupported(f"{where}.type", kind, " (message items only: no tool calls, reasoning or references)")
    role = item.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role", f"{where}.role={role!r} must be one of {', '.join(ROLES)}")
    for key in item.keys() - ITEM_KEYS:
        raise unsupported(f"{where}.{key}", item[key])
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list) or not content:
        raise invalid(f"{where}.content", f"{where}.content must be a string or a non-empty array of text parts")
    return {"role": role, "content": "".join(_part(f"{where}.content[{j}]", p) for j, p in enumerate(content))}


def _part(where: str, part: Any) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in PART_TYPES:
        raise unsupported(f"{where}.type", kind, " (input_text and output_text parts only)")
    for key in part.keys() - PART_KEYS:
        raise unsupported(f"{where}.{key}", part[key])
    if not isinstance(part.get("text"), str):
        raise invalid(f"{where}.text", f"{where}.text must be a string")
    return part["text"]


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"{name}={value!r} must be true or false")
    return value


def _number(body: dict, name: str) -> Any:
    value = body.get(name)
    return 1.0 if value is None else value  # the wire's default, which the job samples with


def _metadata(body: dict) -> Any:
    """metadata, with safety_identifier kept in it (as chat keeps `user`), for audit."""
    metadata, ident = body.get("metadata"), body.get("safety_identifier")
    if ident is None:
        return metadata
    if not isinstance(ident, str):
        raise invalid("safety_identifier", f"safety_identifier={ident!r} must be a string")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid("metadata", "metadata must be an object of string values")
    return {**(metadata or {}), "safety_identifier": ident}


def _structured(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid("text", "text must be an object: {\"format\": {...}}")
    for key, value in text.items():
        if key == "verbosity" and value in (None, "medium"):
            continue
        if key != "format":
            raise unsupported(f"text.{key}", value)
    if text.get("format") is None:
        return None
    try:
        return structured_of_text_format(text["format"])
    except BadStructured as e:
        raise invalid(e.param, str(e)) from None


def _logprobs(include: Any, top: Any) -> dict[str, Any]:
    if include is not None and (not isinstance(include, list) or any(i != LOGPROBS for i in include)):
        raise unsupported("include", include, f" (only {LOGPROBS!r})")
    if LOGPROBS not in (include or []):
        if top:
            raise invalid("top_logprobs", f"top_logprobs={top!r} needs include=[{LOGPROBS!r}]")
        return {}
    return {"logprobs": True, "top_logprobs": 0 if top is None else top}


def renamed(error: ApiError) -> ApiError:
    """An error the chat plan raised, naming the Responses field instead of the chat one it became."""
    param = error.param or ""
    head = param.split(".", 1)[0].split("[", 1)[0]
    if head in RENAMED:
        new = "input" if head == "messages" else RENAMED[head] + param[len(head):]
        error.message = error.message.replace(param, new, 1) if param else error.message
        error.param = new
    return error
