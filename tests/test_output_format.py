"""OpenAI's output format in its two spellings, read by one parser (kvgate/openai/shapes.py _output_format): chat's
`response_format` nests the schema under `json_schema`, the Responses API's `text.format` holds it flat. Each
spelling gives the same constraint, and each defect names its own field the way it did before the two parsers
became one (issue 43)."""
from __future__ import annotations

import json

import pytest

from kvgate.openai.shapes import BadStructured, structured_of_body, structured_of_text_format

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def chat(value):
    made = structured_of_body({"response_format": value})
    return None if made is None else made[1]


@pytest.mark.parametrize("nested, flat, made", [
    ({"type": "text"}, {"type": "text"}, None),
    ({"type": "json_object"}, {"type": "json_object"}, {"kind": "json_object"}),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}},
     {"type": "json_schema", "name": "n", "schema": SCHEMA, "strict": True},
     {"kind": "json_schema", "spec": json.dumps(SCHEMA)}),
    ({"type": "json_schema", "json_schema": {"schema": json.dumps(SCHEMA)}},  # a schema as JSON text, as vLLM takes it
     {"type": "json_schema", "schema": json.dumps(SCHEMA)}, {"kind": "json_schema", "spec": json.dumps(SCHEMA)}),
], ids=["text", "json_object", "json_schema", "schema-as-text"])
def test_both_spellings_of_a_format_make_the_same_constraint(nested, flat, made):
    assert chat(nested) == made
    assert structured_of_text_format(flat) == made


@pytest.mark.parametrize("read, value, param, says", [
    (chat, {"type": "xml"}, "response_format",
     'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
     '{"name": ..., "schema": {...}}}'),
    (structured_of_text_format, "json", "text.format",
     'text.format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name": ..., '
     '"schema": {...}}'),
    (chat, {"type": "json_schema", "json_schema": {"name": "n"}}, "response_format.json_schema",
     "response_format json_schema needs json_schema.schema, a JSON schema object"),
    (chat, {"type": "json_schema", "schema": SCHEMA}, "response_format.json_schema",  # text.format's spelling in chat
     "response_format json_schema needs json_schema.schema, a JSON schema object"),
    (structured_of_text_format, {"type": "json_schema", "name": "n"}, "text.format.schema",
     "text.format json_schema needs schema, a JSON schema object"),
    (chat, {"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema",
     "response_format.json_schema.schema must be a JSON schema object, got list"),
    (structured_of_text_format, {"type": "json_schema", "schema": "{not json"}, "text.format.schema",
     "text.format.schema is not valid JSON"),
], ids=["chat-type", "responses-type", "chat-no-schema", "chat-flat-schema", "responses-no-schema", "chat-not-object",
        "responses-bad-json"])
def test_each_defect_names_its_own_field(read, value, param, says):
    with pytest.raises(BadStructured) as caught:
        read(value)
    assert caught.value.param == param and str(caught.value).startswith(says), (caught.value.param, str(caught.value))
