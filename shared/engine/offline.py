"""The engine's offline API: teacher-forced logits (`score`), hidden states for training draft heads, and
`generate` for tests and benchmarks (a loop over `step`)."""
from __future__ import annotations

import time

import torch

from shared.engine.sequence import Sequence
from shared.errors import InvalidRequest
from shared.sampling_params import SamplingParams


class OfflineMixin:
    """Part of LLMEngine (shared.engine.engine): runs on its block manager and runner."""

    @torch.inference_mode()
    def score(self, token_ids: list[int], cache_salt: str = "") -> torch.Tensor:
        """Teacher-forced logits [T, V] (fp32) of every position of one sequence, through the paged cache (its
        blocks hashed with `cache_salt`)."""
        from shared.engine.scheduler import ScheduledBatch

        seq = Sequence("score", 0, token_ids, SamplingParams(temperature=0, max_tokens=1, cache_salt=cache_salt))
        self._one_pass_rope(seq)
        if not self.block_manager.can_allocate(seq):
            raise InvalidRequest(f"{len(token_ids)} tokens do not fit in the free KV blocks")
        self.block_manager.allocate(seq)
        try:
            self._sync_blocks()
            input_ids, positions, meta, _, _ = self.runner.prepare(ScheduledBatch([seq], [len(seq)], 0))
            hidden = self.runner.model(input_ids, positions, meta, self.runner.kv_caches)    # [T, D]
            return self.runner.model.compute_logits(hidden)                                  # [T, V]
        finally:
            self.block_manager.free(seq)

    @torch.inference_mode()
    def hidden_states(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Teacher-forced last hidden states before the final norm, [T, D] per sequence (no logits), several
        sequences per forward pass (what EAGLE-style heads are trained on)."""
        from shared.engine.scheduler import ScheduledBatch

        self.runner.capture_hidden()
        seqs = [Sequence("hidden", 0, ids, SamplingParams(temperature=0, max_tokens=1)) for ids in sequences]
        for seq in seqs:
            self._one_pass_rope(seq)
        if any(not ids for ids in sequences):
            raise InvalidRequest("an empty sequence has no hidden states")
        allocated = []
        try:
            for seq in seqs:
                if not self.block_manager.can_allocate(seq):
                    raise InvalidRequest(f"{len(seq)} tokens do not fit in the free KV blocks")
                self.block_manager.allocate(seq)
                allocated.append(seq)
            self._sync_blocks()
            input_ids, positions, meta, _, _ = self.runner.prepare(ScheduledBatch(seqs, [len(s) for s in seqs], 0))
            self.runner.model(input_ids, positions, meta, self.runner.kv_caches)             # [T, D]
            return list(self.runner.last_hidden.float().split([len(s) for s in seqs]))
        finally:
            for seq in allocated:
                self.block_manager.free(seq)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[list[list[int]]]:
        """Runs prompts to completion together; returns token ids [prompt][choice]."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        out = {rid: [[] for _ in range(p.n)] for rid, p in zip(ids, plist)}
        while self.has_unfinished():
            for d in self.step():
                if d.request_id in out:
                    out[d.request_id][d.index].extend(d.token_ids)
        return [out[rid] for rid in ids]
