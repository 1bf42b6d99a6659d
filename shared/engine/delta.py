"""What the engine hands its callers after a step: the new tokens of one choice."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprob:
    """One token's log-probability under the raw logits, the most likely tokens' (ids, values) and its rank among
    all (1 = the most likely)."""
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
    rank: int = 0


@dataclass(slots=True)
class Delta:
    """New tokens of one choice after one step."""
    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: str | None            # "stop", "length", "abort" or None while running
    num_prompt_tokens: int
    num_cached_tokens: int
    num_draft_tokens: int = 0            # speculative decoding, cumulative for the choice
    num_accepted_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None   # one per token of token_ids, when the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None   # with a choice's first tokens: prompt tokens 1 .. P-1
