"""Tool calling: OpenAI's `tools` and `tool_choice` as prompts, grammars and parsed calls.

- `tool_choice: "required"` and a named function are enforced by a grammar (shared/engine/structured.py): the
  answer is a JSON list of calls, or the named function's arguments, so arguments always fit their schema.
- `"auto"` lets the model choose; its calls are parsed in the format its template teaches (shared/tool_parsers.py:
  Hermes, the default, as Qwen2.5, Qwen3 and SmolLM templates use; Llama 3 JSON; Mistral), and the text around
  them is the content.
- A chat template that does not render `tools` itself gets them in a system message in that format, and earlier
  assistant calls and tool results become text it can render.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shared.errors import InvalidRequest
from shared.tool_parsers import PARSERS, ToolCall

MAX_TOOLS = 128
__all__ = ["MAX_TOOLS", "ToolCall", "ToolChoice", "as_text", "system_prompt", "tool_choice"]


@dataclass(slots=True)
class ToolChoice:
    """The request's tools and how they may be called: mode "none", "auto", "required" or "named"."""
    tools: list[dict]
    mode: str
    name: str = ""
    parallel: bool = True                     # more than one call an answer
    parser: str = "hermes"                    # the format of calls in an "auto" answer (shared.tool_parsers)

    def guide(self) -> tuple[str, str]:
        """(guide kind, spec) that enforces the choice; ("", "") for none and auto."""
        if self.mode == "named":
            return "json_schema", json.dumps(self.parameters(self.name))
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                       "arguments": self.parameters(t["function"]["name"])},
                      "required": ["name", "arguments"]} for t in self.tools]
            return "json_schema", json.dumps({"type": "array", "minItems": 1, "items": {"anyOf": calls},
                                              **({} if self.parallel else {"maxItems": 1})})
        return "", ""

    def parameters(self, name: str) -> dict:
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters") or {"type": "object"}

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished answer."""
        if self.mode == "named":
            return None, [ToolCall(self.name, _compact(text))]
        if self.mode == "required":
            try:
                found = json.loads(text)
            except ValueError:
                return text, []                       # cut short by max_tokens: no valid call to report
            return None, [ToolCall(c["name"], json.dumps(c["arguments"])) for c in found]
        if self.mode == "auto":
            content, calls = PARSERS[self.parser](text)
            if calls:
                return content, calls if self.parallel else calls[:1]
        return text, []


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text))
    except ValueError:
        return text


def tool_choice(tools: Any, choice: Any, parallel: bool = True) -> ToolChoice | None:
    """Validates OpenAI's `tools` and `tool_choice`; None when the request has no tools."""
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice names a tool but the request has no tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools must be a list of at most {MAX_TOOLS} functions")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                                 '"parameters": {...}}}}')
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(fn["name"])
    if choice is None or choice in ("auto", "none", "required"):
        return ToolChoice(tools, choice or "auto", parallel=parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and name in names):
        raise InvalidRequest(f'tool_choice must be "none", "auto", "required" or {{"type": "function", '
                             f'"function": {{"name": one of {names}}}}}')
    return ToolChoice(tools, "named", name, parallel)


def system_prompt(tools: list[dict]) -> str:
    """The tools in the Hermes format, for a chat template that does not render them."""
    lines = "\n".join(json.dumps(t["function"]) for t in tools)
    return ("You may call one or more functions to assist with the user query.\n\nYou are provided with function "
            f"signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\nFor each function call, "
            "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def as_text(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages for a template that knows no tools: the tools in the system message, assistant calls and tool
    results as text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            text = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                          "arguments": _loads(c["function"].get("arguments"))})
                             + "\n</tool_call>" for c in calls)
            m = {"role": m["role"], "content": ((m.get("content") or "") + "\n" + text).strip()}
        elif m.get("role") == "tool":
            m = {"role": "tool", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system_prompt(tools)}
        else:
            out.insert(0, {"role": "system", "content": system_prompt(tools)})
    return out


def _loads(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments
