"""A reference greedy loop with vLLM's logits processing, one token at a time over any model's logits, for the
tests to compare the engine and the stack against (written apart from shared/engine/logits_processing.py)."""
from __future__ import annotations

from collections.abc import Callable

import torch


def processed_greedy(next_logits: Callable[[list[int]], torch.Tensor], prompt: list[int], steps: int,
                     bias: dict[int, float] | None = None, presence: float = 0.0, frequency: float = 0.0,
                     repetition: float = 1.0, min_tokens: int = 0, stops: set[int] = frozenset(),
                     bad: list[list[int]] = ()) -> list[int]:
    """next_logits(ids) -> the float64 logits [V] after ids (a tensor the loop may change). vLLM's order: logit
    bias and min_tokens, then the repetition (prompt and output tokens), frequency and presence (output tokens)
    penalties; greedy; a token of `stops` ends the output (and is kept); each token sequence of `bad` is never
    completed (its last token masked where the output ends with the rest)."""
    ids, out = list(prompt), []
    while len(out) < steps:
        logits = next_logits(ids)
        for t, b in (bias or {}).items():
            logits[t] += b
        if len(out) < min_tokens:
            for t in stops:
                logits[t] = float("-inf")
        for word in bad:                                  # the word's last token, where the output ends with the rest
            head = word[:-1]
            if not head or out[-len(head):] == head:
                logits[word[-1]] = float("-inf")
        if repetition != 1.0:
            for t in set(ids):
                logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t in set(out):
            logits[t] -= presence + frequency * out.count(t)
        tok = int(logits.argmax())
        out.append(tok)
        ids.append(tok)
        if tok in stops:
            break
    return out
