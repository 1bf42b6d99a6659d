"""Protobuf <-> the draft's plain objects, for the draft's end of a Verify stream."""
from __future__ import annotations

import torch

from services.draft.proposer_service import SeqDelta
from shared import tensor_codec
from shared.engine.proposal import Proposal
from shared.sampling_params import SamplingParams
from upesi.v1 import target_pb2


def deltas_from_pb(req: target_pb2.ProposeRequest) -> list[SeqDelta]:
    """A target step's verdicts -> one SeqDelta per sequence."""
    return [SeqDelta(s.key, s.base, list(s.tokens), s.k,
                     SamplingParams(temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k,
                                    seed=s.seed if s.HasField("seed") else None, max_tokens=1 << 30),
                     hidden_from_pb(s), s.hidden_start, s.chain)
            for s in req.seqs]


def proposals_to_pb(proposals: list[Proposal], wants_hidden: bool) -> target_pb2.ProposeResponse:
    out = target_pb2.ProposeResponse(wants_hidden=wants_hidden)
    for tokens, probs, parents in proposals:
        p = out.proposals.add(tokens=tokens, parents=parents or [])
        if probs is not None and tokens:
            _, shape, p.probs = tensor_codec.encode(probs.float())
            p.vocab = shape[-1]
    return out


def hidden_from_pb(s: target_pb2.DraftSequence) -> torch.Tensor | None:
    """The hidden states a DraftSequence carries -> [rows, dim] float32, or None."""
    if not s.hidden:
        return None
    return tensor_codec.decode("float32", (s.hidden_rows, s.hidden_dim), s.hidden)
