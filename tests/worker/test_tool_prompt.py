"""How a worker renders a chat job with tools (issue 25): SmolLM2's chat template ignores `tools`, so its jobs get the
tools in kvgate's hermes system prompt, their history's calls as <tool_call> blocks and tool answers as
<tool_response> text; a template that renders tools is used as it is, and `auto` answers are read in the format it
teaches (hermes, or llama3 for a template that writes bare {"name", "parameters"} JSON)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("transformers", reason="chat templates need the worker's transformers")

from kvgate.engine.llm_engine import LLMEngine  # noqa: E402
from kvgate.engine.prompts import Prompts  # noqa: E402
from kvgate.producer import protocol as wire  # noqa: E402
from kvgate.producer.constraints import Function, Tools  # noqa: E402
from kvgate.worker.tool_prompt import ToolPrompts, required_constraint  # noqa: E402

TOOLS = Tools([Function("get_weather", "The weather in a city",
                        '{"type":"object","properties":{"city":{"type":"string"}}}')])
HISTORY = [wire.Message("user", "Weather in Paris?"),
           wire.Message("assistant", "", [wire.ToolCall("call_1", "get_weather", '{"city": "Paris"}')]),
           wire.Message("tool", "sunny", tool_call_id="call_1")]
# what Qwen2.5's template does with tools, in short: a template that renders them
RENDERS = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> answer in <tool_call>"
           "{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


@dataclass
class Chat:
    """The engine's own encode_chat (over its Prompts) with a real tokenizer, without loading a model."""

    tokenizer: Any
    model_name: str = "smollm2-135m"
    prompts: Prompts = field(init=False)
    encode_chat = LLMEngine.encode_chat

    def __post_init__(self) -> None:
        self.prompts = Prompts(self.model_name, self.tokenizer, len(self.tokenizer), max_model_len=8192)


@pytest.fixture(scope="module")
def smol_tokenizer():
    from kvgate.engine.loader import resolve_model
    return resolve_model("smollm2-135m").tokenizer


def text_of(tokenizer, prompts: ToolPrompts, job: wire.Job) -> str:
    return tokenizer.decode(prompts.prompt_ids(job))


def test_a_template_that_ignores_tools_gets_them_in_the_hermes_system_prompt(smol_tokenizer):
    prompts = ToolPrompts(Chat(smol_tokenizer))
    job = wire.Job(v=1, job_id="j", client_id="c", enqueued_at=1.0, messages=HISTORY, tools=TOOLS)
    text = text_of(smol_tokenizer, prompts, job)
    assert not prompts.renders_tools() and prompts.parser() == "hermes"
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_that_renders_tools_is_used_and_names_the_parser(smol_tokenizer):
    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.chat_template = RENDERS
    prompts = ToolPrompts(Chat(tokenizer))
    job = wire.Job(v=1, job_id="j", client_id="c", enqueued_at=1.0, messages=HISTORY[:1], tools=TOOLS)
    text = text_of(tokenizer, prompts, job)
    assert prompts.renders_tools() and prompts.parser() == "hermes"
    assert text.startswith('<tools>{"type": "function", "function": {"name": "get_weather"') and "# Tools" not in text
    llama = copy.deepcopy(smol_tokenizer)
    llama.chat_template = RENDERS.replace("<tool_call>", '{"name": ..., "parameters": ...} after <|python_tag|>')
    assert ToolPrompts(Chat(llama)).parser() == "llama3"
    assert ToolPrompts(Chat(llama), "hermes").parser() == "hermes"  # --tool-call-parser wins


def test_required_and_named_choices_constrain_the_answer_to_a_call():
    assert required_constraint(TOOLS) is None  # auto: free text, read by the parser
    required = required_constraint(Tools(TOOLS.functions, "required", parallel=False))
    assert required.kind == "json_schema" and '"maxItems": 1' in required.spec and required.problem() is None
    named = required_constraint(Tools(TOOLS.functions, "function", "get_weather"))
    assert named.spec == ('{"type": "object", "properties": {"city": {"type": "string"}}, '
                          '"additionalProperties": false}')


def test_a_history_calls_arguments_nested_100000_deep_render_as_text_not_a_recursion_error():
    """Issue 45.1: a producer's text anywhere in a job is parsed within bounds; json.loads raised RecursionError."""
    from kvgate.worker.tool_prompt import template_message

    deep = "[" * 100_000 + "]" * 100_000
    call = wire.ToolCall(id="c1", name="f", arguments=deep)
    out = template_message(wire.Message(role="assistant", content="", tool_calls=[call]))
    assert out["tool_calls"][0]["function"]["arguments"] == deep
