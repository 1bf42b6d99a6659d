"""What the engine hands its callers after a step: the new tokens of one choice."""
from __future__ import annotations

from dataclasses import dataclass


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
