"""Tool calls in a model's text, without I/O: the JSON schema a required call follows, and the parsers that find calls.

A parser is fed the answer's text as it arrives and returns pieces: `Content` (text for `message.content`) and
`CallDelta` (a call's index, its name on its first piece, and text to append to its arguments). The worker runs one
over a finished answer (`Final.tool_calls`), the gateway over a stream's text deltas (`delta.tool_calls`): the same
parser, so both read an answer alike. Which parser reads an answer follows the job's tool choice:

- `auto`: the serving worker's, named after the format its chat template teaches (`hermes`: `<tool_call>{"name",
  "arguments"}</tool_call>` blocks, as Hermes, Qwen2.5/Qwen3 and kvgate's fallback prompt write them; `llama3`: the
  answer is one or more `{"name", "parameters"}` objects, `;`-separated, as Llama 3.1+ writes them);
- `required`: the answer is constrained to a JSON array of `{"name", "arguments"}` calls (`call_schema`);
- a named function: the answer is constrained to that function's arguments.

A name the request did not declare is not a call: its text stays content. Arguments are JSON text, as OpenAI's are.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
PARSERS = ("hermes", "llama3")  # the formats `auto` can be read in; the worker's --tool-call-parser picks one
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(slots=True, frozen=True)
class Content:
    text: str


@dataclass(slots=True, frozen=True)
class CallDelta:
    index: int  # the call's place in the answer, from 0
    name: str | None  # on the call's first piece only
    arguments: str  # text appended to the call's arguments


Piece = Content | CallDelta


class Parser(Protocol):
    def feed(self, text: str) -> list[Piece]: ...

    def close(self) -> list[Piece]: ...


def call_id(job_id: str, index: int) -> str:
    """A call's id, the same wherever the answer is read (worker, gateway stream, a resumed batch)."""
    return "call_" + hashlib.sha256(f"{job_id}:{index}".encode()).hexdigest()[:24]


def closed(schema: Any) -> Any:
    """`additionalProperties: false` on each object with properties that does not say, as OpenAI's strict mode reads a
    schema: a small model given an open object adds keys until max_tokens cuts it off. Tool arguments and the SDK's
    pydantic response_format (producer/request.py) both close their schemas here."""
    if isinstance(schema, dict):
        schema = {k: closed(v) for k, v in schema.items()}
        if schema.get("type") == "object" and "properties" in schema:
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [closed(v) for v in schema]
    return schema


def parameters_of(parameters: str) -> dict[str, Any]:
    """A function's parameters schema from its wire text ("": it takes none)."""
    return json.loads(parameters) if parameters else {"type": "object", "properties": {}}


def call_schema(functions: list[tuple[str, str]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of `required`: an array of calls (one when not parallel), each `{"name", "arguments"}` of a
    declared function. `functions`: (name, parameters schema text)."""
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": closed(parameters_of(params))},
              "required": ["name", "arguments"], "additionalProperties": False} for name, params in functions]
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    return schema | ({} if parallel else {"maxItems": 1})


def _decoded(text: str) -> Any:
    """JSON text as a value, or None where it is not JSON (a model's text: arrays nested past the interpreter's limit
    are not JSON either, not a crash)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _call(value: Any, names: set[str], keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, or None when it is not a call of a declared function."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = next((value[k] for k in keys if k in value), {})
    return value["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`: held back until the next text decides."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass(slots=True)
class Hermes:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among content. A block whose JSON is not a
    call of a declared function is content; an unclosed block at the end is read as if it were closed. Each piece of
    text is looked at once (a block's pieces are kept as a list, joined when it closes), whatever the cut."""

    names: set[str]
    most: int | None = None  # parallel_tool_calls false: 1, and a later block is content
    held: str = ""  # content that may begin <tool_call>, held until the next text decides
    inside: bool = False
    block: list[str] = field(default_factory=list)  # the open block's text so far
    tail: str = ""  # its last characters, where a </tool_call> cut in two begins
    calls: int = 0

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        while text:
            if not self.inside:
                buf, text = self.held + text, ""
                at = buf.find(OPEN)
                if at < 0:
                    cut = len(buf) - _held(buf, OPEN)
                    if cut:
                        out.append(Content(buf[:cut]))
                    self.held = buf[cut:]
                    return out
                if at:
                    out.append(Content(buf[:at]))
                self.held, self.inside, self.block, self.tail = "", True, [OPEN], ""
                text = buf[at + len(OPEN):]
                continue
            window = self.tail + text
            end = window.find(CLOSE)
            if end < 0:
                self.block.append(text)
                self.tail = window[-(len(CLOSE) - 1):]
                return out
            upto = end + len(CLOSE) - len(self.tail)  # just past </tool_call> in text (it cannot lie in tail alone)
            self.block.append(text[:upto])
            text, raw = text[upto:], "".join(self.block)
            self.inside, self.block, self.tail = False, [], ""
            out += self._block(raw, raw[len(OPEN):-len(CLOSE)])
        return out

    def close(self) -> list[Piece]:
        if self.inside:
            raw = "".join(self.block)
            self.inside, self.block, self.tail = False, [], ""
            return self._block(raw, raw[len(OPEN):])
        held, self.held = self.held, ""
        return [Content(held)] if held else []

    def _block(self, raw: str, body: str) -> list[Piece]:
        call = _call(_decoded(body), self.names, ("arguments", "parameters"))
        if call is None or (self.most is not None and self.calls >= self.most):
            return [Content(raw)]
        self.calls += 1
        return [CallDelta(self.calls - 1, *call)]


@dataclass(slots=True)
class Llama3:
    """An answer that is one or more `{"name": ..., "parameters": {...}}` objects separated by `;` (after an optional
    <|python_tag|>) is calls; any other answer is content, streamed as soon as its first character says so."""

    names: set[str]
    most: int | None = None  # parallel_tool_calls false: 1, and the text after the first call is content
    buf: str = ""  # undecided: the text so far (whitespace and a python tag at most, and one more piece)
    parts: list[str] = field(default_factory=list)  # calls: their text, joined at the end
    mode: str = ""  # "" undecided, "content", "calls"

    def feed(self, text: str) -> list[Piece]:
        if self.mode == "content":
            return [Content(text)] if text else []
        if self.mode == "calls":
            self.parts.append(text)
            return []
        self.buf += text
        if self.mode == "":
            head = self.buf.lstrip().removeprefix(PYTHON_TAG).lstrip()
            if not head or (PYTHON_TAG.startswith(head) and len(head) < len(PYTHON_TAG)):
                return []
            self.mode = "calls" if head.startswith("{") else "content"
            if self.mode == "content":
                out, self.buf = [Content(self.buf)], ""
                return out
            self.parts, self.buf = [self.buf], ""
        return []

    def close(self) -> list[Piece]:
        raw, self.buf, self.parts = self.buf + "".join(self.parts), "", []
        if self.mode != "calls":
            return [Content(raw)] if raw else []
        calls, decoder = [], json.JSONDecoder()
        text, at = raw.strip().removeprefix(PYTHON_TAG), 0
        try:
            while True:
                at = len(text) - len(text[at:].lstrip())
                value, at = decoder.raw_decode(text, at)
                if (call := _call(value, self.names, ("parameters", "arguments"))) is None:
                    return [Content(raw)]
                calls.append(call)
                rest = text[at:].lstrip()
                if not rest:
                    break
                if self.most is not None and len(calls) >= self.most:
                    return [*(CallDelta(i, name, args) for i, (name, args) in enumerate(calls)), Content(text[at:])]
                if not rest.startswith(";"):
                    return [Content(raw)]
                at = len(text) - len(rest) + 1
        except (ValueError, RecursionError):
            return [Content(raw)]
        return [CallDelta(i, name, args) for i, (name, args) in enumerate(calls)]


_STRUCTURE = re.compile(r'[{}\[\]"\\]')  # the characters that open or close a JSON value or a string


@dataclass(slots=True)
class Required:
    """The answer of `required`, constrained to `call_schema`: a JSON array of calls, each going out once its object
    closes. Each piece of text is scanned once (its structure characters only) and kept until its call closes, so the
    cost grows with the text, whatever its cut. What follows the last call and is not the array's end (a call cut off
    by max_tokens) is content; an answer with no call is content."""

    names: set[str]
    pending: list[str] = field(default_factory=list)  # the text since the last call ended
    pending_len: int = 0
    depth: int = 0
    in_string: bool = False
    escaped: bool = False  # the last character scanned was a backslash in a string
    start: int = -1  # where the call being scanned starts in the pending text
    calls: int = 0
    broken: bool = False  # an element that is not a call of a declared function: the rest is content

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        pos = kept = 0  # text[kept:] is not in pending yet
        while not self.broken:
            if self.escaped:
                if pos >= len(text):
                    break
                self.escaped, pos = False, pos + 1
                continue
            m = _STRUCTURE.search(text, pos)
            if m is None:
                break
            c, pos = m.group(), m.end()
            if self.in_string:
                self.escaped, self.in_string = c == "\\", c != '"'
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
                if self.depth == 2 and c == "{":
                    self.start = self.pending_len + m.start() - kept
            else:
                self.depth -= 1
                if self.depth == 1 and c == "}" and self.start >= 0:
                    element = ("".join(self.pending) + text[kept:pos])[self.start:]
                    call = _call(_decoded(element), self.names, ("arguments",))
                    if call is None:
                        self.broken = True
                        break
                    out.append(CallDelta(self.calls, *call))
                    self.calls, self.start, self.pending, self.pending_len, kept = self.calls + 1, -1, [], 0, pos
        self.pending.append(text[kept:])
        self.pending_len += len(text) - kept
        return out

    def close(self) -> list[Piece]:
        rest, self.pending, self.pending_len = "".join(self.pending), [], 0
        return [] if self.calls and rest.strip() == "]" else [Content(rest)] if rest else []


@dataclass(slots=True)
class Named:
    """The answer of a named tool choice, constrained to that function's arguments: one call whose arguments stream as
    the text comes."""

    name: str
    started: bool = False

    def feed(self, text: str) -> list[Piece]:
        if not self.started:
            text = text.lstrip()
            if not text:
                return []
            self.started = True
            return [CallDelta(0, self.name, text)]
        return [CallDelta(0, None, text)] if text else []

    def close(self) -> list[Piece]:
        if self.started:
            return []
        self.started = True
        return [CallDelta(0, self.name, "{}")]


def parser_for(choice: str, function: str, names: list[str], auto: str, parallel: bool = True) -> Parser:
    """The parser of one answer: by the tool choice (`auto`, `required`, `function` with its name), `auto` in the
    serving worker's format (`auto`: hermes or llama3); not `parallel`: an `auto` answer's first call only is a call
    (`required` is held to one by its schema)."""
    if choice == "function":
        return Named(function)
    if choice == "required":
        return Required(set(names))
    most = None if parallel else 1
    if auto == "llama3":
        return Llama3(set(names), most)
    return Hermes(set(names), most)


@dataclass(slots=True)
class Parsed:
    content: str | None  # None where the answer was only calls (and whitespace between them)
    calls: list[tuple[str, str]]  # (name, arguments JSON text), in order


def collect(pieces: list[Piece]) -> Parsed:
    """Pieces joined: the whole content and each call's name and arguments."""
    content, calls = [], {}
    for p in pieces:
        if isinstance(p, Content):
            content.append(p.text)
        else:
            name, args = calls.get(p.index, ("", ""))
            calls[p.index] = (p.name or name, args + p.arguments)
    text = "".join(content)
    return Parsed(None if calls and not text.strip() else text, [calls[i] for i in sorted(calls)])


def parse(parser: Parser, text: str) -> Parsed:
    """A whole answer read by a parser: what its pieces, fed the text in any cut, add up to."""
    return collect([*parser.feed(text), *parser.close()])


# ---- the prompt of a model whose chat template ignores `tools` ------------------------------------------------------

def fallback_system_prompt(tools: list[dict[str, Any]]) -> str:
    """What a chat template that renders no tools is given instead, in a system message: the tools and the hermes
    format to call them in (Qwen2.5's wording), so the `hermes` parser reads the answer."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + listed +
            "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")
