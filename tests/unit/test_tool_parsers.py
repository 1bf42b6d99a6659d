"""Tool calls parsed from free-form answers in each template's format (shared.tool_parsers), as those models write
them, against the calls and content they stand for: arguments come back as JSON text that loads to the same
object; an answer without a well-formed call is content only."""
from __future__ import annotations

import json

import pytest

from shared.tool_calls import ToolChoice
from shared.tool_parsers import PARSERS

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"zone": "Europe/Paris"}


def parsed(parser: str, text: str) -> tuple[str | None, list[tuple[str, object]]]:
    content, calls = PARSERS[parser](text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
               '\n</tool_call>', "Let me check.", [("weather", WEATHER)]),
    ("hermes", '<tool_call>{"name": "weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>\n'
               '<tool_call>{"name": "time", "arguments": {"zone": "Europe/Paris"}}</tool_call>', None,
     [("weather", WEATHER), ("time", TIME)]),
    ("llama3_json", '{"name": "weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
     [("weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "time", "parameters": {"zone": "Europe/Paris"}}', None,
     [("weather", WEATHER), ("time", TIME)]),
    ("mistral", '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "time", "arguments": {"zone": "Europe/Paris"}}]', None,
     [("weather", WEATHER), ("time", TIME)]),
    ("mistral", 'Sure.[TOOL_CALLS]weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]time[ARGS]'
                '{"zone": "Europe/Paris"}', "Sure.", [("weather", WEATHER), ("time", TIME)]),
    ("pythonic", '[weather(city="Paris", unit="celsius"), time(zone="Europe/Paris")]', None,
     [("weather", WEATHER), ("time", TIME)]),
    ("pythonic", '<|python_start|>[weather(city="Paris", unit="celsius")]<|python_end|>', None,
     [("weather", WEATHER)]),
    ("pythonic", '[search(query="x", limit=3, exact=True, tags=["a", None], at={"k": 1.5})]', None,
     [("search", {"query": "x", "limit": 3, "exact": True, "tags": ["a", None], "at": {"k": 1.5}})]),
])
def test_calls_and_content_in_each_format(parser, text, content, calls):
    assert parsed(parser, text) == (content, calls)


@pytest.mark.parametrize("parser, text", [
    ("hermes", "It is sunny in Paris."),
    ("hermes", "<tool_call>{not json}</tool_call>"),
    ("llama3_json", "It is sunny in Paris."),
    ("llama3_json", '{"city": "Paris"}'),                                   # JSON, but not a call
    ("llama3_json", '{"name": "weather", "parameters": {}} and then some words'),
    ("mistral", "It is sunny in Paris."),
    ("mistral", "[TOOL_CALLS] [{broken"),
    ("pythonic", "It is sunny in Paris."),
    ("pythonic", "[1, 2, 3]"),                                              # a list, but not of calls
    ("pythonic", '[weather("Paris")]'),                                     # positional arguments
    ("pythonic", "[weather(city=__import__('os').getcwd())]"),              # not a literal: never run
    ("pythonic", "[weather(**opts)]"),
    ("pythonic", "[" * 5000 + "]" * 5000),
    ("pythonic", "[weather(city='Paris')] and then some words"),
])
def test_answers_without_a_well_formed_call_are_content(parser, text):
    assert parsed(parser, text) == (text, [])


def test_the_choice_uses_its_parser_and_keeps_one_call_unless_parallel():
    tools = [{"type": "function", "function": {"name": n}} for n in ("weather", "time")]
    text = '{"name": "weather", "parameters": {"city": "Paris"}}; {"name": "time", "parameters": {}}'
    assert len(ToolChoice(tools, "auto", parser="llama3_json").calls(text)[1]) == 2
    assert len(ToolChoice(tools, "auto", parallel=False, parser="llama3_json").calls(text)[1]) == 1
    assert ToolChoice(tools, "auto").calls(text) == (text, [])              # hermes: not its format


def test_the_flag_reaches_the_router_and_a_wrong_name_is_refused():
    from services.launcher_commands import router_command
    from services.router.config import RouterConfig
    from services.serve_config import ServeConfig
    cmd = router_command(ServeConfig(tool_call_parser="llama3_json"))
    assert cmd[cmd.index("--tool-call-parser") + 1] == "llama3_json"
    for cfg in (RouterConfig, ServeConfig):
        with pytest.raises(ValueError, match="tool_call_parser"):
            cfg(tool_call_parser="gemma7")
