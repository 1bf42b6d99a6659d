"""gRPC servicer of the draft service: converts protobuf and calls DraftState."""
from __future__ import annotations

import asyncio

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

from services.draft.proposer_service import DraftState, SeqDelta
from shared.engine.sampling_params import InvalidRequest, SamplingParams
from shared.rpc.errors import map_errors
from upesi.v1 import draft_pb2, draft_pb2_grpc

PROPOSE_SECONDS = Histogram("upesi_draft_propose_seconds", "Time to answer one Propose call (all its sequences)",
                            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5))
BATCH_SEQS = Histogram("upesi_draft_batch_sequences", "Sequences per Propose call",
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
PROPOSED_TOKENS = Counter("upesi_draft_proposed_tokens", "Draft tokens proposed to targets")
RELEASED = Counter("upesi_draft_released_sequences", "Sequences the targets released")
SEQUENCES = Gauge("upesi_draft_sequences", "Target sequences the draft holds state for")
KV_BLOCKS_USED = Gauge("upesi_draft_kv_blocks_used", "KV blocks used by the draft model's own cache")


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, state: DraftState) -> None:
        self.state = state

    @map_errors
    async def Propose(self, request: draft_pb2.ProposeRequest, context) -> draft_pb2.ProposeResponse:
        deltas = [SeqDelta(s.key, s.base, list(s.tokens), s.k,
                           SamplingParams(temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k,
                                          seed=s.seed if s.HasField("seed") else None, max_tokens=1 << 30),
                           hidden_from_pb(s), s.hidden_start)
                  for s in request.seqs]
        BATCH_SEQS.observe(len(deltas))
        with PROPOSE_SECONDS.time():                # failed calls are timed (and counted) too
            proposals = await asyncio.to_thread(self.state.propose, deltas, list(request.released))
        PROPOSED_TOKENS.inc(sum(len(tokens) for tokens, _ in proposals))
        RELEASED.inc(len(request.released))
        held_seqs, held_blocks = self.state.held()
        SEQUENCES.set(held_seqs)
        KV_BLOCKS_USED.set(held_blocks)
        out = draft_pb2.ProposeResponse(wants_hidden=self.state.wants_hidden)
        for tokens, probs in proposals:
            p = out.proposals.add(tokens=tokens)
            if probs is not None and tokens:
                arr = probs.float().contiguous().numpy().astype("<f4", copy=False)
                p.probs, p.vocab = arr.tobytes(), arr.shape[-1]
        return out


def hidden_from_pb(s: draft_pb2.DraftSequence):
    """The hidden states a DraftSequence carries -> [rows, dim] float32, or None."""
    import torch
    if not s.hidden:
        return None
    if len(s.hidden) != 4 * s.hidden_rows * s.hidden_dim:
        raise InvalidRequest(f"hidden has {len(s.hidden)} bytes; expected float32 [{s.hidden_rows}, {s.hidden_dim}]")
    return torch.from_numpy(np.frombuffer(s.hidden, dtype="<f4").reshape(s.hidden_rows, s.hidden_dim).copy())


def hidden_to_pb(hidden) -> tuple[bytes, int, int]:
    """[rows, dim] tensor -> (raw little-endian float32 bytes, rows, dim)."""
    arr = hidden.detach().float().contiguous().cpu().numpy().astype("<f4", copy=False)
    return arr.tobytes(), arr.shape[0], arr.shape[1]


def probs_from_pb(p: draft_pb2.DraftProposal):
    import torch
    if not p.probs:
        return None
    return torch.from_numpy(np.frombuffer(p.probs, dtype="<f4").reshape(len(p.tokens), p.vocab).copy())
