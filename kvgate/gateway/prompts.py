"""The prompt of a request as the SDK takes it: chat `messages` as SDK messages, `prompt` as texts or token ids."""
from __future__ import annotations

from typing import Any

from .errors import invalid, unsupported

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# keys an assistant message may carry as long as they say nothing (no tool calls, no refusal, no audio)
EMPTY_OK = ("tool_calls", "refusal", "audio", "function_call")


def chat_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty array of {role, content} objects")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m: Any) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid(where, f"{where} must be an object with role and content")
    role = m.get("role")
    if role in ("tool", "function"):
        raise unsupported(f"{where}.role", role, " (no tool calling)")
    if role not in ROLES:
        raise invalid(f"{where}.role", f"{where}.role={role!r} must be one of {sorted(ROLES)}")
    for key, value in m.items():
        if key in ("role", "content"):
            continue
        if key in EMPTY_OK and not value:
            continue
        raise unsupported(f"{where}.{key}", value)
    return {"role": ROLES[role], "content": _content(where, m.get("content"))}


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
