"""What a job's output must follow, on the wire: the functions it may call (`Tools`) or the one structured constraint
(`Structured`: a JSON schema, any JSON object, a regex, a choice or a grammar). Each says what makes it unusable
(`problem()`), so the SDK refuses it before enqueueing and the worker again after decoding (protocol.py)."""
from __future__ import annotations

from typing import Literal, get_args

import msgspec

from .bounded_json import BadJson, parse_json
from .limits import MAX_CHOICES, MAX_STRUCTURED_CHARS, MAX_TOOLS, TOOL_NAME


class Function(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str
    description: str = ""
    parameters: str = ""  # the JSON schema of its arguments as text; "": it takes none


ToolChoice = Literal["auto", "required", "function"]
TOOL_CHOICES = get_args(ToolChoice)


class Tools(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The functions a chat job may call, rendered by the worker's chat template, and how it may call them: `auto`
    (the model decides; the worker's parser reads its calls), `required` (at least one call: the worker constrains the
    answer to a JSON array of calls), `function` (a call of `function`: the answer is constrained to its arguments).
    Not calling (OpenAI's tool_choice none) is a job without tools."""

    functions: list[Function]
    choice: ToolChoice = "auto"
    function: str = ""  # choice "function": the one to call
    parallel: bool = True  # more than one call in an answer (OpenAI's parallel_tool_calls)

    def problem(self) -> str | None:
        if not 0 < len(self.functions) <= MAX_TOOLS:
            return f"tools has {len(self.functions)} functions; it must have 1 to {MAX_TOOLS}"
        size = sum(len(f.name) + len(f.description) + len(f.parameters) for f in self.functions)
        if size > MAX_STRUCTURED_CHARS:
            return f"tools hold {size} characters, over the limit of {MAX_STRUCTURED_CHARS}"
        names = [f.name for f in self.functions]
        for f in self.functions:
            if not TOOL_NAME.fullmatch(f.name):
                return (f"tool name {f.name[:80]!r} must be 1 to 64 letters, digits, '_' or '-' (for example "
                        "'get_weather')")
            if names.count(f.name) > 1:
                return f"tool name {f.name!r} is declared twice; every function needs its own name"
            if f.parameters and (problem := schema_problem(f.parameters, f"tool {f.name!r} parameters")):
                return problem
        if (self.choice == "function") != bool(self.function):
            return "tools choice 'function' names its function in `function`, and only it does"
        if self.function and self.function not in names:
            return f"tool choice names function {self.function!r}, which tools does not declare (declared: " \
                   f"{', '.join(names)[:200]})"
        return None


def schema_problem(text: str, what: str) -> str | None:
    """Why `text`, named `what` in the answer, is not a JSON schema object, or None. The text is a producer's: parsed
    within the same depth budget as a request body (a schema nested 1,000 deep raised RecursionError here, in every
    worker that read the job)."""
    try:
        schema = parse_json(text)
    except BadJson as e:
        return f"{what} is not JSON a worker takes: {e}"
    if not isinstance(schema, dict):
        return f"{what} must be a JSON schema object, got {type(schema).__name__}"
    return None


# The kinds of constraint, declared once on the wire: Structured.kind's type and the list messages name. The engine may
# not import the SDK, nor the SDK the engine (tests/test_layering.py), so engine/constraints.py declares its KINDS
# itself and tests/producer/test_field_agreement.py holds the two equal.
StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
STRUCTURED_KINDS = get_args(StructuredKind)


class Structured(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The one constraint a request's output must follow. `spec` is a JSON schema's text (json_schema; also
    json_object, where it is optional and narrows "any JSON object"), a regular expression (regex) or a grammar
    (grammar: Lark, or GBNF/EBNF as the worker's grammar library takes it); `choices` the strings of `choice`.
    The worker compiles it off the engine thread; one it cannot compile is an error result naming the problem."""

    kind: StructuredKind
    spec: str = ""
    choices: list[str] = []

    def problem(self, max_chars: int = MAX_STRUCTURED_CHARS) -> str | None:
        """What makes this constraint unusable before any compiling, or None."""
        size = len(self.spec) + sum(len(c) for c in self.choices)
        if size > max_chars:
            return f"structured {self.kind} constraint has {size} characters, over the limit of {max_chars}"
        if self.kind == "choice":
            if not 0 < len(self.choices) <= MAX_CHOICES or not all(self.choices) or self.spec:
                return (f"structured choice needs 1 to {MAX_CHOICES} non-empty strings in choices and no spec; got "
                        f"{len(self.choices)} choices")
            return None
        if self.choices:
            return f"structured {self.kind} takes no choices (only kind='choice' does)"
        if self.kind in ("regex", "grammar", "json_schema") and not self.spec:
            return f"structured {self.kind} needs a non-empty spec (the {self.kind.replace('_', ' ')})"
        if self.kind in ("json_schema", "json_object") and self.spec:
            return schema_problem(self.spec, f"structured {self.kind} spec")
        return None
