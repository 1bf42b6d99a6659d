"""Tool calling's pure parts: validation of tools and tool_choice, the grammars that enforce a choice, parsing the
Hermes format, and rendering tools for a template that does not know them."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from shared.errors import InvalidRequest
from shared.tool_calls import as_text, tool_choice

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"},
                                                "unit": {"type": "string", "enum": ["c", "f"]}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string"}}, "required": ["zone"]}}}


def test_choices_and_their_grammars():
    assert tool_choice(None, None) is None and tool_choice([], "auto") is None
    assert tool_choice([WEATHER], None).mode == "auto" and tool_choice([WEATHER], "none").guide() == ("", "")
    named = tool_choice([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    kind, spec = named.guide()
    assert (named.mode, named.name, kind) == ("named", "get_time", "json_schema")
    assert json.loads(spec) == TIME["function"]["parameters"]
    kind, spec = tool_choice([WEATHER, TIME], "required").guide()
    schema = json.loads(spec)
    jsonschema.validate([{"name": "get_time", "arguments": {"zone": "UTC"}},
                         {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {}}], schema)      # zone is required
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    one = json.loads(tool_choice([WEATHER], "required", parallel=False).guide()[1])
    assert one["maxItems"] == 1


@pytest.mark.parametrize("tools, choice, words", [
    ([{"type": "function"}], "auto", "tools[0]"),
    ([{"type": "retrieval"}], "auto", "tools[0]"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "no tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "auto", "parameters"),
])
def test_bad_tools_are_refused(tools, choice, words):
    with pytest.raises(InvalidRequest, match=re.escape(words)):
        tool_choice(tools, choice)


def test_parsing_answers():
    auto = tool_choice([WEATHER, TIME], "auto")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    content, calls = auto.calls(text)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert len(tool_choice([WEATHER, TIME], "auto", parallel=False).calls(text)[1]) == 1
    assert auto.calls("No tools needed.") == ("No tools needed.", [])
    assert auto.calls("<tool_call>not json</tool_call>")[1] == []
    listed = auto.calls('<tool_call>[{"name": "get_time", "arguments": {"zone": "UTC"}}]</tool_call>')[1]
    assert listed[0].name == "get_time"
    required = tool_choice([WEATHER], "required")
    content, calls = required.calls('[{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    assert content is None and calls[0].as_openai()["function"] == {"name": "get_weather",
                                                                     "arguments": '{"city": "Rome"}'}
    assert required.calls('[{"name": "get_wea')[1] == []                   # cut short: no call
    named = tool_choice([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert named.calls('{ "city" : "Lima" }')[1][0].arguments == '{"city": "Lima"}'
    call = calls[0].as_openai(index=2)
    assert call["index"] == 2 and call["id"].startswith("call_") and call["type"] == "function"


def test_rendering_for_a_template_without_tools():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'}]
    out = as_text(messages, [WEATHER])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                      '{"city": "Oslo"}}\n</tool_call>'}
    assert out[3] == {"role": "tool", "content": '<tool_response>\n{"temp": 3}\n</tool_response>'}
    assert all(set(m) == {"role", "content"} for m in out)
