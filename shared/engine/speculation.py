"""Speculative decoding in the engine's step: drafts asked of the proposer before the forward pass, verified from
its logits after it (greedy, rejection sampling, or a tree's accepted path), rolled back, and the target's hidden
states handed to proposers that read them."""
from __future__ import annotations

import torch

from shared import telemetry
from shared.engine.delta import Delta
from shared.engine.logits_processing import process, stop_ids, token_logprobs
from shared.engine.rejection import verify_greedy, verify_sampled
from shared.engine.sampler import probs_from_logits
from shared.engine.sequence import Sequence
from shared.tree import compaction, depths, is_chain, walk_greedy


class SpeculationMixin:
    """Part of LLMEngine (shared.engine.engine): reads its proposer, scheduler, block manager and runner."""

    def _k_max(self, seq: Sequence) -> int:
        p = seq.params
        return self.cfg.num_speculative_tokens if p.num_speculative_tokens is None else p.num_speculative_tokens

    def _spec_k(self, seq: Sequence) -> int:
        p = seq.params
        k_max = self._k_max(seq)
        if k_max <= 0 or seq.request_id in self.beam_groups:
            return 0
        if seq.spec_k == 0:
            seq.spec_k = k_max
        return max(0, min(seq.spec_k, k_max, self._spec_room(seq)))

    def _spec_room(self, seq: Sequence) -> int:
        """The most draft tokens the sequence can take this step (its max_tokens, the context window)."""
        room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq)) - 1
        if self.long_rope_after is not None and not seq.long_rope:   # no draft past the switch to the long factors
            room = min(room, self.long_rope_after - len(seq))
        return room

    def _lookup_k(self, seq: Sequence, k: int) -> int:
        """The longest prompt-lookup chain of a sequence whose proposer would draft k: num_lookup_tokens for
        requests that leave K to the deployment (a copied span is accepted far deeper than a head's guesses, and a
        sequence's lookup misses rest it from lookup: shared.spec.lookup), else their own K's k."""
        if seq.params.num_speculative_tokens is not None:
            return k
        return min(self.cfg.num_lookup_tokens, self._spec_room(seq))    # room >= k >= 1

    def _guarded_decodes(self) -> int:
        """With the speculation guard on: the number of sequences, when every one decodes (no prefill, none
        waiting), else 0 (the guard neither decides nor measures such a step)."""
        sched = self.scheduler
        if not self.cfg.speculation_guard or self.proposer is None or sched.waiting:
            return 0
        running = sched.running
        return len(running) if running and all(s.num_uncomputed == 1 for s in running) else 0

    def _propose_step(self) -> tuple[int, bool, bool]:
        """Drafts for this step where the proposer is active, the speculation guard permitting -> (the number of
        decoding sequences the guard measures this step (0: none), whether the guard let the proposer draft,
        whether a step kept from it verifies lookup chains)."""
        guarded = self._guarded_decodes()
        drafting = not guarded or self.spec_guard.speculate(guarded)
        looked = False
        if self.proposer is not None and getattr(self.proposer, "active", True):
            looked = self._propose(plain_default=not drafting, guarded=guarded)
        return guarded, drafting, looked

    def _propose(self, plain_default: bool = False, guarded: int = 0) -> bool:
        """Drafts for the running sequences that speculate this step; `plain_default`: the speculation guard kept
        this step from the proposer, so requests that did not set their own K get prompt lookup's chains alone
        where the proposer has them (a target's mux: the text that repeats costs no draft service) and the guard
        finds them paying (`guarded`: the decoding sequences it measures, 0: not measured), else decode plainly.
        Returns whether lookup's chains alone were taken."""
        limit = self.cfg.speculative_max_seqs
        if limit and len(self.scheduler.running) + len(self.scheduler.waiting) > limit:
            # a big batch: verifying drafts costs more than it saves (plain steps); sequences waiting join the next
            # step, which would be plain, and a proposal now would keep them waiting for it (a burst's first one)
            return False
        lookup = getattr(self.proposer, "propose_lookup", None)
        seqs, ks, looked, looked_ks = [], [], [], []      # for the proposer; for lookup alone
        for seq in self.scheduler.running:
            by_lookup = plain_default and seq.params.num_speculative_tokens is None
            if by_lookup and lookup is None:
                continue
            if seq.num_uncomputed == 1 and not seq.spec_tokens and seq.num_output_tokens > 0:
                k = self._spec_k(seq)
                if k:
                    seq.lookup_k = self._lookup_k(seq, k)
                    (looked if by_lookup else seqs).append(seq)
                    (looked_ks if by_lookup else ks).append(k)
        if not seqs and not looked:
            return False
        took = False
        with telemetry.span_in("propose", telemetry.traced_contexts(seqs + looked),
                               {"upesi.seqs": len(seqs) + len(looked)}):
            proposals = self.proposer.propose(seqs, ks) if seqs else []
            if looked:
                chains = list(lookup(looked, looked_ks))
                took = any(p[0] for p in chains) and (not guarded or self.spec_guard.lookup(guarded))
                if took:
                    proposals = list(proposals) + chains
        for seq, (tokens, probs, parents) in zip(seqs + looked, proposals):
            if is_chain(parents):
                parents = None
            elif not seq.drafts_trees():
                continue                      # a proposer that drafted a tree anyway: this step decodes plainly
            if tokens:
                seq.token_ids.extend(tokens)
                seq.spec_tokens, seq.spec_probs, seq.spec_parents = list(tokens), probs, parents
        return took

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> Delta:
        """logits [K + 1, V] of a sequence that carried K draft tokens: accept, roll back, emit."""
        draft, q, parents = seq.spec_tokens, seq.spec_probs, seq.spec_parents
        base = len(seq) - len(draft)                  # tokens before the drafts
        depth = len(draft)
        if parents is not None:                       # a tree: accept a path, move its KV next to the root
            path, tok = walk_greedy(logits, draft, parents)
            self.runner.move_kv(seq.block_table, [(base - 1 + a, base - 1 + b) for a, b in compaction(path)])
            self.tree_paths[seq.seq_id] = path
            n, depth = len(path), max(depths(parents))
            draft = [draft[a] for a in path]
        else:
            n, tok = self._verify_chain(seq, logits, draft, q, base)
        num_draft = len(seq.spec_tokens)
        del seq.token_ids[base:]
        seq.spec_tokens, seq.spec_probs, seq.spec_parents = [], None, None
        seq.num_draft_tokens += num_draft
        seq.num_accepted_tokens += n
        if seq.trace_ctx is not None and telemetry.ENABLED:
            telemetry.span_between("verify", seq.trace_ctx, self._step_ns,
                                   {"upesi.draft_tokens": num_draft, "upesi.accepted_tokens": n})
        self.stats_draft += num_draft
        self.stats_accepted += n
        if self.cfg.adaptive_speculation:                                # adaptive K (a tree's K is its depth)
            seq.spec_k = min(self._k_max(seq), seq.spec_k + 1) if n == depth else max(1, seq.spec_k - (n == 0))
        emitted = []
        tokens = draft[:n] + ([] if tok is None else [tok])   # None: the grammar ended at the last accepted draft
        for i, t in enumerate(tokens):
            seq.token_ids.append(t)
            emitted.append(t)
            reason = self._finish_reason(seq, t, grammar_ended=i == len(tokens) - 1)
            if reason:
                break
        # a chain's row j predicts the token after j drafts: the raw rows of what was emitted (trees never carry
        # requests that ask for logprobs)
        lps = None if seq.params.logprobs is None else token_logprobs(logits[:len(emitted)], emitted,
                                                                      seq.params.logprobs)
        seq.num_computed_tokens = min(base + n, len(seq) - 1)   # KV of rejected positions is dropped
        self.block_manager.trim(seq)
        self.block_manager.commit(seq)
        if reason:
            self.scheduler.finish(seq, reason)
        return self._delta(seq, emitted, lps)

    def _verify_chain(self, seq: Sequence, logits: torch.Tensor, draft: list[int], q,
                      base: int) -> tuple[int, int | None]:
        """A chain's verdict: (drafts accepted, the token after them), from its rows processed as plain decoding
        would process them (penalties, bias, grammar); the token is None where the grammar ended at the last
        accepted draft (its stop token), after which nothing may follow."""
        p = seq.params
        rows = logits if not p.processed else process(logits, p, seq.token_ids, seq.num_prompt_tokens,
                                                      list(range(base, base + len(logits))),
                                                      stop_ids(p, self.eos_token_ids))
        advanced, end = 0, None
        if seq.guide is not None:                 # each row masked in the state its drafts lead to
            rows = rows.float().clone() if rows is logits else rows
            for j in range(len(rows)):
                seq.guide.apply(rows[j])
                if j == len(draft) or not seq.guide.accept(draft[j]):
                    break                         # rows after a forbidden draft are never reached
                advanced += 1
                if seq.guide.done:                # draft j is the grammar's stop token: the chain ends there
                    end = j + 1
                    draft, rows, q = draft[:end], rows[:end + 1], None if q is None else q[:end]
                    break
        if p.greedy:
            n, tok = verify_greedy(rows, draft)
        else:
            r = len(rows)
            probs = probs_from_logits(rows, torch.full((r,), p.temperature), torch.full((r,), p.top_k),
                                      torch.full((r,), p.top_p), torch.full((r,), p.min_p) if p.min_p else None)
            n, tok = verify_sampled(probs, q, draft, seq.generator)
        if end is not None and n == end:
            return n, None
        if seq.guide is not None:
            seq.guide.rollback(advanced - n)
            seq.guide.accept(tok)
        return n, tok

    def _hidden_starts(self, batch) -> list[int] | None:
        """Where each sequence's rows begin, when the proposer reads the target's hidden states (else None)."""
        if not getattr(self.proposer, "wants_hidden", False):
            return None
        self.runner.capture_hidden()
        return [seq.num_computed_tokens for seq in batch.seqs]

    def _hand_hidden(self, batch, starts: list[int]) -> None:
        """Gives the proposer the hidden states [M, D] of each sequence's positions whose inputs were accepted:
        every computed row of a plain step, the accepted drafts' rows + 1 of a verification (views, no copy)."""
        hidden, row = self.runner.last_hidden, 0                       # [T, D]
        for seq, n, start in zip(batch.seqs, batch.num_tokens, starts):
            keep = min(n, seq.num_computed_tokens - start)
            path = self.tree_paths.pop(seq.seq_id, None)
            if keep > 0 and not seq.is_finished and seq.request_id not in self.beam_groups:
                if 0 < start == seq.num_cached_tokens:                # a prefix-cache hit: its features, cached
                    past = self.runner.cached_hidden(seq.block_table, start)
                    if past is not None:
                        self.proposer.accept_hidden(seq, 0, past)
                rows = hidden[row:row + keep]
                if path is not None:                                   # a tree: the root, then the accepted path
                    rows = hidden[row:row + n][torch.tensor([0] + [1 + a for a in path][:keep - 1])]
                self.proposer.accept_hidden(seq, start, rows)
            row += n
