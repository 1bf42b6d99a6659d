"""gRPC servicer of the draft service: converts protobuf and calls DraftState."""
from __future__ import annotations

import asyncio

import numpy as np

from services.draft.proposer_service import DraftState, SeqDelta
from shared.engine.sampling_params import SamplingParams
from shared.rpc.errors import map_errors
from upesi.v1 import draft_pb2, draft_pb2_grpc


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, state: DraftState) -> None:
        self.state = state

    @map_errors
    async def Propose(self, request: draft_pb2.ProposeRequest, context) -> draft_pb2.ProposeResponse:
        deltas = [SeqDelta(s.key, s.base, list(s.tokens), s.k,
                           SamplingParams(temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k,
                                          seed=s.seed if s.HasField("seed") else None, max_tokens=1 << 30))
                  for s in request.seqs]
        proposals = await asyncio.to_thread(self.state.propose, deltas, list(request.released))
        out = draft_pb2.ProposeResponse()
        for tokens, probs in proposals:
            p = out.proposals.add(tokens=tokens)
            if probs is not None and tokens:
                arr = probs.float().contiguous().numpy().astype("<f4", copy=False)
                p.probs, p.vocab = arr.tobytes(), arr.shape[-1]
        return out


def probs_from_pb(p: draft_pb2.DraftProposal):
    import torch
    if not p.probs:
        return None
    return torch.from_numpy(np.frombuffer(p.probs, dtype="<f4").reshape(len(p.tokens), p.vocab).copy())
