"""What a request asks of the sampler, validated once at the engine's door."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.errors import InvalidRequest


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0                # (0, 1]
    top_k: int = 0                    # 0 = no limit
    seed: int | None = None           # choice i samples with a generator seeded seed + i
    max_tokens: int = 256
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    beam_width: int = 0               # > 1: beam search (greedy over the beams' cumulative log-probability)
    num_speculative_tokens: int | None = None   # K for this request (0 = off, None = the deployment default)
    cache_salt: str = ""              # part of every block hash: requests with different salts never share KV

    def __post_init__(self) -> None:
        if not self.temperature >= 0:      # also catches NaN
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 = no limit), got {self.top_k}")
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.n < 1:
            raise InvalidRequest(f"n must be at least 1, got {self.n}")
        if self.num_speculative_tokens is not None and not 0 <= self.num_speculative_tokens <= 16:
            raise InvalidRequest(f"num_speculative_tokens must be between 0 and 16, got {self.num_speculative_tokens}")
        if self.beam_width < 0 or self.beam_width > 64:
            raise InvalidRequest(f"beam_width must be between 0 and 64, got {self.beam_width}")
        if self.beam_width > 1 and self.n > 1:
            raise InvalidRequest("beam search returns one answer: use n = 1 with beam_width > 1")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequest(f"seed must be in [0, 2^63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        # Below 1e-5 dividing logits by the temperature overflows float32; such a distribution is argmax anyway.
        return self.temperature < 1e-5
