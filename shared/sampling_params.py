"""What a request asks of the sampler, validated once at the engine's door."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from shared.errors import InvalidRequest


GUIDE_KINDS = ("", "json_schema", "json_object", "regex", "choice", "grammar")


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
    tenant: str = ""                  # who sent it ("" = anonymous): waiting requests are admitted fairly by tenant
    # logits processing (shared/engine/logits_processing.py), vLLM's semantics
    presence_penalty: float = 0.0     # [-2, 2]: minus this for every token already in the output
    frequency_penalty: float = 0.0    # [-2, 2]: minus this times the token's count in the output
    repetition_penalty: float = 1.0   # > 0: tokens of prompt or output: positive logits divided, negative multiplied
    min_p: float = 0.0                # [0, 1]: drop tokens below min_p times the most likely one's probability
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit, [-100, 100]
    min_tokens: int = 0               # EOS and stop_token_ids are masked until the output has this many tokens
    bad_words: list[list[int]] = field(default_factory=list)   # token sequences never completed in the output
    logprobs: int | None = None       # per token: the chosen one's log-probability and the top N (0 to 20)
    prompt_logprobs: int | None = None   # each prompt token's log-probability (after the first) and the top N
    # structured output (shared/engine/structured.py): "json_schema" (guide: the schema as JSON), "json_object",
    # "regex", "choice" (guide: a JSON list of strings) or "grammar" (EBNF); "" = none
    guide_kind: str = ""
    guide: str = ""

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
        self._check_processing()

    def _check_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequest(f"{name} must be between -2 and 2, got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 100:
            raise InvalidRequest(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be between 0 and 1, got {self.min_p}")
        if len(self.logit_bias) > 1024:
            raise InvalidRequest(f"logit_bias may name at most 1024 tokens, got {len(self.logit_bias)}")
        for tok, bias in self.logit_bias.items():
            if not (isinstance(tok, int) and tok >= 0):
                raise InvalidRequest(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
            if not -100 <= bias <= 100:
                raise InvalidRequest(f"logit_bias values must be between -100 and 100, got {bias} for token {tok}")
        if len(self.bad_words) > 256 or any(not 0 < len(w) <= 64 for w in self.bad_words):
            raise InvalidRequest("bad_words may hold at most 256 words of 1 to 64 tokens each")
        if any(not (isinstance(t, int) and t >= 0) for w in self.bad_words for t in w):
            raise InvalidRequest("bad_words must be token ids (integers >= 0)")
        if any(not (isinstance(t, int) and t >= 0) for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be token ids (integers >= 0)")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), "
                                 f"got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 20:
                raise InvalidRequest(f"{name} must be between 0 and 20, got {getattr(self, name)}")
        if self.beam_width > 1 and (self.processed or self.logprobs is not None or self.guide_kind
                                    or self.prompt_logprobs is not None):
            raise InvalidRequest("beam search takes no penalties, logit_bias, min_tokens, bad_words, logprobs or "
                                 "structured output")
        self._check_guide()

    def _check_guide(self) -> None:
        if self.guide_kind not in GUIDE_KINDS:
            raise InvalidRequest(f"structured output kind must be one of {', '.join(GUIDE_KINDS[1:])}, "
                                 f"got {self.guide_kind!r}")
        if len(self.guide) > 65536:
            raise InvalidRequest(f"the structured output spec has {len(self.guide)} characters; at most 65536")
        if self.guide_kind not in ("", "json_object") and not self.guide:
            raise InvalidRequest(f"structured output {self.guide_kind} needs its spec")
        if self.guide_kind == "choice":
            try:
                choices = json.loads(self.guide)
            except ValueError:
                choices = None
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise InvalidRequest("a choice needs a non-empty list of non-empty strings")

    @property
    def processed(self) -> bool:
        """Whether the logits are changed before sampling (penalties, logit_bias, min_tokens, bad_words)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.bad_words)

    @property
    def greedy(self) -> bool:
        # Below 1e-5 dividing logits by the temperature overflows float32; such a distribution is argmax anyway.
        return self.temperature < 1e-5
