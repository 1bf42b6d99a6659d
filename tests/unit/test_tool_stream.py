"""Tool calls streamed piece by piece (shared.tool_stream): for every way of cutting an answer into pieces, the
pieces' content and call deltas reassemble into what the whole answer parses to (the calls' names and arguments,
the content up to surrounding whitespace), each call's name arrives before any of its arguments, and a tag that
may be starting is never sent as content."""
from __future__ import annotations

import json
import random

import pytest

from shared.tool_calls import ToolChoice
from shared.tool_stream import ToolCallStream

TOOLS = [{"type": "function", "function": {"name": n}} for n in ("weather", "time")]
HERMES = ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris \\"centre\\"", "days": [1, 2]}}'
          '\n</tool_call>\n<tool_call>\n{"name": "time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>')
REQUIRED = '[{"name": "weather", "arguments": {"city": "Paris", "n": 3}}, {"name": "time", "arguments": {}}]'
NAMED = '{"city": "Paris", "when": {"day": "today"}}'


def stream(choice: ToolChoice, text: str, cuts: list[int]) -> tuple[str, dict[int, dict], list[dict]]:
    s, content, calls, deltas = ToolCallStream(choice), "", {}, []
    bounds = [0, *cuts, len(text)]
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        piece_content, pieces = s.push(text[a:b], final=k == len(bounds) - 2)
        assert "<tool_c" not in piece_content
        content += piece_content
        deltas += pieces
        for d in pieces:
            call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            if "id" in d:
                assert call["name"] is None and d["function"]["arguments"] == ""
                call["name"] = d["function"]["name"]
            else:
                assert call["name"] is not None                  # the name came first
                call["arguments"] += d["function"]["arguments"]
    return content, calls, deltas


LLAMA3 = ('<|python_tag|>{"name": "weather", "parameters": {"city": "Paris", "days": [1, 2]}}; '
          '{"name": "time", "parameters": {"zone": "UTC"}}')
LLAMA3_BARE = '{"name": "weather", "arguments": {"city": "Rome \\\\ \\"old\\""}}'
MISTRAL = ('Checking.[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris"}}, '
           '{"name": "time", "arguments": {}}]')
MISTRAL_V11 = '[TOOL_CALLS]weather[ARGS]{"city": "Paris", "n": [1]}[TOOL_CALLS]time[ARGS]{}'
CASES = [("auto", "", HERMES, "hermes"), ("required", "", REQUIRED, "hermes"), ("named", "weather", NAMED, "hermes"),
         ("auto", "", LLAMA3, "llama3_json"), ("auto", "", LLAMA3_BARE, "llama3_json"),
         ("auto", "", "The weather is fine.", "llama3_json"), ("auto", "", '{"answer": 42}', "llama3_json"),
         ("auto", "", MISTRAL, "mistral"), ("auto", "", MISTRAL_V11, "mistral"),
         ("auto", "", "No call [TOOL here.", "mistral")]


@pytest.mark.parametrize("mode, name, text, parser", CASES)
def test_any_cut_reassembles_into_the_whole_answers_calls(mode, name, text, parser):
    choice = ToolChoice(TOOLS, mode, name, parser=parser)
    want_content, want_calls = choice.calls(text)
    rng = random.Random(0)
    for trial in range(60):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(len(text) - 1, 30))))
        content, calls, _ = stream(choice, text, cuts if trial else list(range(1, len(text))))
        assert content.strip() == (want_content or "")
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
            [(c.name, json.loads(c.arguments)) for c in want_calls]


def test_arguments_flow_before_the_answer_ends():
    choice = ToolChoice(TOOLS, "auto")
    cut = HERMES.index("Paris")
    s = ToolCallStream(choice)
    content, deltas = s.push(HERMES[:cut], final=False)
    assert content == "Let me look.\n" and deltas[0]["function"]["name"] == "weather"
    assert deltas[-1]["function"]["arguments"] == '{"city": "'       # the arguments so far, not held back


def test_an_answer_without_calls_is_content_and_a_half_tag_is_held_until_decided():
    s = ToolCallStream(ToolChoice(TOOLS, "auto"))
    assert s.push("It is sunny <tool", final=False) == ("It is sunny ", [])
    assert s.push("s are fine.", final=True) == ("<tools are fine.", [])
    assert not s.called


def test_every_parser_streams():
    assert all(ToolCallStream(ToolChoice(TOOLS, "auto", parser=p)).streams for p in ("hermes", "llama3_json",
                                                                                      "mistral"))


def test_llama3_and_mistral_calls_flow_before_the_answer_ends():
    s = ToolCallStream(ToolChoice(TOOLS, "auto", parser="llama3_json"))
    assert s.push("<|python", final=False) == ("", [])                 # undecided: nothing yet
    content, deltas = s.push('_tag|>{"name": "weather", "parameters": {"ci', final=False)
    assert content == "" and deltas[0]["function"]["name"] == "weather"
    assert deltas[-1]["function"]["arguments"] == '{"ci'
    m = ToolCallStream(ToolChoice(TOOLS, "auto", parser="mistral"))
    assert m.push("Checking.[TOOL_", final=False) == ("Checking.", [])   # a marker that may be starting is held
    content, deltas = m.push('CALLS]weather[ARGS]{"city": "Pa', final=False)
    assert content == "" and deltas[0]["function"]["name"] == "weather" and deltas[-1]["function"]["arguments"] == \
        '{"city": "Pa'


def test_llama3_objects_that_are_not_calls_come_out_as_content_at_the_end():
    s = ToolCallStream(ToolChoice(TOOLS, "auto", parser="llama3_json"))
    assert s.push('{"answer": ', final=False) == ("", [])
    assert s.push("42}", final=True) == ('{"answer": 42}', [])
