"""An OpenAI request body as SDK submits: one per choice (n per prompt), validated before anything is enqueued.

Every body field is either honoured, accepted only at the value that changes nothing (functions=[],
response_format text, ...), or refused with a 400 naming it: a parameter is never silently ignored.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from kvgate.producer import InvalidRequest
from kvgate.producer.quoting import shown
from kvgate.openai.shapes import (STRUCTURED_BODY_FIELDS, BadLogprobs, BadStructured, logit_bias_of,
                                  requested_logprobs, structured_of_body)
from kvgate.producer.constraints import Tools
from kvgate.producer.protocol import SAMPLING_FIELDS
from kvgate.producer.request import SubmitRequest, validate_request

from ..errors import from_sdk, invalid, unsupported
from ..settings import GatewaySettings
from .prompts import chat_messages, completion_prompts

Kind = Literal["chat", "completion"]

# body field -> SDK argument, taken as given: every sampling field of the wire (OpenAI's names, and vLLM-style
# extensions through openai's extra_body) but max_tokens and logprobs, which have OpenAI spellings of their own, and
# prompt_logprobs, which completions ask for as echo with logprobs (the answer's shape has no other place for them)
DIRECT = {spec.name: spec.name for spec in SAMPLING_FIELDS
          if spec.name not in ("max_tokens", "logprobs", "prompt_logprobs")} | {
    "priority": "priority",
    # OpenAI's prompt-cache routing hint: with affinity lanes, jobs sharing it go to one worker's prefix cache
    "prompt_cache_key": "prefix_key"}
# body fields accepted only at a value that asks for nothing the engine lacks, with why the rest is refused
NO_OP: dict[str, tuple[Callable[[Any], bool], str]] = {
    # the deprecated spelling of tools: refused, naming the one to use
    "functions": (lambda v: v in (None, []), " (deprecated: send tools=[{\"type\": \"function\", \"function\": "
                                             "{...}}])"),
    "function_call": (lambda v: v in (None, "none"), " (deprecated: send tool_choice)"),
    "store": (lambda v: v in (None, False), " (completions are not stored)"),
    "service_tier": (lambda v: v in (None, "auto", "default"), ""),
    "modalities": (lambda v: v in (None, ["text"]), " (text output only)"),
}
# chat only (vLLM's extra_body): how the worker renders the chat template, taken as given (the SDK bounds them)
TEMPLATE = ("chat_template_kwargs", "add_generation_prompt")
COMMON = {"model", "n", "stream", "stream_options", "max_tokens", "user", "metadata", "logprobs", *DIRECT,
          *STRUCTURED_BODY_FIELDS}
# chat's tool calling, taken as the SDK takes it (tool_calls.py reads the answers)
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
FIELDS: dict[Kind, set[str]] = {
    "chat": COMMON | {"messages", "max_completion_tokens", "top_logprobs", *TEMPLATE, *TOOL_FIELDS} |
            NO_OP.keys(),
    "completion": COMMON | {"prompt", "best_of"} | {"echo", "suffix"},
}
# SDK argument -> body field, to name the field a validation error is about
NAMES = {v: k for k, v in DIRECT.items()} | {name: name for name in (*TEMPLATE, *TOOL_FIELDS, "suffix")} | {
    "messages": "messages", "prompt": "prompt", "prompt_token_ids": "prompt", "max_tokens": "max_tokens"}


@dataclass(slots=True)
class Plan:
    kind: Kind
    model: str
    submits: list[dict[str, Any]]  # one per choice, in choice order (prompt-major, then n)
    prompt_of: list[int]  # choice index -> prompt index, for usage (a prompt is counted once)
    stream: bool = False
    include_usage: bool = False
    names: dict[str, str] = field(default_factory=dict)
    n: int = 1  # choices answered per prompt
    best_of: int = 1  # choices generated per prompt; the n with the highest cumulative logprob are answered
    show_logprobs: bool = False  # the body asked for logprobs (best_of asks for them itself, to score)
    echo: bool = False  # completions: the answer starts with the prompt (and its logprobs, with logprobs)
    prompt_only: bool = False  # echo with max_tokens 0: one token is generated, and left out of the answer
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: every chunk has its choice's usage
    tools: Tools | None = None  # the functions a chat request may call and how: its answers are read for calls
    fill_in_middle: bool = False  # completions with suffix: the model must have FIM tokens (LiveModels.check_fim)

    def picked(self, results: list) -> list[tuple[int, Any]]:
        """(submit index, result) of the choices to answer, in choice order: each prompt's n of its best_of with
        the highest cumulative logprob (ties: the earlier), or every result where best_of is n."""
        if self.best_of == self.n:
            return list(enumerate(results))
        out = []
        for start in range(0, len(results), self.best_of):
            group = list(enumerate(results[start:start + self.best_of], start))
            group.sort(key=lambda item: -sum(t.logprob for t in item[1].logprobs or ()))
            out += group[:self.n]
        return out


def plan(kind: Kind, body: Any, settings: GatewaySettings) -> Plan:
    if not isinstance(body, dict):
        raise invalid("body", "the request body must be a JSON object")
    _refuse_unknown(kind, body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "model is required: a model name from GET /v1/models", code="missing_required_parameter")
    prompts = chat_prompts(body) if kind == "chat" else completion_prompts(body.get("prompt"))
    n, best_of = _choices(body, settings.max_n, len(prompts))
    _token_id_budget(prompts, best_of, settings.max_prompt_token_ids)
    stream, include_usage, continuous_usage = _streaming(body)
    echo = _flag(body, "echo")
    suffix = _suffix(body)
    if echo and suffix is not None:  # the prompt the model reads holds FIM tokens around both: no text to echo
        raise invalid("echo", "echo=true with suffix: the model reads FIM tokens around prompt and suffix, so there "
                              "is no one prompt to echo; send echo or suffix, not both")
    if stream and (echo or best_of > n):
        name = "echo" if echo else "best_of"
        raise unsupported(name, body[name], " with stream=true (whole answers only); send stream=false")
    try:
        logprobs = requested_logprobs(kind == "chat", body)
    except BadLogprobs as e:
        raise invalid(e.param, str(e)) from None
    common = _sampling(kind, body, settings) | {"stream": stream, "model": model}  # the model picks the streams
    prompt_only = echo and common["max_tokens"] == 0
    if prompt_only:  # lm-eval's loglikelihood shape: the prompt scored, nothing generated (one token is, unseen)
        common["max_tokens"] = 1
    try:
        asked = structured_of_body(body)
    except BadStructured as e:
        raise invalid(e.param, str(e)) from None
    names = NAMES
    if asked is not None:
        if "structured" in common:
            raise invalid(asked[0], f"give {asked[0]} or structured, not both")
        common["structured"], names = asked[1], NAMES | {"structured": asked[0]}
    if logprobs is not None or best_of > n:  # best_of scores its choices by their tokens' logprobs
        common["logprobs"] = logprobs or 0
    if echo and logprobs is not None:
        common["prompt_logprobs"] = logprobs
    common |= {name: body[name] for name in TOOL_FIELDS if body.get(name) not in (None, [])}  # tools=[]: none
    if suffix is not None:  # the worker renders it with its model's FIM tokens, or answers that it has none
        common["suffix"] = suffix
    names = names | {"max_tokens": "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens",
                     "logprobs": "top_logprobs" if kind == "chat" else "logprobs"}
    submits, prompt_of, tools = [], [], None
    for p, prompt in enumerate(prompts):
        if echo and "prompt_token_ids" in prompt:  # the echoed text is the prompt tokens' own
            prompt = prompt | {"prompt_logprobs": common.get("prompt_logprobs", 0)}
        for i in range(best_of):
            args = common | prompt
            if best_of > 1 and args.get("seed") is not None:
                args["seed"] += i  # distinct choices, still reproducible
            tools = _validate(args, names, f"prompt[{p}]" if len(prompts) > 1 else None).wire_tools()
            submits.append(args)
            prompt_of.append(p)
    return Plan(kind, model, submits, prompt_of, stream, include_usage, names, n, best_of, logprobs is not None, echo,
                prompt_only, continuous_usage, tools, fill_in_middle=suffix is not None)


def chat_prompts(body: dict) -> list[dict[str, Any]]:
    template = {name: body[name] for name in TEMPLATE if body.get(name) is not None}
    return [{"messages": chat_messages(body.get("messages"))} | template]


def _refuse_unknown(kind: Kind, body: dict) -> None:
    for name, value in body.items():
        if name not in FIELDS[kind]:
            raise unsupported(name, value, f" on {'/v1/chat/completions' if kind == 'chat' else '/v1/completions'}")
        if name in NO_OP and not NO_OP[name][0](value):
            raise unsupported(name, value, NO_OP[name][1])


def _suffix(body: dict) -> str | None:
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise invalid("suffix", f"suffix={shown(suffix)} must be a string: the text after the completion")
    return suffix


def _choices(body: dict, max_n: int, prompts: int) -> tuple[int, int]:
    """n, and best_of (the choices generated per prompt, n unless the body says more)."""
    n = body.get("n", 1)
    n = 1 if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise invalid("n", f"n={shown(n)} must be a positive integer")
    best_of = body.get("best_of")
    best_of = n if best_of is None else best_of
    if not isinstance(best_of, int) or isinstance(best_of, bool) or best_of < n:
        raise invalid("best_of", f"best_of={shown(best_of)} must be an integer >= n ({n})")
    if best_of * prompts > max_n:
        name = "best_of" if best_of > n else "n"
        raise invalid(name, f"{name}={best_of} for {prompts} prompt(s) asks for {best_of * prompts} choices, over "
                            f"this gateway's limit of {max_n} per request; send fewer")
    return n, best_of


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise invalid(name, f"{name}={shown(value)} must be true or false")
    return bool(value)


def _token_id_budget(prompts: list[dict[str, Any]], n: int, limit: int) -> None:
    """The SDK checks and encodes every token id of every choice on the event loop (65 ms for the 512,000 a job may
    hold, on a loaded machine), so a request's ids are bounded, n copies of a prompt counted n times."""
    ids = sum(len(p.get("prompt_token_ids") or ()) for p in prompts)
    if n * ids > limit:
        raise invalid("n" if n > 1 else "prompt", f"{n} choice(s) of {ids} prompt token ids make {n * ids}, over this "
                                                  f"gateway's limit of {limit} per request (--max-prompt-token-ids); "
                                                  "ask for fewer choices or send a shorter prompt")


def _streaming(body: dict) -> tuple[bool, bool, bool]:
    """stream, and stream_options' include_usage (a last chunk with the request's usage) and vLLM's
    continuous_usage_stats (every chunk with its choice's usage so far)."""
    stream, options = body.get("stream", False), body.get("stream_options")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("stream", f"stream={shown(stream)} must be true or false")
    if options is None:
        return stream, False, False
    if not stream:
        raise invalid("stream_options", "stream_options is only allowed with stream=true")
    if not isinstance(options, dict):
        raise invalid("stream_options", "stream_options must be an object")
    for key, value in options.items():
        if key not in ("include_usage", "continuous_usage_stats"):
            raise unsupported(f"stream_options.{key}", value)
    flags = []
    for key in ("include_usage", "continuous_usage_stats"):
        value = options.get(key, False)
        if not isinstance(value, bool):
            raise invalid(f"stream_options.{key}", f"stream_options.{key}={shown(value)} must be a boolean")
        flags.append(value)
    return stream, *flags


def _sampling(kind: Kind, body: dict, settings: GatewaySettings) -> dict[str, Any]:
    args = {DIRECT[k]: v for k, v in body.items() if k in DIRECT and v is not None}
    args["max_tokens"] = _max_tokens(body, settings.default_max_tokens)
    if "logit_bias" in args:
        try:
            args["logit_bias"] = logit_bias_of(args["logit_bias"])
        except ValueError as e:
            raise invalid("logit_bias", str(e)) from None
    if "priority" in args:
        args["priority"] = band(args["priority"])
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid("metadata", "metadata must be an object of string values")
    user = body.get("user")
    if user is not None:
        if not isinstance(user, str):
            raise invalid("user", f"user={shown(user)} must be a string")
        metadata = {**(metadata or {}), "user": user}  # kept with the job's result, for audit
    if metadata:
        args["metadata"] = metadata
    return args


def band(priority: Any) -> Any:
    """vLLM's integer priority (lower is served first; 0 by default) as one of the queue's three bands: below 0 is
    high, 0 normal, above 0 low. A band's name passes as it is; anything else is left to the SDK to name."""
    if isinstance(priority, int) and not isinstance(priority, bool):
        return "high" if priority < 0 else "low" if priority > 0 else "normal"
    return priority


def _max_tokens(body: dict, default: int) -> int:
    given = {k: body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None}
    if len(set(map(repr, given.values()))) > 1:
        raise invalid("max_completion_tokens", f"max_tokens and max_completion_tokens disagree ({given}); give one")
    value = next(iter(given.values()), default)
    if value == 0 and not isinstance(value, bool) and body.get("echo") is not True:
        name = next(iter(given))
        raise invalid(name, f"{name}=0 generates nothing: it is allowed only with echo=true (the prompt scored); "
                            "send 1 or more")
    return value


def _validate(args: dict[str, Any], names: dict[str, str], prompt_where: str | None) -> SubmitRequest:
    try:
        return validate_request(args)
    except InvalidRequest as e:
        error = from_sdk(e, names, 0)
        if prompt_where and error.param == "prompt":
            error.param = prompt_where
            error.message = prompt_where + error.message.removeprefix("prompt")
        raise error from None
