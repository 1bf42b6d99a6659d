"""Streaming detokenisation that never emits broken UTF-8, and stop strings that may span tokens."""
from __future__ import annotations

from shared.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Decodes a growing list of ids; each `push` returns only text that is final.

    Decodes a short window of recent ids (so cost stays constant per token) and holds back text ending in
    U+FFFD, which means a multi-byte character is still incomplete.
    """

    def __init__(self, tokenizer: Tokenizer, context: list[int] | None = None, skip_special: bool = True) -> None:
        self.tok, self.skip_special = tokenizer, skip_special
        self.ids: list[int] = list(context[-6:]) if context else []
        self.prefix_offset = 0                  # window start
        self.read_offset = len(self.ids)        # ids before this are already emitted

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip_special)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new

    def flush(self) -> str:
        """Text still held back at the end of a sequence (an incomplete character stays as U+FFFD)."""
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip_special)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""


class StopChecker:
    """Finds stop strings in the streamed text; holds back a tail that could still grow into one."""

    def __init__(self, stop: list[str], include: bool = False) -> None:
        self.stop, self.include = [s for s in stop if s], include
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was found). Found: text up to it, the stop string
        included where `include` (the first of the list among those found at the earliest place)."""
        self.pending += text
        found = [(i, k, s) for k, s in enumerate(self.stop) if (i := self.pending.find(s)) >= 0]
        if found:
            cut, _, hit = min(found)
            out, self.pending = self.pending[:cut + (len(hit) if self.include else 0)], ""
            return out, True
        keep = min(self.hold, len(self.pending))
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
