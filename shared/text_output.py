"""From token deltas to text deltas for one choice: detokenise, cut at stop strings, decide finish."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.detokenizer import IncrementalDetokenizer, StopChecker
from shared.tokenizer import Tokenizer


@dataclass(slots=True)
class TextDelta:
    text: str
    token_ids: list[int]
    finish_reason: str | None          # set on the last delta of the choice
    stop_string_hit: bool = False      # the caller must stop generation of this choice


@dataclass
class ChoiceText:
    tokenizer: Tokenizer
    stop: list[str]
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    include_stop: bool = False             # a stop string that ends the text stays in it
    skip_special: bool = True              # special tokens left out of the text

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids, self.skip_special)
        self._stop = StopChecker(self.stop, self.include_stop)

    def push(self, token_ids: list[int], finish_reason: str | None) -> TextDelta:
        if self.finish_reason is not None:          # already ended by a stop string; ignore late tokens
            return TextDelta("", [], None)
        self.token_ids.extend(token_ids)
        raw = self._detok.push(token_ids)
        if finish_reason is not None:
            raw += self._detok.flush()
        text, hit = self._stop.push(raw)
        if hit:
            finish_reason = "stop"
        elif finish_reason is not None:
            text += self._stop.flush()
        self.text += text
        self.finish_reason = finish_reason
        return TextDelta(text, token_ids, finish_reason, hit)
