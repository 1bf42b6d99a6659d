"""Beam search in the engine's step: each beam's row of logits collected, the group advanced once every beam has
its row (shared.engine.beam.BeamGroup chooses), beams forked or dropped with their blocks."""
from __future__ import annotations

import torch

from shared.engine.beam import BeamGroup
from shared.engine.delta import Delta
from shared.engine.sequence import Sequence


class BeamStepsMixin:
    """Part of LLMEngine (shared.engine.engine): reads its beam groups, scheduler and block manager."""

    def _collect_beams(self, sampled: list[Sequence], rows: list[int], logits: torch.Tensor) -> list[Delta]:
        """Takes the beam-search rows out of `sampled`; advances every group whose beams all have their row."""
        keep, keep_rows, deltas = [], [], []
        for row, seq in zip(rows, sampled):
            group = self.beam_groups.get(seq.request_id)
            if group is None:
                keep.append(seq)
                keep_rows.append(row)
                continue
            group.pending[seq.seq_id] = logits[row].log_softmax(-1)
            if len(group.pending) == len(group.beams):
                deltas.extend(self._advance_beams(seq.request_id, group))
        sampled[:], rows[:] = keep, keep_rows
        return deltas

    def _advance_beams(self, request_id: str, group: BeamGroup) -> list[Delta]:
        logprobs = torch.stack([group.pending.pop(s.seq_id) for s in group.beams])     # [B, V]
        choices = group.advance(logprobs)
        if group.done:
            for seq in group.beams:
                self.scheduler.finish(seq, "abort")
            tokens = group.best()
            reason = "stop" if tokens and tokens[-1] in group.eos_token_ids else "length"
            root = group.beams[0]
            del self.beam_groups[request_id], self.requests[request_id]
            return [Delta(request_id, 0, tokens, reason, root.num_prompt_tokens, root.num_cached_tokens)]
        chosen: set[int] = set()
        beams = []
        for c in choices:                 # a beam chosen again is forked; its blocks are shared until written
            if c.parent.seq_id in chosen:
                child = c.parent.fork()
                self.block_manager.fork(c.parent, child)
                self.scheduler.start(child)
                beams.append(child)
            else:
                chosen.add(c.parent.seq_id)
                beams.append(c.parent)
        for seq in group.beams:
            if seq.seq_id not in chosen:   # a dead beam frees its blocks
                self.scheduler.finish(seq, "abort")
        for seq, c in zip(beams, choices):
            seq.token_ids.append(c.token)
        group.beams, group.scores = beams, [c.score for c in choices]
        self.requests[request_id] = beams
        return []
