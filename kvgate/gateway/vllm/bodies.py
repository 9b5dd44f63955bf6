"""The bodies of vLLM's POST /tokenize and /detokenize, checked as vLLM's are, refusing by name what the worker's
tokenizer answer cannot honour (routes.py serves them)."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvgate.producer.keys import DEFAULT_MODEL
from kvgate.producer.limits import MAX_MESSAGES, MAX_PROMPT_CHARS
from kvgate.producer.request import MAX_TOKEN_ID, ChatMessage

from ..errors import invalid, unsupported

# vLLM fields the worker's tokenizer answer cannot honour (it encodes messages exactly as a generation job's):
# refused by name instead of ignored; their value that matches what the worker does is accepted
CHAT_AS_GENERATED = {"add_generation_prompt": True, "add_special_tokens": False, "continue_final_message": False}
NOT_HONOURED = ("chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs")


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
    model: Annotated[str, Field(min_length=1)] = DEFAULT_MODEL  # vLLM's is optional: the model the fleet serves
    return_token_strs: bool | None = False


class TokenizePrompt(_Body):
    prompt: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
    add_special_tokens: bool = True


class TokenizeChat(_Body):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    continue_final_message: bool = False


class Detokenize(_Body):
    tokens: Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]],
                      Field(min_length=1, max_length=MAX_PROMPT_CHARS)]


def parse(kind: type[BaseModel], body: Any) -> BaseModel:
    """A body as `kind`, or the 400 that names its first bad field and value."""
    if not isinstance(body, dict):
        raise invalid("body", f"the request body must be a JSON object, got {type(body).__name__}")
    for name in NOT_HONOURED if kind is not Detokenize else ():
        if body.get(name) is not None:
            raise unsupported(name, body[name], " for /tokenize: the worker applies the model's own chat template")
    try:
        parsed = kind.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or "body"
        shown = repr(err.get("input"))
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise invalid(param, f"{param}: {err['msg']} (got {shown})", code="invalid_value") from None
    if parsed.return_token_strs:
        raise unsupported("return_token_strs", True, " (the tokens' strings are not returned)")
    if isinstance(parsed, TokenizeChat):
        for name, honoured in CHAT_AS_GENERATED.items():
            if getattr(parsed, name) != honoured:
                raise unsupported(name, getattr(parsed, name), f" with messages: the worker tokenizes them as a chat "
                                                               f"request's, {name}={honoured}")
    return parsed


def tokenize_body(body: Any) -> TokenizePrompt | TokenizeChat:
    """vLLM's two tokenize bodies: `prompt` or `messages`."""
    has_messages = isinstance(body, dict) and "messages" in body
    return parse(TokenizeChat if has_messages else TokenizePrompt, body)
