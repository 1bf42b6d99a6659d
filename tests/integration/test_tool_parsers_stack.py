"""Each tool-call parser on the default model's own generation: `upesi serve --tool-call-parser NAME`, a chat
request with tools and tool_choice auto, and a regex that makes the model write one call in that parser's format
(the default model writes hermes calls of its own accord, tests/integration/test_openai_tools.py). The router must
turn the text the model generated into the call, whole and streamed."""
from __future__ import annotations

import json

import pytest

from shared.testing.stack import Stack

pytestmark = pytest.mark.slow
CITY = '"[A-Z][a-z]{2,9}"'
FORMATS = {
    "llama3_json": r'\{"name": "get_weather", "parameters": \{"city": ' + CITY + r', "unit": "celsius"\}\}',
    "mistral": r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": ' + CITY
               + r', "unit": "celsius"\}\}\]',
    "pythonic": r'\[get_weather\(city=' + CITY + r', unit="celsius"\)\]',
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "unit": {"type": "string"}},
                                                "required": ["city", "unit"]}}}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def parser_stack(request, tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp(f"tools-{request.param}"), ["--dtype", "float32",
                                                                   "--tool-call-parser", request.param])
    try:
        s.wait_ready()
        yield request.param, s
    finally:
        assert s.stop() == 0, s.log.read_text()[-3000:]


def ask(stack, stream: bool, regex: str) -> tuple[str | None, list[tuple[str, dict]], str]:
    """(content, calls, finish reason) of one greedy answer written under the regex."""
    import urllib.request
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [WEATHER],
            "tool_choice": "auto", "temperature": 0, "max_tokens": 60, "stream": stream,
            "structured_outputs": {"regex": regex}}
    req = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        raw = r.read().decode()
    if not stream:
        choice = json.loads(raw)["choices"][0]
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in choice["message"].get("tool_calls") or []]
        return choice["message"]["content"], calls, choice["finish_reason"]
    content, calls, reason = "", {}, None
    for line in raw.splitlines():
        if not line.startswith("data: {"):
            continue
        for ch in json.loads(line[6:])["choices"]:
            content += ch["delta"].get("content") or ""
            reason = ch["finish_reason"] or reason
            for d in ch["delta"].get("tool_calls") or []:
                got = calls.setdefault(d["index"], {"name": "", "arguments": ""})
                got["name"] += d["function"].get("name") or ""
                got["arguments"] += d["function"].get("arguments") or ""
    return content or None, [(c["name"], json.loads(c["arguments"])) for c in calls.values()], reason


def test_the_models_own_call_in_each_format(parser_stack):
    parser, stack = parser_stack
    content, calls, reason = ask(stack, False, FORMATS[parser])
    assert reason == "tool_calls" and content is None
    assert [name for name, _ in calls] == ["get_weather"] and calls[0][1]["unit"] == "celsius"
    assert calls[0][1]["city"][0].isupper()
    assert ask(stack, True, FORMATS[parser]) == (content, calls, reason)
