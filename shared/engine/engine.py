"""The in-process engine: requests in, token deltas out, one continuous-batching step at a time.

Single-threaded by design: the target service drives it from one thread (shared.engine.async_engine),
tests and benchmarks call it directly (`generate`).
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from shared import telemetry
from shared.engine.beam import BeamGroup
from shared.engine.config import WIDE_ROWS, EngineConfig
from shared.engine.model_runner import ModelRunner, kv_cache_layout
from shared.engine.proposal import ProposerFactory
from shared.engine.rejection import verify_greedy, verify_sampled
from shared.engine.sampler import probs_from_logits, sample
from shared.engine.scheduler import Scheduler
from shared.engine.sequence import Sequence
from shared.errors import InvalidRequest, NotConfigured
from shared.kv.block_codec import BlockData, BlockLayout, model_fingerprint
from shared.kv.block_manager import BlockManager
from shared.kv.block_store import open_block_store
from shared.kv.hashing import BlockHash, cache_extra, hash_chain
from shared.model.loader import load_config
from shared.model.registry import build_model, check_architecture
from shared.model_files import resolve_model_path
from shared.quant.model_quant import set_act_quant
from shared.sampling_params import SamplingParams
from shared.tree import compaction, depths, is_chain, walk_greedy

log = logging.getLogger(__name__)
LONG_ROPE = b"\x00long-rope"        # in the block hashes of sequences on LongRoPE's long factors


@dataclass(slots=True)
class Delta:
    """New tokens of one choice after one step."""
    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: str | None            # "stop", "length", "abort" or None while running
    num_prompt_tokens: int
    num_cached_tokens: int
    num_draft_tokens: int = 0            # speculative decoding, cumulative for the choice
    num_accepted_tokens: int = 0


class LLMEngine:
    def __init__(self, cfg: EngineConfig, make_proposer: ProposerFactory | None = None) -> None:
        self.cfg = cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.threads = cfg.num_threads or torch.get_num_threads()    # of one-row (decode) steps
        self.model_path = resolve_model_path(cfg.model)
        device, dtype = cfg.torch_device(), cfg.torch_dtype()
        check_architecture(self.model_path)
        window = load_config(self.model_path, cfg.hf_overrides).max_position_embeddings
        self.max_model_len = min(cfg.max_model_len or window, window)
        model, self.model_cfg = build_model(self.model_path, self.max_model_len, dtype, device, cfg.progress,
                                            cfg.hf_overrides, packed=not cfg.dequantise_gguf)
        if cfg.nvfp4_act_quant and not set_act_quant(model, True):
            raise ValueError(f"W4A4 was asked for but {self.model_path} has no NVFP4 layers (quantize it first)")
        per_block = ModelRunner.kv_bytes_per_block(self.model_cfg, cfg.block_size, dtype, model)
        num_blocks = cfg.num_kv_blocks or max(1, int(cfg.kv_cache_gb * 2**30) // per_block)
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.model_cfg, num_blocks, cfg.block_size, dtype, device)
        self.long_rope_after: int | None = getattr(model, "long_rope_after", None)   # LongRoPE's original window
        kvh, dh, shared = kv_cache_layout(model, self.model_cfg)
        # what a block's bytes mean, for the block store and for blocks sent to or received from another target
        self.block_layout = BlockLayout(model_fingerprint(model, repr(self.model_cfg), dtype), dtype,
                                        self.model_cfg.num_layers, cfg.block_size, kvh, dh, shared,
                                        self.model_cfg.hidden_size)
        self.kv_store = None
        if cfg.kv_store or cfg.kv_host_gb > 0 or cfg.kv_disk_dir:
            self.kv_store = open_block_store(self.block_layout, cfg.kv_store, cfg.kv_store_gb, cfg.kv_store_ttl_s,
                                             cfg.kv_host_gb, cfg.kv_disk_dir, cfg.kv_disk_gb,
                                             cfg.kv_store_write_policy, cfg.kv_store_write_threshold)
        if self.kv_store is not None:
            self.block_manager.source = self.kv_store
            self.block_manager.track_evictions = self.kv_store.wants_evictions
            self.block_manager.track_commits = self.kv_store.wants_commits
            self.block_manager.track_reuse = self.kv_store.wants_reuse
        # Every layer attends a sliding window (Mistral v0.1, Phi-3): blocks behind it go back to the pool.
        windows = [getattr(getattr(layer, "self_attn", None), "window", None) for layer in getattr(model, "layers", [])]
        self.window = min(windows) if windows and all(windows) else None
        self.eos_token_ids = set(self.model_cfg.eos_token_ids)
        if cfg.speculative and make_proposer is None:
            raise ValueError(f"speculative={cfg.speculative!r} needs a proposer factory: build the engine with "
                             "shared.spec.factory.build_engine")
        self.proposer = make_proposer(cfg, model, self.max_model_len) if cfg.speculative and make_proposer else None
        self.requests: dict[str, list[Sequence]] = {}
        self.pending_forks: dict[int, list[Sequence]] = {}      # choice 0's seq_id -> choices 1..n-1
        self.beam_groups: dict[str, BeamGroup] = {}              # request id -> its beam search
        self.stats_draft = self.stats_accepted = 0               # speculative tokens proposed / accepted
        self.trace_parents: dict[str, object] = {}               # request id -> trace context, set by the caller
        self.tree_paths: dict[int, list[int]] = {}               # seq_id -> this step's accepted tree nodes
        self._step_ns = 0                                        # tracing: when this step began
        self.last_step_s = 0.0

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        trace_ctx = self.trace_parents.pop(request_id, None) if self.trace_parents else None
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already running")
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        vocab = self.model_cfg.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens but the context window is "
                                 f"{self.max_model_len}; shorten it by at least {len(prompt) - self.max_model_len + 1}")
        need = self.block_manager.blocks_for(len(prompt) + 1)
        if need > self.block_manager.num_blocks:
            raise InvalidRequest(f"the prompt needs {need} KV blocks but the cache has only "
                                 f"{self.block_manager.num_blocks} in all (block size {self.cfg.block_size})")
        long_rope = self._past_window(len(prompt))
        seqs = [Sequence(request_id, i, prompt, params, self._cache_extra(prompt, params.cache_salt))
                for i in range(params.n)]
        for s in seqs:
            s.long_rope, s.trace_ctx = long_rope, trace_ctx
        self.requests[request_id] = seqs
        self.scheduler.add(seqs[0])
        if params.beam_width > 1:
            self.beam_groups[request_id] = BeamGroup(
                params.beam_width, min(params.max_tokens, self.max_model_len - len(prompt)),
                set() if params.ignore_eos else self.eos_token_ids | set(params.stop_token_ids), beams=seqs)
        if params.n > 1:                     # the other choices fork from choice 0 once its prompt is computed
            self.pending_forks[seqs[0].seq_id] = seqs[1:]

    def abort(self, request_id: str, indices: list[int] | None = None) -> list[Delta]:
        """Stops some or all choices of a request; returns their final deltas."""
        if self.beam_groups.pop(request_id, None) is not None:
            indices = None                                # a beam search stops as a whole
        out = []
        for seq in self.requests.get(request_id, []):
            if not seq.is_finished and (not indices or seq.index in indices):
                self.scheduler.finish(seq, "abort")
                out.append(self._delta(seq, []))
        for seq in self.requests.get(request_id, [])[:1]:
            alive = [c for c in self.pending_forks.get(seq.seq_id, []) if not c.is_finished]
            if seq.is_finished and alive:        # choice 0 went before forking: the next choice takes its place
                del self.pending_forks[seq.seq_id]
                self.scheduler.add(alive[0])
                if alive[1:]:
                    self.pending_forks[alive[0].seq_id] = alive[1:]
        self._forget_finished(request_id)
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---------------------------------------------------------------- one step
    def step(self) -> list[Delta]:
        if self.long_rope_after is not None:
            self._switch_long_rope()
        if self.proposer is not None and getattr(self.proposer, "active", True):
            self._propose()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        t0 = time.perf_counter()
        bm = self.block_manager
        self._sync_blocks()
        hidden_from = self._hidden_starts(batch)
        traced = telemetry.traced_contexts(batch.seqs)
        if traced:
            self._step_ns = telemetry.now_ns()
            telemetry.prefill_starting(batch.seqs)
        with telemetry.step_scope(traced), self._step_threads(sum(batch.num_tokens)):
            logits, groups = self.runner.run(batch)      # expert dispatch spans (parent: the first traced request)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            if not seq.spec_tokens:
                bm.commit(seq)                           # verified sequences commit after their rollback
        if traced:
            telemetry.prefill_done(batch.seqs)
        sampled, rows, deltas = [], [], []
        for b, row, count in groups:
            seq = batch.seqs[b]
            if seq.spec_tokens:
                deltas.append(self._verify(seq, logits[row:row + count]))
            else:
                sampled.append(seq)
                rows.append(row)
        deltas += self._collect_beams(sampled, rows, logits)   # beam sequences leave `sampled` here
        for row, parent in zip(list(rows), list(sampled)):
            for child in self.pending_forks.pop(parent.seq_id, []):
                if child.is_finished:
                    continue
                bm.fork(parent, child)                   # shares the prompt's blocks (copy-on-write later)
                self.scheduler.start(child)
                sampled.append(child)
                rows.append(row)                         # same next-token distribution, own generator
        if not sampled:
            tokens = []
        elif rows == list(range(logits.shape[0])):       # one row per sequence, in order: no copy of the logits
            tokens = sample(logits, sampled)
        else:
            tokens = sample(logits[rows], sampled)
        for seq, tok in zip(sampled, tokens):
            seq.token_ids.append(tok)
            reason = self._finish_reason(seq, tok)
            if reason:
                self.scheduler.finish(seq, reason)
            deltas.append(self._delta(seq, [tok]))
        if hidden_from is not None:
            self._hand_hidden(batch, hidden_from)
        self.tree_paths.clear()
        for rid in {d.request_id for d in deltas if d.finish_reason}:
            self._forget_finished(rid)
        if self.window:                                  # after rollbacks: the next rows sit at or after this
            for seq in batch.seqs:
                if seq.block_table:
                    bm.release_before(seq, seq.num_computed_tokens - self.window + 1)
        self.last_step_s = time.perf_counter() - t0
        if self.kv_store is not None:
            self._store_commits()
            self.kv_store.cost.observe_prefill(sum(batch.num_tokens), self.last_step_s)
        return deltas

    def _sync_blocks(self) -> None:
        """Before a forward pass writes the cache: evicted blocks out to the store, copy-on-write copies, blocks
        read from the store in."""
        bm = self.block_manager
        if bm.evictions:
            blocks = [b for b, _ in bm.evictions]
            self.kv_store.evicted([(h, BlockData(kv.clone(), None if hid is None else hid.clone()))
                                   for (_, h), (kv, hid) in zip(bm.evictions, self.runner.read_blocks(blocks))])
            bm.evictions.clear()
        self.runner.copy_blocks(bm.pending_copies)
        bm.pending_copies.clear()
        if bm.imports:
            self.runner.write_blocks([b for b, _ in bm.imports], [(d.kv, d.hidden) for _, d in bm.imports])
            bm.imports.clear()

    def _store_commits(self) -> None:
        """Blocks this step filled, or (write_through_selective) that a new sequence matched in the cache and the
        store does not have yet: copied out for the store's writer (the step does not wait for the write)."""
        bm = self.block_manager
        if bm.reuses:
            fresh = {h: b for b, h in bm.reuses if self.kv_store.count_match(h)}      # hash -> block, once
            bm.reuses.clear()
            if fresh:
                read = self.runner.read_blocks(list(fresh.values()))
                self.kv_store.reused([(h, BlockData(kv, hid)) for h, (kv, hid) in zip(fresh, read)])
        if bm.commits:
            read = self.runner.read_blocks([b for b, _ in bm.commits])
            self.kv_store.committed([(h, BlockData(kv, hid)) for (_, h), (kv, hid) in zip(bm.commits, read)])
            bm.commits.clear()
            if self.cfg.kv_store_sync:
                self.kv_store.flush()

    # ---------------------------------------------------------------- blocks between targets (P/D, direct)
    def export_blocks(self, prompt: list[int], cache_salt: str = "") -> list[tuple[BlockHash, BlockData]]:
        """Copies of the KV of `prompt`'s leading full blocks that this cache holds, in order, up to the first it
        does not: what a decode target needs to skip the prefill this engine computed (the last prompt token is
        always computed there, so its block is not included when it is full)."""
        bm = self.block_manager
        hashes = hash_chain(prompt, bm.block_size, self._cache_extra(prompt, cache_salt),
                            max_blocks=(len(prompt) - 1) // bm.block_size)
        blocks = []
        for h in hashes:
            block = bm.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        read = self.runner.read_blocks(blocks) if blocks else []
        return [(h, BlockData(kv, hid)) for h, (kv, hid) in zip(hashes, read)]

    def receive_blocks(self, items: list[tuple[BlockHash, BlockData]]) -> None:
        """Blocks another target computed (already checked against this engine's layout) into the host tier, where
        the next prefix-cache miss of their prompt finds them."""
        if self.kv_store is None or self.kv_store.host is None:
            raise NotConfigured("this target keeps no host tier for KV blocks from other targets: start it with "
                                "--kv-host-gb")
        self.kv_store.received(items)

    def close(self) -> None:
        """Stops background work (the block store's writer, after its queued writes). With write_back, the blocks
        the cache still holds are written first."""
        if self.kv_store is None:
            return
        if self.kv_store.wants_cache_at_stop:
            held = list(self.block_manager.cached.items())                    # (hash, block)
            for i in range(0, len(held), 64):
                part = held[i:i + 64]
                read = self.runner.read_blocks([b for _, b in part])
                self.kv_store.stopping([(h, BlockData(kv, hid)) for (h, _), (kv, hid) in zip(part, read)])
        self.kv_store.close()

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

    # ---------------------------------------------------------------- speculative decoding
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
        room = min(p.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq)) - 1
        if self.long_rope_after is not None and not seq.long_rope:   # no draft past the switch to the long factors
            room = min(room, self.long_rope_after - len(seq))
        return max(0, min(seq.spec_k, k_max, room))

    def _propose(self) -> None:
        limit = self.cfg.speculative_max_seqs
        if limit and len(self.scheduler.running) + len(self.scheduler.waiting) > limit:
            # a big batch: verifying drafts costs more than it saves (plain steps); sequences waiting join the next
            # step, which would be plain, and a proposal now would keep them waiting for it (a burst's first one)
            return
        seqs, ks = [], []
        for seq in self.scheduler.running:
            if seq.num_uncomputed == 1 and not seq.spec_tokens and seq.num_output_tokens > 0:
                k = self._spec_k(seq)
                if k:
                    seqs.append(seq)
                    ks.append(k)
        if not seqs:
            return
        with telemetry.span_in("propose", telemetry.traced_contexts(seqs), {"upesi.seqs": len(seqs)}):
            proposals = self.proposer.propose(seqs, ks)
        for seq, (tokens, probs, parents) in zip(seqs, proposals):
            if is_chain(parents):
                parents = None
            elif not seq.params.greedy:
                continue                      # trees are verified greedily only: a sampled sequence decodes plainly
            if tokens:
                seq.token_ids.extend(tokens)
                seq.spec_tokens, seq.spec_probs, seq.spec_parents = list(tokens), probs, parents

    @contextmanager
    def _step_threads(self, rows: int):
        """A step over few rows (decode) is memory-bound on CPU and runs on `num_threads`; a wide one (a draft
        verification's K + 1 rows, a prefill, a big batch) is compute-bound and runs on `wide_threads` when set."""
        wide = self.cfg.wide_threads
        if not wide or rows < WIDE_ROWS or wide == self.threads:
            yield
            return
        torch.set_num_threads(wide)              # per calling thread with OpenMP: set and reset where the step runs
        try:
            yield
        finally:
            torch.set_num_threads(self.threads)

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> Delta:
        """logits [K + 1, V] of a sequence that carried K draft tokens: accept, roll back, emit."""
        draft, q, parents = seq.spec_tokens, seq.spec_probs, seq.spec_parents
        p = seq.params
        base = len(seq) - len(draft)                  # tokens before the drafts
        depth = len(draft)
        if parents is not None:                       # a tree: accept a path, move its KV next to the root
            path, tok = walk_greedy(logits, draft, parents)
            self.runner.move_kv(seq.block_table, [(base - 1 + a, base - 1 + b) for a, b in compaction(path)])
            self.tree_paths[seq.seq_id] = path
            n, depth = len(path), max(depths(parents))
            draft = [draft[a] for a in path]
        elif p.greedy:
            n, tok = verify_greedy(logits, draft)
        else:
            probs = probs_from_logits(logits, torch.full((len(logits),), p.temperature),
                                      torch.full((len(logits),), p.top_k), torch.full((len(logits),), p.top_p))
            n, tok = verify_sampled(probs, q, draft, seq.generator)
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
        for t in draft[:n] + [tok]:
            seq.token_ids.append(t)
            emitted.append(t)
            reason = self._finish_reason(seq, t)
            if reason:
                break
        seq.num_computed_tokens = min(base + n, len(seq) - 1)   # KV of rejected positions is dropped
        self.block_manager.trim(seq)
        self.block_manager.commit(seq)
        if reason:
            self.scheduler.finish(seq, reason)
        return self._delta(seq, emitted)

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

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _delta(self, seq: Sequence, tokens: list[int]) -> Delta:
        return Delta(seq.request_id, seq.index, tokens, seq.finish_reason, seq.num_prompt_tokens,
                     seq.num_cached_tokens, seq.num_draft_tokens, seq.num_accepted_tokens)

    def _forget_finished(self, request_id: str) -> None:
        seqs = self.requests.get(request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self.requests[request_id]
            if self.proposer is not None:
                for seq in seqs:
                    self.proposer.release(seq.seq_id)
            self.pending_forks.pop(seqs[0].seq_id, None)

    # ---------------------------------------------------------------- offline API
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
