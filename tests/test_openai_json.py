"""Untrusted JSON lines of batch files: a hostile line is that line's error, never an exception that stops the run
(the standard library's parser raised RecursionError and ValueError, which no caller caught)."""
from __future__ import annotations

import json

import pytest

from kvgate.openai.batch import BadLine, custom_id_of, parse_line
from kvgate.producer.bounded_json import BadJson, parse_json

DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"max_tokens": ' + "9" * 5000 + "}}"


@pytest.mark.parametrize("text, says", [(DEEP, "more than 16,384 arrays or objects"), ("[" * 5000 + "]" * 5000,
                                                                                        "nested too deeply"),
                                        (HUGE_INT, "out of range"),
                                        ("{not json", "malformed"), ('{"a": NaN}', "malformed")])
def test_parse_json_names_what_is_wrong(text, says):
    with pytest.raises(BadJson, match=says):
        parse_json(text)
    with pytest.raises(BadJson, match=says):
        parse_json(text.encode())


def test_the_nesting_limit_is_the_same_on_every_python():
    """Before: msgspec's depth limit follows the interpreter's, so 5,000 deep was 'nested too deeply' on 3.11 and a
    decoded document on 3.13 (make test-pythons caught it)."""
    from kvgate.producer.bounded_json import MAX_DEPTH

    assert parse_json("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    assert parse_json(b'{"messages": [' + b'{"content": "x"},' * 2000 + b'{"content": "y"}]}')["messages"][-1] == {
        "content": "y"}  # many objects side by side are not deep
    for text in ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), '{"a": ' * 300 + "1" + "}" * 300):
        with pytest.raises(BadJson, match=f"nested too deeply: more than {MAX_DEPTH}"):
            parse_json(text)


def test_parse_json_takes_ordinary_documents_as_the_standard_library_does():
    assert parse_json(' {"a": [1, 2.5, "x", null, true], "b": {"c": 10000000000000000000000}} ') == {
        "a": [1, 2.5, "x", None, True], "b": {"c": 10**22}}


@pytest.mark.parametrize("line", [DEEP, HUGE_INT], ids=["deep", "5000-digit-int"])
def test_a_hostile_batch_line_is_an_invalid_json_error_line(line):
    with pytest.raises(BadLine) as bad:
        parse_line(3, line, "digest")
    assert bad.value.code == "invalid_json" and "line 3" in str(bad.value)
    assert custom_id_of(line) is None


def test_the_budget_counts_arrays_and_values_outside_strings_only():
    # brackets, commas and colons inside strings (escaped quotes among them) cost nothing to decode: not counted
    text = json.dumps({"prompt": '[{,:"\\' * 200_000, "stop": ["\\", '"]', "a\\\"b"]})
    assert parse_json(text)["prompt"] == '[{,:"\\' * 200_000
    with pytest.raises(BadJson, match="more than 1,048,576 values"):
        parse_json("[" + "1," * (1 << 20) + "1]")
    with pytest.raises(BadJson, match="more than 16,384 arrays or objects"):
        parse_json('{"prompt": "[[[", "x": [' + "[]," * 30_000 + "[]]}")  # 90 KB: past SMALL
    assert len(parse_json("[" + "[1,2,3,4,5,6,7,8,9,10]," * 16_000 + "[]]")) == 16_001  # 350 KB within the budget
