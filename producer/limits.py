"""The wire's limits: the most a job, a reply event or a request field may hold, and the patterns of the names it
carries (tools, template variables, tenants, models). The producer checks a request against them before enqueueing,
the worker checks a decoded job against them again (protocol.py), and the gateway answers over them early."""
from __future__ import annotations

import re

MAX_PAYLOAD_BYTES = 1 << 20  # 1 MiB: far above any sane prompt, far below a Redis DoS
MAX_PROMPT_CHARS = 512_000
MAX_MESSAGES = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_METADATA_BYTES = 16_384
MAX_TOKENS_LIMIT = 1 << 20
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_LOGIT_BIAS = 300  # entries of one request's logit_bias: each costs every step of the request a scatter
MAX_STRUCTURED_CHARS = 65_536  # a JSON schema, regex or grammar; OpenAI's strict schemas are far smaller
MAX_CHOICES = 256
MAX_TEMPLATE_KWARGS = 16  # chat_template_kwargs entries: a few switches (enable_thinking...), not a second prompt
MAX_TEMPLATE_VALUE_CHARS = 4096
TEMPLATE_KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# apply_chat_template's own parameters: a template variable of one of these names would change how it is called
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})
MAX_EMBEDDING_DIMENSIONS = 65_536  # far above any model's hidden size; the worker refuses more than its model has
MAX_TOOLS = 128  # OpenAI's limit of functions a request declares
MAX_TOOL_CALLS = 128  # calls one assistant message of a conversation's history holds
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
MAX_EVENT_BYTES = 64 << 20  # reply events come from workers; a long answer with top-20 logprobs runs to megabytes
MAX_MODEL_NAME_CHARS = 128
# A tenant names who submitted a job (the gateway's API key maps to one): short, and safe as a metric label, a
# Redis key part (no braces: Cluster hash tags) and a folder name.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DEFAULT_TENANT = "default"  # the tenant of a bare API key and of an open gateway's callers
# The one cardinality rule of every per-name view (`kvgate stats`, `kvgate top`, the exporter, workers' heartbeats),
# tenants' and LoRA adapters' alike: the TOP_NAMED busiest by name, every other name summed as OTHER_NAMED (no tenant
# or adapter name starts with '_'), so a label's values stay few however many names there are (`top_and_rest`).
TOP_NAMED = 10
OTHER_NAMED = "_other"
TOP_TENANTS, OTHER_TENANTS = TOP_NAMED, OTHER_NAMED  # the rule as the tenant views name it


def top_and_rest(items, rank, top: int = TOP_NAMED) -> tuple[list, list]:
    """The rule's split: the `top` first items by `rank` (a sort key: busiest first, then the name, so a tie is
    settled the same way in every view), to be shown by name, and the rest, to be summed as OTHER_NAMED."""
    ranked = sorted(items, key=rank)
    return ranked[:top], ranked[top:]
