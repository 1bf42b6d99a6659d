"""The draft's state without protobuf: mirrors of the target's sequences and a local proposer."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from shared.engine.proposal import Proposal, Proposer
from shared.engine.sequence import Sequence
from shared.sampling_params import SamplingParams


@dataclass(slots=True)
class SeqDelta:
    key: str
    base: int
    tokens: list[int]
    k: int
    params: SamplingParams
    hidden: torch.Tensor | None = None       # [M, D] target hidden states of positions hidden_start ..
    hidden_start: int = 0
    chain: bool = False                      # the target verifies only a chain for this sequence


class DraftState:
    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer
        self.wants_hidden = bool(getattr(proposer, "wants_hidden", False))
        self.seqs: dict[str, Sequence] = {}
        self.lock = threading.Lock()                 # one proposer, one batch at a time

    def held(self) -> tuple[int, int]:
        """(sequences mirrored, KV blocks the proposer's own cache uses): both 0 once every target sequence ended."""
        blocks = getattr(self.proposer, "blocks", None)
        return len(self.seqs), blocks.num_used_blocks if blocks is not None else 0

    def release(self, keys: list[str]) -> None:
        """Frees the mirrors (and the proposer's state) of sequences that ended."""
        with self.lock:
            self._release(keys)

    def _release(self, keys: list[str]) -> None:
        for key in keys:
            seq = self.seqs.pop(key, None)
            if seq is not None:
                self.proposer.release(seq.seq_id)

    def propose(self, deltas: list[SeqDelta], released: list[str]) -> list[Proposal]:
        """The proposals for one target step."""
        with self.lock:
            self._release(released)
            if not deltas:
                return []
            seqs = []
            for d in deltas:
                seq = self.seqs.get(d.key)
                if seq is None:
                    seq = self.seqs[d.key] = Sequence(d.key, 0, [], d.params)
                    seq.num_prompt_tokens = 0
                seq.token_ids = seq.token_ids[:d.base] + d.tokens
                seq.chain_only = d.chain
                if self.wants_hidden and d.hidden is not None and len(d.hidden):
                    self.proposer.accept_hidden(seq, d.hidden_start, d.hidden)
                seqs.append(seq)
            with torch.inference_mode():
                return self.proposer.propose(seqs, [d.k for d in deltas])
