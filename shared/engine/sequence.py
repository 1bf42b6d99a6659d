"""One generated sequence (a request has n of them) and its state in the scheduler."""
from __future__ import annotations

import enum
import itertools
import random

import torch

from shared.sampling_params import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """Tokens of one choice. KV of the first `num_computed_tokens` tokens is in the cache."""

    __slots__ = ("seq_id", "request_id", "index", "token_ids", "num_prompt_tokens", "num_computed_tokens",
                 "params", "status", "block_table", "finish_reason", "generator", "num_cached_tokens",
                 "block_hashes", "num_committed_blocks", "cache_extra", "spec_tokens", "spec_probs", "spec_parents",
                 "spec_k", "num_draft_tokens", "num_accepted_tokens", "trace_ctx", "prefill_start_ns",
                 "num_released_blocks", "long_rope", "guide", "prompt_logprobs", "chain_only", "lookup_k")

    def __init__(self, request_id: str, index: int, prompt: list[int], params: SamplingParams,
                 cache_extra: bytes = b"") -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index
        self.token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.params = params
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []        # hashes of full blocks of token_ids (whether cached or not)
        self.num_committed_blocks = 0            # leading blocks already offered to the prefix cache
        self.num_released_blocks = 0             # leading blocks given back: wholly outside a sliding window
        self.long_rope = False                   # LongRoPE past its window: its KV is on the long factors
        self.cache_extra = cache_extra           # model + cache salt, part of every block hash
        self.spec_tokens: list[int] = []         # draft tokens appended provisionally, verified next step
        self.spec_probs = None                   # their draft probabilities q [K, V], None for point masses
        self.spec_parents: list[int] | None = None   # a draft tree's parent indices (shared.tree); None: chain
        self.spec_k = 0                          # adaptive number of tokens to propose (0 = not decided yet)
        self.lookup_k = 0                        # this step's longest prompt-lookup chain (0: spec_k's)
        self.chain_only = False                  # a draft service's mirror: its target verifies chains only
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.finish_reason: str | None = None
        self.trace_ctx = None                    # the request's OpenTelemetry context (None: not traced)
        self.prefill_start_ns = 0                # tracing: when the prompt began computing (-1: span recorded)
        self.generator: torch.Generator | None = None
        self.guide = None                        # structured output: its grammar state (shared.engine.structured)
        self.prompt_logprobs: list | None = [] if params.prompt_logprobs is not None else None   # position p: token p+1
        if not params.greedy:
            self.generator = torch.Generator()
            seed = params.seed + index if params.seed is not None else random.getrandbits(63)
            self.generator.manual_seed(seed)

    def fork(self) -> "Sequence":
        """A copy with its own id and the same tokens and progress; blocks are shared by BlockManager.fork."""
        child = Sequence(self.request_id, self.index, [], self.params, self.cache_extra)
        child.token_ids = list(self.token_ids)
        child.num_prompt_tokens = self.num_prompt_tokens
        child.long_rope = self.long_rope
        child.trace_ctx, child.prefill_start_ns = self.trace_ctx, -1
        return child

    def drafts_trees(self) -> bool:
        """Whether a draft tree can be verified for this sequence: trees are verified greedily and plainly, so a
        sampled request, or one with logits processing, logprobs or structured output, is drafted chains (trees
        with each node processed along its own path measured slower than chains: docs/negative-results.md)."""
        p = self.params
        return (p.greedy and not p.processed and p.logprobs is None and self.guide is None
                and not self.chain_only)

    def drop_speculation(self) -> None:
        """Forgets unverified draft tokens (when the step cannot verify them: preemption, token budget)."""
        if self.spec_tokens:
            del self.token_ids[len(self.token_ids) - len(self.spec_tokens):]
            self.num_computed_tokens = min(self.num_computed_tokens, len(self.token_ids) - 1)
            self.spec_tokens, self.spec_probs, self.spec_parents = [], None, None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def in_prompt(self) -> bool:
        """Whether its prompt is not computed yet (its next rows are a prefill chunk)."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
