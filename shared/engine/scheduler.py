"""Continuous batching with chunked prefill.

Each step: every running sequence that is decoding gets its one token, then running sequences still
prefilling get a chunk, then waiting sequences are admitted while the token budget and free blocks
allow. The token budget is max_num_batched_tokens while any sequence decodes (a long prompt's chunks then
share steps with the decodes), and prefill_chunk_tokens while every running sequence is still prefilling
(larger matrix steps reach the first token sooner); with a PrefillPacer, the prompt tokens of a step with
decodes are as many as it measures affordable. Sequences join and leave between steps. When a
decoding sequence needs a block and none is free, the newest running sequence is preempted (its blocks
freed, recomputed later from its tokens).

Waiting sequences are admitted first come, first served within a tenant (SamplingParams.tenant: an API key), and
across tenants the one with the fewest running sequences goes first: one tenant's flood queues behind itself, not in
front of another tenant's request.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shared.engine.prefill_pacer import PrefillPacer
from shared.engine.sequence import Sequence, Status
from shared.kv.block_manager import BlockManager


@dataclass(slots=True)
class ScheduledBatch:
    """Sequences to run this step and how many new tokens each computes; decodes (1 token) first."""
    seqs: list[Sequence]
    num_tokens: list[int]
    num_decodes: int

    def prompt_split(self) -> tuple[int, int]:
        """(sequences past their prompt, prompt tokens) of the batch, read before the step runs."""
        prompt = [n for s, n in zip(self.seqs, self.num_tokens) if s.in_prompt]
        return len(self.seqs) - len(prompt), sum(prompt)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_chunk_tokens: int | None = None, pacer: PrefillPacer | None = None) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # while no sequence decodes, a step may take this many prompt tokens: fewer, larger matrix steps
        self.prefill_chunk_tokens = max(prefill_chunk_tokens or 0, max_num_batched_tokens)
        self.pacer = pacer                  # beside decodes, prompts take the tokens it measures affordable
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        past = [s for s in self.running if not s.in_prompt]
        if not past:
            budget = max(budget, self.prefill_chunk_tokens)     # nothing decodes: prompts alone, longer chunks
        elif self.pacer is not None and (paced := self.pacer.budget()) is not None:
            budget = min(budget, sum(s.num_uncomputed for s in past) + paced)
        decodes: list[Sequence] = []
        chunks: list[tuple[Sequence, int]] = []
        # 1. running sequences, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_uncomputed == 0:           # a beam waiting for the rest of its group: nothing to compute
                i += 1
                continue
            n = min(seq.num_uncomputed, budget)
            if seq.spec_tokens and n < seq.num_uncomputed:   # a verification runs whole or not at all
                seq.drop_speculation()
                n = 1
            while not self.blocks.can_append(seq, seq.num_computed_tokens + n):
                if seq.spec_tokens:                 # its drafts go before any sequence is preempted for them
                    seq.drop_speculation()
                    n = 1
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.append(seq, seq.num_computed_tokens + n)
                (decodes.append(seq) if n == 1 and seq.num_uncomputed == 1 else chunks.append((seq, n)))
                budget -= n
                i += 1
                continue
            break
        # 2. admit waiting sequences while there is room, fairly across tenants.
        counts: dict[str, int] | None = None
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if counts is None:
                counts = {}
                for s in self.running:
                    counts[s.params.tenant] = counts.get(s.params.tenant, 0) + 1
            i = self._pick(counts)
            seq = self.waiting[i]
            if not self.blocks.can_allocate(seq):
                break
            del self.waiting[i]
            counts[seq.params.tenant] = counts.get(seq.params.tenant, 0) + 1
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            (decodes.append(seq) if seq.num_uncomputed == 1 else chunks.append((seq, n)))
            budget -= n
        return ScheduledBatch(decodes + [s for s, _ in chunks], [1] * len(decodes) + [n for _, n in chunks],
                              len(decodes))

    def _pick(self, running: dict[str, int]) -> int:
        """The index in `waiting` of the next sequence to admit: each tenant's first waiting sequence is a candidate;
        the one whose tenant runs the fewest sequences wins, the earliest on ties."""
        best_i, best = 0, running.get(self.waiting[0].params.tenant, 0)
        if best == 0 or len(self.waiting) == 1:
            return 0
        seen = {self.waiting[0].params.tenant}
        for i, s in enumerate(self.waiting):
            t = s.params.tenant
            if t in seen:
                continue
            seen.add(t)
            if running.get(t, 0) < best:
                best_i, best = i, running.get(t, 0)
                if best == 0:
                    break
        return best_i

    def start(self, seq: Sequence) -> None:
        """Puts a sequence that already holds its blocks (a fork) straight into the running batch."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def recompute(self, seq: Sequence) -> None:
        """Frees a running sequence's blocks and queues it first to be computed again from its tokens (its KV must
        change: LongRoPE switching to the long factors); not counted as a preemption."""
        seq.drop_speculation()
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.recompute(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence wherever it is and returns its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
