"""The prompt of a request as the SDK takes it: chat `messages` as SDK messages, `prompt` as texts or token ids."""
from __future__ import annotations

from typing import Any

from kvgate.producer.quoting import shown

from ..errors import invalid, unsupported

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# keys an assistant message may carry as long as they say nothing (no refusal, no audio, no deprecated function call)
EMPTY_OK = ("tool_calls", "refusal", "audio", "function_call")
# keys taken as given, checked by the SDK: an assistant's calls, the call a tool message answers, a participant name
TOOL_KEYS = {"assistant": ("tool_calls", "name"), "tool": ("tool_call_id", "name"), "user": ("name",),
             "system": ("name",), "developer": ("name",)}


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty array of {role, content} objects")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid(where, f"{where} must be an object with role and content")
    role = m.get("role")
    if role == "function":
        raise unsupported(f"{where}.role", role, " (deprecated: answer a tool call with role tool and its "
                                                 "tool_call_id)")
    if role not in ROLES:
        raise invalid(f"{where}.role", f"{where}.role={shown(role)} must be one of {sorted(ROLES)}")
    out: dict[str, Any] = {"role": ROLES[role]}
    for key, value in m.items():
        if key in ("role", "content"):
            continue
        if key in TOOL_KEYS[role] and value is not None and value != []:
            out[key] = value
            continue
        if key in EMPTY_OK and not value:
            continue
        raise unsupported(f"{where}.{key}", value)
    if role == "tool" and not isinstance(out.get("tool_call_id"), str):
        raise invalid(f"{where}.tool_call_id", f"{where} is a tool message: it needs the tool_call_id of the call it "
                                               "answers")
    content = m.get("content")
    out["content"] = "" if content is None and out.get("tool_calls") else _content(where, content)
    return out


def _content(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise invalid(f"{where}.content", f"{where}.content must be a string or a non-empty array of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise unsupported(f"{where}.content[{j}].type", kind, " (text parts only)")
        if set(part) - {"type", "text"}:
            extra = sorted(set(part) - {"type", "text"})[0]
            raise unsupported(f"{where}.content[{j}].{extra}", part[extra])
        if not isinstance(part.get("text"), str):
            raise invalid(f"{where}.content[{j}].text", f"{where}.content[{j}].text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def completion_prompts(prompt: Any) -> list[dict[str, Any]]:
    """A string, an array of strings, an array of token ids, or an array of such arrays: one SDK prompt each."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [{"prompt": p} for p in prompt]
        if all(_is_token(t) for t in prompt):
            return [{"prompt_token_ids": prompt}]
        if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
            return [{"prompt_token_ids": p} for p in prompt]
    raise invalid("prompt", "prompt must be a string, an array of strings, an array of token ids or an array of "
                            "non-empty token id arrays, and not empty")


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)
