"""Tool calls in a model's free-form answer (`tool_choice: "auto"`), in the format its chat template teaches.

Each parser takes a finished answer and returns (content, calls): the text around the calls (None when nothing
else is left) and the calls found, each with its arguments as JSON text. An answer without a call in the format is
content only. The names are vLLM's `--tool-call-parser` names:

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number, text around them
                 (Hermes, Qwen2.5 / Qwen3, SmolLM templates)
    llama3_json  the answer is one JSON object {"name": ..., "parameters": {...}}, or several joined by ";",
                 optionally after <|python_tag|> (Llama 3.1 / 3.2 / 3.3 JSON tool calling)
    mistral      [TOOL_CALLS] then a JSON list of {"name": ..., "arguments": {...}} (v3 tokenizers), or
                 [TOOL_CALLS]name[ARGS]{...} once per call (v11 and later)
    pythonic     the answer is a Python list of calls with keyword arguments of literal values,
                 [name(key=value, ...), ...], optionally between <|python_start|> and <|python_end|> (Gemma 3,
                 Llama 3.2 and Llama 4 pythonic templates); read with `ast`, never evaluated
"""
from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str                            # JSON text, as OpenAI sends it
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
MISTRAL_TAG = "[TOOL_CALLS]"
_MISTRAL_ARGS = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*\[ARGS\]", re.DOTALL)


def _call(obj: Any) -> ToolCall | None:
    """A ToolCall from {"name": ..., "arguments" or "parameters": ...}, or None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _calls(objs: Any) -> list[ToolCall]:
    found = [_call(o) for o in (objs if isinstance(objs, list) else [objs])]
    return [c for c in found if c is not None]


def hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for body in _HERMES.findall(text):
        try:
            calls += _calls(json.loads(body))
        except ValueError:
            continue
    if not calls:
        return text, []
    return _HERMES.sub("", text).strip() or None, calls


def llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, end = decoder.raw_decode(body, i)
        except ValueError:
            return text, []                         # not (only) calls: the answer is content
        call = _call(obj)
        if call is None:
            return text, []
        calls.append(call)
        i = end
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return None, calls


def mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    head, sep, rest = text.partition(MISTRAL_TAG)
    if not sep:
        return text, []
    content = head.strip() or None
    if "[ARGS]" in rest:                            # v11: [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
        calls = []
        for part in rest.split(MISTRAL_TAG):
            m = _MISTRAL_ARGS.match(part)
            if m is None:
                continue
            try:
                obj, _ = json.JSONDecoder().raw_decode(part[m.end():].strip())
            except ValueError:
                continue
            calls.append(ToolCall(m.group(1), json.dumps(obj)))
        return (content, calls) if calls else (text, [])
    try:
        obj, _ = json.JSONDecoder().raw_decode(rest.strip())
    except ValueError:
        return text, []
    calls = _calls(obj)
    return (content, calls) if calls else (text, [])


def pythonic(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    if body.startswith(PYTHON_START):
        body = body[len(PYTHON_START):].removesuffix(PYTHON_END).strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                    and all(k.arg for k in node.keywords)):
                return text, []
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            calls.append(ToolCall(node.func.id, json.dumps(args)))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return text, []                             # not a list of calls with literal arguments: content
    return None, calls


PARSERS: dict[str, Callable[[str], tuple[str | None, list[ToolCall]]]] = {
    "hermes": hermes, "llama3_json": llama3_json, "mistral": mistral, "pythonic": pythonic}
