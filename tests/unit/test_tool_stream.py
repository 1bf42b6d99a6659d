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


@pytest.mark.parametrize("mode, name, text", [("auto", "", HERMES), ("required", "", REQUIRED),
                                              ("named", "weather", NAMED)])
def test_any_cut_reassembles_into_the_whole_answers_calls(mode, name, text):
    choice = ToolChoice(TOOLS, mode, name)
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


def test_other_parsers_are_parsed_whole():
    assert not ToolCallStream(ToolChoice(TOOLS, "auto", parser="llama3_json")).streams
    assert ToolCallStream(ToolChoice(TOOLS, "required", parser="llama3_json")).streams
