"""Tool calling through the stack with the official openai client: named and required choices enforced by the
grammar (arguments valid for their schema), streamed calls reassembling, later turns with calls and results."""
from __future__ import annotations

import json

import jsonschema
import pytest

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20},
                                                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                         "parameters": {"type": "object", "properties": {
                                             "zone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
                                             "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def check_calls(calls) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_named_tool_choice_calls_that_tool(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                    max_tokens=60, tool_choice={"type": "function",
                                                                "function": {"name": "get_weather"}})
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
    check_calls(msg.tool_calls)


def test_required_tool_choice_calls_some_tool_and_streams_alike(oai):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
              max_tokens=80)
    r = oai.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message.tool_calls)
    streamed: dict[int, dict] = {}
    reasons, pieces = [], 0
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            reasons.append(ch.finish_reason)
            for d in ch.delta.tool_calls or []:
                got = streamed.setdefault(d.index, {"name": "", "arguments": ""})
                got["name"] += d.function.name or ""
                got["arguments"] += d.function.arguments or ""
                pieces += bool(d.function.arguments)
    assert reasons[-1] == "tool_calls"
    assert pieces > len(streamed)                       # arguments arrive as they are written, not whole
    assert [(s["name"], json.loads(s["arguments"])) for s in streamed.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]


def test_a_later_turn_with_the_call_and_its_result(oai):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 14, "sky": "cloudy"}'}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=40)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.choices[0].message.content or r.choices[0].message.tool_calls
    none = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=40)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_auto_answers_with_content_or_valid_calls(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=80)
    msg = r.choices[0].message
    if msg.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        for c in msg.tool_calls:
            assert c.function.name in SCHEMAS and isinstance(json.loads(c.function.arguments), dict)
    else:
        assert msg.content


def test_auto_parses_the_models_own_hermes_calls_plain_and_streamed(oai):
    """tool_choice auto: the answer is the model's own text, and the stack's parser (hermes, the default: the format
    SmolLM2's template teaches) turns its <tool_call> blocks into calls. A regex makes the default model, which
    rarely calls a tool, write text in that format, so the parser runs on what the model generated."""
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}", "unit": "celsius"\}\}' \
           r'\n</tool_call>'
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=80,
              extra_body={"structured_outputs": {"regex": f"{call}(\\n{call})?"}})
    r = oai.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert [c.function.name for c in msg.tool_calls] in (["get_weather"], ["get_weather", "get_weather"])
    check_calls(msg.tool_calls)
    streamed: dict[int, dict] = {}
    reasons, content = [], ""
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            reasons.append(ch.finish_reason)
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                got = streamed.setdefault(d.index, {"name": "", "arguments": ""})
                got["name"] += d.function.name or ""
                got["arguments"] += d.function.arguments or ""
    assert reasons[-1] == "tool_calls" and "<tool_call>" not in content
    assert [(s["name"], json.loads(s["arguments"])) for s in streamed.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]


@pytest.mark.parametrize("kw, words", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tool_choice": "required"}, "no tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "combined"),
])
def test_bad_tool_requests_are_400(oai, kw, words):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kw)
    assert words in e.value.response.json()["error"]["message"]


def test_pydantic_ai_agent_gets_a_validated_object(spec_stack):
    """A structured-output library on the client: pydantic-ai's Agent asks for its output type through a required
    tool call, and gets a validated object back."""
    pytest.importorskip("pydantic_ai", reason="pydantic-ai is a test dependency")
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class City(BaseModel):
        name: str
        country: str
        capital: bool

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"http://127.0.0.1:{spec_stack.http_port}/v1",
                                                           api_key="x"))
    agent = Agent(model, output_type=City, model_settings={"temperature": 0, "max_tokens": 80})
    city = agent.run_sync("Describe Paris.").output
    assert isinstance(city, City) and city.name
