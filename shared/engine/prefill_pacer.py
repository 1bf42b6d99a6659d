"""How many prompt tokens a step that also carries decodes may take (EngineConfig.prefill_itl_stretch).

A long prompt arriving while other sequences decode is prefilled in chunks that share steps with their decodes. A
chunk of 512 tokens makes such a step ten or more times a decode step, and every running stream waits that long
for its next token. The pacer sizes the chunk by measurement instead: it keeps the seconds of steps that only
decode and the seconds each prompt token adds to a mixed step (exponential averages; attention makes a token at a
later position dearer, and the average follows), and gives a chunk the tokens that fit in (stretch - 1) decode
steps, so the decodes' inter-token time stays near `stretch` times its value without the prompt.
Steps without decodes are not paced (the scheduler's prefill_chunk_tokens applies).
"""
from __future__ import annotations

from dataclasses import dataclass

WEIGHT = 0.25          # weight of a new step in the averages
FLOOR = 16             # fewest prompt tokens a paced step takes (the prompt always moves)


@dataclass(slots=True)
class PrefillPacer:
    stretch: float                     # allowed decode step time, as a multiple of a decode-only step
    ceiling: int                       # most prompt tokens a paced step takes
    decode_s: float | None = None      # a decode-only step, seconds
    token_s: float | None = None       # seconds a prompt token adds to a step with decodes

    def budget(self) -> int | None:
        """Prompt tokens for the next step with decodes, or None until a decode-only step was measured."""
        if self.decode_s is None:
            return None
        if self.token_s is None:
            return FLOOR                   # a small first chunk measures what a token costs
        tokens = (self.stretch - 1) * self.decode_s / max(self.token_s, 1e-9)
        return int(min(max(round(tokens), FLOOR), self.ceiling))

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """A step of `decodes` decoding sequences and `prompt_tokens` prompt tokens took `seconds`."""
        if decodes == 0:
            return
        if prompt_tokens == 0:
            self.decode_s = _average(self.decode_s, seconds)
        elif self.decode_s is not None:
            self.token_s = _average(self.token_s, max(seconds - self.decode_s, 0.0) / prompt_tokens)


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)
