"""A Responses API body (POST /v1/responses) as the chat body it asks for, so it is planned, validated and submitted
by the one chat path (translate.plan): `input` and `instructions` become messages (function_call and
function_call_output items the assistant's tool_calls and tool messages), `max_output_tokens` max_tokens,
`text.format` the structured constraint, `include` logprobs, the flat function `tools` and `tool_choice` chat's
nested ones; every sampling field of the wire passes as for chat.

What a Response object repeats back (instructions, max_output_tokens, text, ...) is kept as its `echo`. Every body
field is honoured, accepted only at a value that asks for nothing the engine lacks, or refused with a 400 naming it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kvgate.openai.shapes import BadStructured, structured_of_text_format

from ..chat.plan import DIRECT
from ..errors import ApiError, invalid, unsupported

LOGPROBS = "message.output_text.logprobs"  # the one `include` the engine can answer
ROLES = ("user", "assistant", "system", "developer")
PART_TYPES = ("input_text", "output_text")  # text parts; an assistant's output_text comes back as input
# keys of an earlier output item or part sent back as input: what it was, not something asked for
ITEM_KEYS = {"type", "role", "content", "id", "status", "phase"}
PART_KEYS = {"type", "text", "annotations", "logprobs"}
# a function_call / function_call_output item: what it needs, and what an earlier output item sent back adds
CALL_KEYS = {"function_call": ({"call_id", "name", "arguments"}, {"type", "id", "status"}),
             "function_call_output": ({"call_id", "output"}, {"type", "id", "status"})}
TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}  # a function tool, flat (chat nests `function`)

NO_OP: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_tool_calls": (lambda v: v is None, " (an answer's calls are bounded by parallel_tool_calls alone)"),
    "truncation": (lambda v: v in (None, "disabled"), " (a conversation over the model's length is refused, "
                                                      "never truncated)"),
    "reasoning": (lambda v: v is None or (isinstance(v, dict) and not any(v.values())), " (no reasoning models)"),
    "service_tier": (lambda v: v in (None, "auto", "default"), ""),
    "stream_options": (lambda v: v in (None, {}) or v == {"include_obfuscation": False}, " (no obfuscation)"),
    "prompt_cache_retention": (lambda v: v in (None, "in_memory"), " (the workers' prefix cache is in memory)"),
}
OWN = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "stream", "background",
       "store", "previous_response_id", "metadata", "user", "safety_identifier", "prompt_cache_key", "top_logprobs",
       "include", "tools", "tool_choice", "parallel_tool_calls"}
FIELDS = OWN | NO_OP.keys() | DIRECT.keys()
# chat plan's parameter -> the Responses field it came from, for the errors plan raises
RENAMED = {"messages": "input", "max_tokens": "max_output_tokens", "structured": "text.format",
           "logprobs": "include", "stream_options": "stream_options"}


@dataclass(slots=True)
class Asked:
    """A Responses request taken apart: the chat body to plan, the conversation it continues or starts (without
    `instructions`, which previous_response_id does not carry over, as OpenAI's), and what the Response repeats."""

    chat: dict[str, Any]
    conversation: list[dict[str, Any]]
    echo: dict[str, Any] = field(default_factory=dict)
    background: bool = False
    store: bool = True
    inputs: int = 0  # the conversation's last `inputs` messages are this request's `input`


def take(body: Any, earlier: list[dict[str, Any]] | None = None) -> Asked:
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
    chat |= _tools(body)
    echo = {k: body.get(k) for k in ("instructions", "max_output_tokens", "user", "safety_identifier",
                                      "prompt_cache_key", "top_logprobs", "previous_response_id")}
    echo |= {"temperature": _number(body, "temperature"), "top_p": _number(body, "top_p"),
             "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
             "tools": body.get("tools") or [],
             "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
             "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
             "background": background, "store": store, "metadata": body.get("metadata") or {}}
    return Asked(chat, conversation, echo, background, store, len(own))


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input`: a string (one user message) or a list of items: messages, each {role, content} (a string or text
    parts), `type: message` optional; function_call items (an assistant's calls: consecutive ones, and the assistant
    message before them, are one assistant turn, as chat's `tool_calls`) and function_call_output items (a tool
    message answering its call_id). Other item types (reasoning, references, other tools' calls) are refused by
    name."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input", "input must be a string or a non-empty array of message items {role, content}",
                      code="missing_required_parameter" if value is None else None)
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        message = _item(i, item)
        if "tool_calls" in message and out and out[-1]["role"] == "assistant" and "tool_call_id" not in out[-1]:
            last = out[-1] = dict(out[-1])  # the calls of one turn join its text (and each other)
            last["tool_calls"] = [*last.get("tool_calls", []), *message["tool_calls"]]
        else:
            out.append(message)
    return out


def _item(i: int, item: Any) -> dict[str, Any]:
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise invalid(where, f"{where} must be a message item, an object with role and content")
    kind = item.get("type", "message")
    if kind in CALL_KEYS:
        return _call_item(where, kind, item)
    if kind != "message":
        raise unsupported(f"{where}.type", kind, " (message, function_call and function_call_output items only: no "
                                                 "reasoning, references or other tools' calls)")
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


def _call_item(where: str, kind: str, item: dict) -> dict[str, Any]:
    """A function_call item as an assistant message of one call, a function_call_output as the tool message answering
    it (chat's shapes: the SDK checks ids, names and sizes, and the errors name these items' fields)."""
    needed, extra = CALL_KEYS[kind]
    for key in item.keys() - needed - extra:
        if item[key] is not None:  # an output item dumped whole says null for what it does not use (namespace)
            raise unsupported(f"{where}.{key}", item[key])
    for key in sorted(needed - item.keys()):
        raise invalid(f"{where}.{key}", f"{where} is a {kind} item: it needs {key}", code="missing_required_parameter")
    for key in sorted(needed - {"output"}):
        if not isinstance(item[key], str) or not item[key]:
            raise invalid(f"{where}.{key}", f"{where}.{key} must be a non-empty string")
    if kind == "function_call":
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": item["call_id"], "type": "function",
             "function": {"name": item["name"], "arguments": item["arguments"]}}]}
    output = item["output"]
    if isinstance(output, list) and output:  # text parts, as a message's content
        output = "".join(_part(f"{where}.output[{j}]", p) for j, p in enumerate(output))
    if not isinstance(output, str):
        raise invalid(f"{where}.output", f"{where}.output must be a string or a non-empty array of input_text parts")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def _tools(body: dict) -> dict[str, Any]:
    """`tools` (function tools, flat: {type, name, description, parameters, strict}), `tool_choice` and
    `parallel_tool_calls` as chat's. Other tool types (web_search, file_search, mcp, ...) are refused by name."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    out: dict[str, Any] = {}
    if parallel is not None:
        out["parallel_tool_calls"] = parallel
    if tools is not None and not isinstance(tools, list):
        raise invalid("tools", "tools must be an array of function tools {type: function, name, parameters}")
    functions = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(where, f"{where} must be a tool object {{type: function, name, parameters}}")
        kind = tool.get("type")
        if kind != "function":
            raise unsupported(f"{where}.type", kind, " (function tools only: kvgate runs no web search, file search, "
                                                     "computer, code interpreter or MCP tools)")
        for key in tool.keys() - TOOL_KEYS:
            raise unsupported(f"{where}.{key}", tool[key])
        functions.append({"type": "function", "function": {k: v for k, v in tool.items()
                                                           if k != "type" and v is not None}})
    if functions:
        out["tools"] = functions
    if isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) != {"type", "name"}:
            raise unsupported("tool_choice", choice, " (\"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                                     "\"name\": ...})")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None and (functions or choice not in ("none", "auto")):
        out["tool_choice"] = choice  # none and auto ask nothing of a request without tools
    return out


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
