"""Draft proposers for speculative decoding, behind one interface, chosen by name (no if-ladder).

- "ngram": prompt lookup, no weights: the tokens that followed the last earlier occurrence of the sequence's
  final n-gram (n = 3, 2, 1). Proposes point masses (no probabilities).
- "draft-model:PATH": a small Llama-family checkpoint sharing the target's tokenizer, with its own paged KV. It
  keeps a mirror of each target sequence, rolls it back to the accepted tokens before every proposal, and samples
  K tokens with the request's own temperature / top-p / top-k, returning their probabilities q.
- "eagle:PATH": an EAGLE-style head (shared.spec.eagle_proposer) fed with the target's hidden states; a proposer
  that needs them says so with `wants_hidden = True` and receives them through `accept_hidden`.
Shapes: K = draft tokens, V = vocab.
"""
from __future__ import annotations

import torch

from shared.engine.proposal import Proposal
from shared.engine.sampler import greedy_tokens, probs_from_logits
from shared.engine.sequence import Sequence


def prompt_lookup(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens, for n = max_n .. min_n
    (the longest n that occurs); [] when none does."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):       # the latest earlier occurrence
            if tokens[i:i + n] == tail:
                return tokens[i + n:i + n + k]
    return []


class NgramProposer:
    def __init__(self, max_n: int = 3) -> None:
        self.max_n = max_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [Proposal(prompt_lookup(s.token_ids, k, self.max_n)) for s, k in zip(seqs, ks)]

    def release(self, seq_id: int) -> None:
        pass


class DraftModelProposer:
    """A second, smaller model with its own block manager and KV cache."""

    def __init__(self, path: str, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 max_len: int) -> None:
        from shared.engine.model_runner import ModelRunner
        from shared.kv.block_manager import BlockManager
        from shared.model.registry import build_model

        model, cfg = build_model(path, max_len, dtype, device, progress=False)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, cfg, num_blocks, block_size, dtype, device)
        self.mirrors: dict[int, Sequence] = {}
        self.generators: dict[int, torch.Generator] = {}

    def _sync(self, seq: Sequence) -> Sequence:
        """The mirror of `seq`, rolled back to the longest common prefix with the target's tokens."""
        m = self.mirrors.get(seq.seq_id)
        if m is None:
            m = self.mirrors[seq.seq_id] = seq.fork()
            g = torch.Generator()
            g.manual_seed((seq.params.seed if seq.params.seed is not None else seq.seq_id) * 7919 + seq.index + 1)
            self.generators[seq.seq_id] = g
            return m
        common = 0
        for a, b in zip(m.token_ids, seq.token_ids):
            if a != b:
                break
            common += 1
        m.token_ids = list(seq.token_ids)
        m.num_computed_tokens = min(m.num_computed_tokens, common, len(m) - 1)
        self.blocks.trim(m, m.num_computed_tokens)
        return m

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        from shared.engine.scheduler import ScheduledBatch

        mirrors = [self._sync(s) for s in seqs]
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for step in range(max(ks, default=0)):
            live = [i for i, k in enumerate(ks) if step < k]
            for i in live:
                m = mirrors[i]
                if not self.blocks.can_append(m, len(m)):
                    ks[i] = step                                   # out of draft KV: propose fewer
                    continue
                self.blocks.append(m, len(m))
            live = sorted((i for i in live if step < ks[i]), key=lambda i: mirrors[i].num_uncomputed > 1)
            if not live:
                break
            decodes = sum(1 for i in live if mirrors[i].num_uncomputed == 1)   # decodes first, as the runner expects
            batch = ScheduledBatch([mirrors[i] for i in live], [mirrors[i].num_uncomputed for i in live], decodes)
            logits, groups = self.runner.run(batch)                                   # [B, V], one row each
            params = [seqs[i].params for i in live]
            qs = probs_from_logits(logits, torch.tensor([p.temperature if not p.greedy else 1.0 for p in params]),
                                   torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params]))
            greedy = greedy_tokens(logits).tolist()
            for (b, row, _), i in zip(groups, live):
                m, s = mirrors[i], seqs[i]
                m.num_computed_tokens = len(m)
                if s.params.greedy:                   # q is a point mass on the draft's argmax
                    tok = greedy[row]
                    q = torch.nn.functional.one_hot(torch.tensor(tok), logits.shape[-1]).float()
                else:
                    q = qs[row]
                    tok = int(torch.multinomial(q, 1, generator=self.generators[s.seq_id]))
                m.token_ids.append(tok)
                tokens[i].append(tok)
                probs[i].append(q)
        return [Proposal(t, torch.stack(q) if q else None) for t, q in zip(tokens, probs)]

    def release(self, seq_id: int) -> None:
        m = self.mirrors.pop(seq_id, None)
        self.generators.pop(seq_id, None)
        if m is not None:
            self.blocks.free(m)
