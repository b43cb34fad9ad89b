"""Tool-call formats: what a format writes it parses back; what a model garbles comes back as errors."""

from __future__ import annotations

import pytest

from verl.data.tool_parsers import (
    ToolCall,
    parse_hermes,
    parse_llama3_json,
    tool_call_format,
)
from verl.errors import ConfigError

CALLS = [ToolCall("calculator", {"expression": "347*29"}), ToolCall("search", {"q": "ü \"quoted\"", "k": [1, 2]})]


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
@pytest.mark.parametrize("calls", [CALLS[:1], CALLS])
def test_what_a_format_writes_it_parses_back(name, calls):
    fmt = tool_call_format(name)
    parsed = fmt.parse(fmt.format(calls))
    assert parsed.calls == calls and parsed.errors == [] and parsed.wants_tools


def test_hermes_keeps_the_text_around_calls_and_reads_string_arguments():
    text = ('I will compute it.\n<tool_call>\n'
            '{"name": "calculator", "arguments": "{\\"expression\\": \\"1+2\\"}"}\n</tool_call>')
    parsed = parse_hermes(text)
    assert parsed.content == "I will compute it." and parsed.calls == [ToolCall("calculator", {"expression": "1+2"})]
    plain = parse_hermes("The answer is 5.")
    assert plain.content == "The answer is 5." and not plain.wants_tools


@pytest.mark.parametrize("text, says", [
    ("<tool_call>{name: calculator}</tool_call>", "not valid JSON"),
    ('<tool_call>["calculator"]</tool_call>', "must be a JSON object, got list"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'needs a "name" string'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "must be a JSON object, got list"),
    ('<tool_call>{"name": "calculator", "arguments": "not json"}</tool_call>', "a string that is not JSON"),
    ('Sure. <tool_call>{"name": "calculator", "arguments": {}', "not closed with </tool_call>"),
])
def test_hermes_malformed_calls_are_errors_not_exceptions(text, says):
    parsed = parse_hermes(text)
    assert parsed.calls == [] and len(parsed.errors) == 1 and says in parsed.errors[0] and parsed.wants_tools


def test_llama3_json_calls_with_the_python_tag_and_malformed_ones():
    tagged = parse_llama3_json('<|python_tag|>{"name": "calculator", "parameters": {"expression": "2*3"}}')
    assert tagged.calls == [ToolCall("calculator", {"expression": "2*3"})]
    assert not parse_llama3_json("The answer is 6.").wants_tools
    broken = parse_llama3_json('{"name": "calculator", "parameters": {"expression": ')
    assert broken.calls == [] and "not valid JSON" in broken.errors[0]
    half = parse_llama3_json('{"name": "a", "parameters": {}}; {"parameters": {}}')
    assert half.calls == [ToolCall("a", {})] and 'needs a "name"' in half.errors[0]


def test_an_unknown_format_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError,
                       match="unknown tool-call format 'hermse'.*hermes, llama3_json.*Did you mean 'hermes'"):
        tool_call_format("hermse")
