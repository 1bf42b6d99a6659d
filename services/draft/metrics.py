"""The draft service's Prometheus metrics, recorded around each batch of proposals."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.draft.proposer_service import DraftState, SeqDelta
from shared.engine.proposal import Proposal

PROPOSE_SECONDS = Histogram("upesi_draft_propose_seconds", "Time to propose for one target step (all its sequences)",
                            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5))
BATCH_SEQS = Histogram("upesi_draft_batch_sequences", "Sequences per target step",
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
PROPOSED_TOKENS = Counter("upesi_draft_proposed_tokens", "Draft tokens proposed to targets")
RELEASED = Counter("upesi_draft_released_sequences", "Sequences the targets released")
SEQUENCES = Gauge("upesi_draft_sequences", "Target sequences the draft holds state for")
KV_BLOCKS_USED = Gauge("upesi_draft_kv_blocks_used", "KV blocks used by the draft model's own cache")
OPEN_REQUESTS = Gauge("upesi_draft_requests", "Requests this draft is driving now")


def propose(state: DraftState, deltas: list[SeqDelta], released: list[str]) -> list[Proposal]:
    """DraftState.propose, timed and counted."""
    BATCH_SEQS.observe(len(deltas))
    with PROPOSE_SECONDS.time():
        proposals = state.propose(deltas, released)
    PROPOSED_TOKENS.inc(sum(len(p.tokens) for p in proposals))
    RELEASED.inc(len(released))
    held(state)
    return proposals


def release(state: DraftState, keys: list[str]) -> None:
    state.release(keys)
    RELEASED.inc(len(keys))
    held(state)


def held(state: DraftState) -> None:
    seqs, blocks = state.held()
    SEQUENCES.set(seqs)
    KV_BLOCKS_USED.set(blocks)
