"""A chat job with tools as the engine's prompt, the constraint of a required call, and which parser reads its answer.

The chat template renders the tools (transformers' `apply_chat_template(tools=...)`) where it knows how. A template
that ignores them (SmolLM2's renders the same text with tools as without) gets them in a system message in the hermes
format instead (`tool_calls.fallback_system_prompt`), and the history's calls and tool answers as hermes text, so that
every model is told its tools and the `hermes` parser reads its answer. Whether a template renders tools is found once
per worker, by rendering a probe conversation with and without a probe tool.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvgate.producer.bounded_json import parse_json
from kvgate.producer.constraints import Structured, Tools
from kvgate.producer.protocol import Job, Message
from kvgate.producer.tool_calls import CLOSE, OPEN, call_schema, closed, fallback_system_prompt, parameters_of

PROBE = [{"role": "user", "content": "x"}]
PROBE_TOOL = [{"type": "function", "function": {"name": "kvgate_probe", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}]


def template_tools(tools: Tools) -> list[dict[str, Any]]:
    """The tools as transformers' chat templates take them (OpenAI's shape, parameters as a dict)."""
    return [{"type": "function", "function": {"name": f.name, "description": f.description,
                                              "parameters": parameters_of(f.parameters)}} for f in tools.functions]


def _arguments(text: str) -> Any:
    """A call's arguments as templates want them: a dict where the text is a JSON object (Qwen's writes `| tojson`)."""
    try:
        value = parse_json(text)  # a producer's text: nested 100,000 deep it raised RecursionError from json.loads
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def template_message(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls is not None:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _arguments(c.arguments)}} for c in m.tool_calls]
    out |= {k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name)) if v is not None}
    return out


def fallback_messages(messages: list[Message], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation for a template that renders no tools: the tools in the system message, each call of the
    history as a hermes block in its assistant message, each tool answer as a user message in <tool_response> tags."""
    out = []
    for m in messages:
        if m.role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"})
        elif m.tool_calls:
            calls = [f'{OPEN}\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n{CLOSE}'
                     for c in m.tool_calls]
            out.append({"role": m.role, "content": "\n".join([m.content, *calls] if m.content else calls)})
        else:
            out.append({"role": m.role, "content": m.content})
    if tools:
        prompt = fallback_system_prompt(tools)
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def required_constraint(tools: Tools) -> Structured | None:
    """The constraint that makes the answer a call: `required`, a JSON array of calls; a named function, its
    arguments. None for `auto`."""
    if tools.choice == "auto":
        return None
    if tools.choice == "function":
        params = next(f.parameters for f in tools.functions if f.name == tools.function)
        return Structured("json_schema", json.dumps(closed(parameters_of(params))))
    return Structured("json_schema", json.dumps(call_schema([(f.name, f.parameters) for f in tools.functions],
                                                            tools.parallel)))


@dataclass(slots=True)
class ToolPrompts:
    """One worker's way with tools: whether its template renders them, and the parser `auto` answers are read with
    (`setting`: the worker's --tool-call-parser; auto: from the template)."""

    engine: Any
    setting: str = "auto"
    _renders: bool | None = field(default=None)

    def renders_tools(self) -> bool:
        if self._renders is None:
            try:
                self._renders = self.engine.encode_chat(PROBE, tools=PROBE_TOOL) != self.engine.encode_chat(PROBE)
            except Exception:  # a template that fails on tools renders none
                self._renders = False
        return self._renders

    def parser(self) -> str:
        if self.setting != "auto":
            return self.setting
        tokenizer = self.engine.tokenizer  # the Engine protocol's: None for an engine of token ids only
        source = str(tokenizer.chat_template or "") if tokenizer is not None else ""
        if self.renders_tools() and OPEN not in source and ("<|python_tag|>" in source or '"parameters"' in source):
            return "llama3"
        return "hermes"

    def prompt_ids(self, job: Job) -> list[int]:
        tools = template_tools(job.tools) if job.tools is not None else None
        has_tool_history = any(m.tool_calls or m.role == "tool" for m in job.messages)
        if (tools or has_tool_history) and not self.renders_tools():
            return list(self.engine.encode_chat(fallback_messages(job.messages, tools), job.add_generation_prompt,
                                                job.chat_template_kwargs))
        return list(self.engine.encode_chat([template_message(m) for m in job.messages], job.add_generation_prompt,
                                            job.chat_template_kwargs, tools=tools))
