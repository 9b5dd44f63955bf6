"""The structured-output and tool arguments of a submit call, checked and turned into the wire's constraints
(constraints.py): `response_format`, `regex`, `choice`, `grammar` or `structured` into one `Structured`; OpenAI's
`tools` and `tool_choice` into `Tools`. request.py declares them among the other submit arguments."""
from __future__ import annotations

from typing import Annotated, Any

import msgspec
from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, PlainSerializer

from . import constraints, limits
from .bounded_json import MAX_DEPTH, BadJson, check_depth
from .tool_calls import closed


def utf8(text: str) -> str:
    """`text`, once it is known to encode as UTF-8 (a lone surrogate cannot go on the wire)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"is not valid UTF-8 text (lone surrogate {text[e.start]!r} at position {e.start})") from None
    return text


Text = Annotated[str, AfterValidator(utf8)]


def call_arguments(value: Any) -> Any:
    """A call's arguments as OpenAI sends them (JSON text), or as a dict, which is sent as its JSON text."""
    return json_text(value, "arguments") if isinstance(value, dict) else value


def schema_dict(value: Any) -> Any:
    """response_format as given, once it is known to encode (named here, where a model validator's error names no
    field)."""
    if isinstance(value, dict):
        json_text(value, "the schema")
    return value


def json_text(value: Any, what: str) -> str:
    """A caller's dict (a schema, a call's arguments) as the JSON text the wire carries; one nested past
    bounded_json's limit is a ValueError naming it, as a worker would refuse its text, on every Python (msgspec raised
    RecursionError on 3.11 and encoded it on 3.12)."""
    try:
        check_depth(value)
        return msgspec.json.encode(value).decode()
    except (BadJson, RecursionError):
        raise ValueError(f"{what} is nested too deeply: more than {MAX_DEPTH} arrays or objects inside one another "
                         "is refused; send a flatter schema") from None



def _structured(value: Any) -> constraints.Structured | None:
    """The wire's constraint from itself or its dict form ({"kind": "regex", "spec": "[0-9]+"}), checked as the
    worker checks it."""
    if value is None or isinstance(value, constraints.Structured):
        structured = value
    else:
        try:
            structured = msgspec.convert(value, constraints.Structured)
        except msgspec.ValidationError as e:
            raise ValueError(f"is not a structured constraint ({e}); give {{'kind': one of "
                             f"{', '.join(constraints.STRUCTURED_KINDS)}, 'spec': text, 'choices': [...]}}, or use "
                             "response_format=, regex=, choice= or grammar=") from None
    if structured is not None and (problem := structured.problem()):
        raise ValueError(problem)
    return structured


Structured = Annotated[Any, BeforeValidator(_structured),
                       PlainSerializer(lambda v: None if v is None else msgspec.to_builtins(v))]


def is_model_class(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, BaseModel)


def structured_of(response_format: Any = None, regex: str | None = None, choice: list[str] | None = None,
                  grammar: str | None = None) -> constraints.Structured | None:
    """The wire constraint of the SDK's conveniences: `response_format` as OpenAI's dict ({"type": "json_object"} or
    {"type": "json_schema", "json_schema": {"schema": ...}}), a JSON schema dict, or a pydantic model class;
    `regex`, `choice` (a list of strings), `grammar` (Lark or GBNF text). At most one; None: free text."""
    given = [n for n, v in (("response_format", response_format), ("regex", regex), ("choice", choice),
                            ("grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of response_format, regex, choice, grammar; got {', '.join(given)}")
    if regex is not None:
        return constraints.Structured("regex", regex)
    if grammar is not None:
        return constraints.Structured("grammar", grammar)
    if choice is not None:
        return constraints.Structured("choice", choices=list(choice))
    if response_format is None:
        return None
    if is_model_class(response_format):
        schema = closed(response_format.model_json_schema())
        return constraints.Structured("json_schema", json_text(schema, "response_format"))
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be OpenAI's dict, a JSON schema dict or a pydantic model class, "
                         f"got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text" and len(response_format) == 1:
        return None
    if kind == "json_object" and len(response_format) == 1:
        return constraints.Structured("json_object")
    if kind == "json_schema" and isinstance(response_format.get("json_schema"), dict):
        schema = response_format["json_schema"].get("schema")
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object")
        return constraints.Structured("json_schema", json_text(schema, "response_format"))
    return constraints.Structured("json_schema", json_text(response_format, "response_format"))  # a JSON schema itself


def _function(tool: Any) -> constraints.Function:
    """One of `tools`: OpenAI's {"type": "function", "function": {"name", "description", "parameters", "strict"}}, or
    the function dict alone."""
    if isinstance(tool, constraints.Function):
        return tool
    if not isinstance(tool, dict):
        raise ValueError("must be OpenAI's {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}, "
                         f"got {type(tool).__name__}")
    if "function" in tool or "type" in tool:
        if tool.get("type") != "function" or not isinstance(tool.get("function"), dict) or set(tool) - {"type",
                                                                                                       "function"}:
            raise ValueError("must be {'type': 'function', 'function': {...}}: function tools only")
        tool = tool["function"]
    unknown = set(tool) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise ValueError(f"function has unknown field(s) {sorted(unknown)}; it takes name, description, parameters, "
                         "strict")
    name, description, params = tool.get("name"), tool.get("description", ""), tool.get("parameters")
    if not isinstance(name, str) or not isinstance(description, str) or (params is not None and
                                                                         not isinstance(params, dict)):
        raise ValueError("function needs a string name, a string description and parameters as a JSON schema object")
    if tool.get("strict") not in (None, True, False):
        raise ValueError("function strict must be true or false")
    utf8(description)
    parameters = "" if params is None else json_text(params, f"function {name!r} parameters")
    return constraints.Function(name, description, parameters)


def _tools(value: Any) -> Any:
    if value is None or not isinstance(value, (list, tuple)):
        return value
    return [_function(t) for t in value]


def tool_choice_of(value: Any) -> Any:
    """"none" | "auto" | "required" | {"type": "function", "function": {"name": ...}} (or the name alone)."""
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "function"} and \
            isinstance(value["function"], dict) and set(value["function"]) == {"name"}:
        value = value["function"]["name"]
    if isinstance(value, str) and limits.TOOL_NAME.fullmatch(value):
        return {"type": "function", "function": {"name": value}}
    raise ValueError("must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")


Tools = Annotated[list[Any], BeforeValidator(_tools), Field(min_length=1, max_length=limits.MAX_TOOLS),
                  PlainSerializer(lambda v: None if v is None else msgspec.to_builtins(v))]
