"""LongRoPE (Phi-3 128k and kin) in the engine: sequences past the original window run on the long factors, as
transformers generates, and their blocks hash apart from the short-factor ones. A no-op for every other model."""
from __future__ import annotations

from shared.engine.sequence import Sequence
from shared.kv.hashing import cache_extra

LONG_ROPE = b"\x00long-rope"        # in the block hashes of sequences on LongRoPE's long factors


class LongRopeMixin:
    """Part of LLMEngine (shared.engine.engine): reads its scheduler and the model's original window."""

    def _past_window(self, length: int) -> bool:
        """Whether `length` tokens lie past LongRoPE's original window (False for every other model)."""
        return self.long_rope_after is not None and length > self.long_rope_after

    def _cache_extra(self, prompt: list[int], cache_salt: str) -> bytes:
        """What a new sequence's block hashes carry besides its tokens: the model, the cache salt, and whether
        LongRoPE puts it on the long factors (a prompt longer than the window)."""
        extra = cache_extra(self.model_cfg.name, cache_salt)
        return extra + LONG_ROPE if self._past_window(len(prompt)) else extra

    def _one_pass_rope(self, seq: Sequence) -> None:
        """A sequence computed in one pass (score, hidden_states): on LongRoPE's long factors when it is longer than
        the window, as transformers' forward over it is."""
        if self._past_window(len(seq)):
            seq.long_rope = True
            seq.cache_extra += LONG_ROPE

    def _switch_long_rope(self) -> None:
        """LongRoPE past its original window, as transformers generates: a sequence whose next input sits past the
        window has its whole KV computed again on the long factors (transformers drops its cache there), once;
        its blocks then hash apart from the short-factor ones."""
        for seq in list(self.scheduler.running):
            if not seq.long_rope and self._past_window(len(seq)):
                self.scheduler.recompute(seq)
                seq.long_rope = True
                seq.cache_extra += LONG_ROPE
                seq.block_hashes = []
