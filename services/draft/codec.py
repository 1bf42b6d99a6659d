"""Protobuf <-> the draft's plain objects, for both ends of a Verify stream (the target imports this too)."""
from __future__ import annotations

import numpy as np
import torch

from services.draft.proposer_service import SeqDelta
from shared.engine.proposers import Proposal
from shared.engine.sampling_params import InvalidRequest, SamplingParams
from upesi.v1 import target_pb2


def deltas_from_pb(req: target_pb2.ProposeRequest) -> list[SeqDelta]:
    """A target step's verdicts -> one SeqDelta per sequence."""
    return [SeqDelta(s.key, s.base, list(s.tokens), s.k,
                     SamplingParams(temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k,
                                    seed=s.seed if s.HasField("seed") else None, max_tokens=1 << 30),
                     hidden_from_pb(s), s.hidden_start)
            for s in req.seqs]


def proposals_to_pb(proposals: list[Proposal], wants_hidden: bool) -> target_pb2.ProposeResponse:
    out = target_pb2.ProposeResponse(wants_hidden=wants_hidden)
    for tokens, probs, parents in proposals:
        p = out.proposals.add(tokens=tokens, parents=parents or [])
        if probs is not None and tokens:
            arr = probs.float().contiguous().numpy().astype("<f4", copy=False)
            p.probs, p.vocab = arr.tobytes(), arr.shape[-1]
    return out


def hidden_from_pb(s: target_pb2.DraftSequence) -> torch.Tensor | None:
    """The hidden states a DraftSequence carries -> [rows, dim] float32, or None."""
    if not s.hidden:
        return None
    if len(s.hidden) != 4 * s.hidden_rows * s.hidden_dim:
        raise InvalidRequest(f"hidden has {len(s.hidden)} bytes; expected float32 [{s.hidden_rows}, {s.hidden_dim}]")
    return torch.from_numpy(np.frombuffer(s.hidden, dtype="<f4").reshape(s.hidden_rows, s.hidden_dim).copy())


def hidden_to_pb(hidden: torch.Tensor) -> tuple[bytes, int, int]:
    """[rows, dim] tensor -> (raw little-endian float32 bytes, rows, dim)."""
    arr = hidden.detach().float().contiguous().cpu().numpy().astype("<f4", copy=False)
    return arr.tobytes(), arr.shape[0], arr.shape[1]


def probs_from_pb(p: target_pb2.DraftProposal) -> torch.Tensor | None:
    """q [K, V] of a proposal, or None for point masses."""
    if not p.probs:
        return None
    if len(p.probs) != 4 * len(p.tokens) * p.vocab:
        raise InvalidRequest(f"probs has {len(p.probs)} bytes; expected float32 [{len(p.tokens)}, {p.vocab}]")
    return torch.from_numpy(np.frombuffer(p.probs, dtype="<f4").reshape(len(p.tokens), p.vocab).copy())
