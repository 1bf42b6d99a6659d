"""What the engine tells the services that run it, after each step: counters for metrics, and the block events that
the prefix registry publishes. Services read these instead of the engine's block manager and scheduler."""
from __future__ import annotations

from dataclasses import dataclass

from shared.kv.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class EngineCounters:
    kv_blocks_total: int
    kv_blocks_used: int
    running: int                       # sequences in the running batch
    waiting: int                       # sequences waiting to be scheduled
    preemptions: int                   # since start (as the ones below)
    prefix_query_tokens: int           # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int             # ... and found there (or in the block store)
    draft_tokens: int                  # speculative tokens proposed
    accepted_tokens: int               # ... and accepted
    last_step_s: float                 # the last step's duration


class StatsMixin:
    """Part of LLMEngine (shared.engine.engine)."""

    def counters(self) -> EngineCounters:
        bm, sch = self.block_manager, self.scheduler
        return EngineCounters(bm.num_blocks, bm.num_used_blocks, len(sch.running), len(sch.waiting),
                              sch.num_preemptions, bm.query_tokens, bm.hit_tokens, self.stats_draft,
                              self.stats_accepted, self.last_step_s)

    def drain_block_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """The block hashes committed (stored) and evicted (removed) since the last call, for the prefix registry."""
        return self.block_manager.drain_events()
