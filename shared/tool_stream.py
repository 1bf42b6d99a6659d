"""Tool calls streamed as they are written: a tool-calling choice's text, pushed piece by piece, becomes OpenAI's
stream deltas: content as it comes, and each call's name as soon as it is complete, then its arguments as they grow
(the concatenated argument pieces are the arguments' JSON text as the model wrote it).

Streamed this way: a named function (the whole answer is its arguments), `"required"` (a JSON list of
{"name", "arguments"}), and in `"auto"` answers each parser's format: Hermes `<tool_call>` blocks, Llama 3 JSON
(an answer that starts with `{` or `<|python_tag|>` is calls, one object after another; any other start is content)
and Mistral (content, then `[TOOL_CALLS]` and a JSON list, or `name[ARGS]{...}` per call). A Llama 3 answer whose
objects turn out not to be calls is sent as content when it ends.

Each push re-reads the text so far (answers are short), so what is sent is always a prefix of what the whole
answer's parse gives; a tag that may be starting at the end of the text is held back until it is decided.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from shared.tool_calls import ToolChoice
from shared.tool_parsers import MISTRAL_TAG, PYTHON_TAG, ToolCall, llama3_json

_OPEN, _CLOSE, _ARGS_TAG = "<tool_call>", "</tool_call>", "[ARGS]"
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_PRIMITIVE = re.compile(r"[^,}\]\s]*")


@dataclass(slots=True)
class _Call:
    name: str | None
    args: str                   # the arguments' text so far


def _value_end(s: str, i: int) -> int | None:
    """The end of the JSON value starting at s[i], or None when it is not complete yet."""
    if i >= len(s):
        return None
    if s[i] in "{[":
        depth, quoted, escaped = 0, False, False
        for j in range(i, len(s)):
            ch = s[j]
            if quoted:
                escaped, quoted = (False, quoted) if escaped else (ch == "\\", ch != '"')
            elif ch == '"':
                quoted = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
        return None
    if s[i] == '"':
        escaped = False
        for j in range(i + 1, len(s)):
            if escaped:
                escaped = False
            elif s[j] == "\\":
                escaped = True
            elif s[j] == '"':
                return j + 1
        return None
    m = _PRIMITIVE.match(s, i)
    return m.end() if m.end() < len(s) else None


def _call_at(s: str) -> _Call:
    """The call a {"name": ..., "arguments": ...} object's text (possibly cut short) describes so far."""
    name = _NAME.search(s)
    args = _ARGS.search(s)
    text = ""
    if args is not None:
        end = _value_end(s, args.end())
        text = s[args.end():end if end is not None else len(s)]
    return _Call(name.group(1) if name else None, text)


def _objects(s: str) -> list[str]:
    """The top-level objects' texts of a JSON list (the last possibly cut short)."""
    i = s.find("[")
    return [] if i < 0 else _run(s, i + 1)


def _run(s: str, i: int) -> list[str]:
    """The texts of the objects one after another from s[i] (the last possibly cut short)."""
    out = []
    while True:
        start = s.find("{", i)
        if start < 0:
            return out
        end = _value_end(s, start)
        out.append(s[start:end if end is not None else len(s)])
        if end is None:
            return out
        i = end


def _held_tag(text: str, tag: str = _OPEN) -> int:
    """How many characters at the end of `text` may be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _llama3(text: str, final: bool) -> tuple[str, list[_Call]]:
    """Llama 3 JSON: calls where the answer starts with { or <|python_tag|>, else content."""
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    elif not final and (not body or PYTHON_TAG.startswith(body)):
        return "", []                                   # undecided yet
    if not body.startswith("{"):
        return ("", []) if not body and not final else (text, [])
    if final and not llama3_json(text)[1]:
        return text, []                                 # objects, but not calls: the answer is content
    return "", [_call_at(o) for o in _run(body, 0)]


def _mistral(text: str, final: bool) -> tuple[str, list[_Call]]:
    """Mistral: content, then [TOOL_CALLS] and a JSON list (v3) or name[ARGS]{...} per call (v11)."""
    head, sep, rest = text.partition(MISTRAL_TAG)
    if not sep:
        return (head if final else head[:len(head) - _held_tag(head, MISTRAL_TAG)]), []
    if rest.lstrip().startswith("["):
        return head, [_call_at(o) for o in _objects(rest)]
    calls = []
    for part in rest.split(MISTRAL_TAG):
        name, found, args = part.partition(_ARGS_TAG)
        if not found:
            calls.append(_Call(None, ""))               # its name is not complete yet
            break
        args = args.lstrip()
        end = _value_end(args, 0)
        calls.append(_Call(name.strip(), args[:end if end is not None else len(args)]))
    return head, calls


@dataclass(slots=True)
class ToolCallStream:
    choice: ToolChoice
    text: str = ""
    content_sent: int = 0                       # characters of content sent
    calls_sent: list[tuple[str, int]] = field(default_factory=list)    # (call id, argument characters sent)

    @property
    def streams(self) -> bool:
        """Whether this choice's calls stream (else the caller parses the whole answer at its end)."""
        return self.choice.mode in ("named", "required") or self.choice.parser in ("hermes", "llama3_json", "mistral")

    def push(self, piece: str, final: bool) -> tuple[str, list[dict]]:
        """The answer's next piece -> (new content, new tool-call deltas)."""
        self.text += piece
        content, calls = self._read(final)
        new_content = content[self.content_sent:]
        self.content_sent = len(content)
        deltas = []
        for i, call in enumerate(calls[:None if self.choice.parallel else 1]):
            if call.name is None:
                break                                   # its name first: nothing of it (or after it) yet
            if i == len(self.calls_sent):
                self.calls_sent.append((ToolCall(call.name, "").as_openai()["id"], 0))
                deltas.append({"index": i, "id": self.calls_sent[i][0], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            sent = self.calls_sent[i][1]
            if len(call.args) > sent:
                deltas.append({"index": i, "function": {"arguments": call.args[sent:]}})
                self.calls_sent[i] = (self.calls_sent[i][0], len(call.args))
        return new_content, deltas

    @property
    def called(self) -> bool:
        return bool(self.calls_sent)

    def _read(self, final: bool) -> tuple[str, list[_Call]]:
        """(content so far, calls so far) of the text so far."""
        if self.choice.mode == "named":
            return "", [_Call(self.choice.name, self.text)]
        if self.choice.mode == "required":
            return "", [_call_at(o) for o in _objects(self.text)]
        if self.choice.parser == "llama3_json":
            return _llama3(self.text, final)
        if self.choice.parser == "mistral":
            return _mistral(self.text, final)
        content, calls, i = [], [], 0
        while True:
            start = self.text.find(_OPEN, i)
            if start < 0:
                tail = self.text[i:]
                content.append(tail if final else tail[:len(tail) - _held_tag(tail)])
                break
            content.append(self.text[i:start])
            end = self.text.find(_CLOSE, start)
            body = self.text[start + len(_OPEN):end if end >= 0 else len(self.text)]
            calls += [_call_at(o) for o in _objects(body)] if body.lstrip().startswith("[") else [_call_at(body)]
            if end < 0:
                break
            i = end + len(_CLOSE)
        return "".join(content), calls
