"""A thinking model's reasoning apart from its answer: the text inside `<think>...</think>` (Qwen3, DeepSeek-R1,
SmolLM3) becomes OpenAI-style `reasoning_content`, the rest `content`.

The answer may begin inside the thinking with no opening tag when the chat template put `<think>` at the end of
the prompt (DeepSeek-R1's does); a stream holds back a tail that could still become a tag.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def split(text: str, started: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole or partial answer; `started`: the prompt ended inside thinking."""
    body = text.lstrip()
    if body.startswith(OPEN):
        body, started = body[len(OPEN):], True
    if not started:
        return None, text
    if CLOSE not in body:
        return body.strip(), ""
    reasoning, content = body.split(CLOSE, 1)
    return reasoning.strip(), content.lstrip()


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a rendered chat prompt (its last characters) ends inside thinking: a `<think>` with nothing but
    blanks after it, as the templates of DeepSeek-R1 and of Qwen3's thinking-only models leave it, so the answer
    begins with the reasoning and only closes the tag."""
    _, tag, rest = prompt_tail.rpartition(OPEN)
    return bool(tag) and not rest.strip()


def _held(text: str) -> int:
    """How many trailing characters could be the start of a tag."""
    for tag in (CLOSE, OPEN):
        for k in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:k]):
                return k
    return 0


class Splitter:
    """A choice's streamed text -> (new reasoning, new content) deltas; `finish` flushes what was held back."""

    def __init__(self, started: bool = False) -> None:
        self.text, self.started = "", started
        self.sent_reasoning, self.sent_content = "", ""

    def push(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        held = 0 if final else _held(self.text)
        stripped = self.text.lstrip()
        if not final and not self.started and OPEN.startswith(stripped):
            return "", ""                                    # blank, or maybe the opening tag: wait
        reasoning, content = split(self.text[:len(self.text) - held], self.started)
        reasoning = reasoning or ""
        new_r = reasoning[len(self.sent_reasoning):] if reasoning.startswith(self.sent_reasoning) else ""
        new_c = content[len(self.sent_content):] if content.startswith(self.sent_content) else ""
        self.sent_reasoning += new_r
        self.sent_content += new_c
        return new_r, new_c
