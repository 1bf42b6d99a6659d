"""The in-process engine: requests in, token deltas out, one continuous-batching step at a time.

Single-threaded by design: the target service drives it from one thread (shared.engine.async_engine),
tests and benchmarks call it directly (`generate`). This module holds the requests and the step loop (schedule,
run, sample, commit); beside it, one module each: speculation (propose, verify, roll back), the KV blocks beyond
the cache (block store, transfer between targets), beam search steps, LongRoPE switching and the offline API.
"""
from __future__ import annotations

import logging
import time
import uuid
from contextlib import contextmanager

import torch

from shared import telemetry
from shared.engine.beam import BeamGroup
from shared.engine.beam_steps import BeamStepsMixin
from shared.engine.config import WIDE_ROWS, EngineConfig
from shared.engine.delta import Delta, TokenLogprob
from shared.engine.kv_transfer import KVTransferMixin
from shared.engine.logits_processing import process_batch, rows_logprobs, token_logprobs
from shared.engine.long_rope import LongRopeMixin
from shared.engine.model_runner import ModelRunner, kv_cache_layout
from shared.engine.offline import OfflineMixin
from shared.engine.prefill_pacer import PrefillPacer
from shared.engine.proposal import ProposerFactory
from shared.engine.sampler import sample
from shared.engine.scheduler import Scheduler
from shared.engine.sequence import Sequence
from shared.engine.spec_guard import SpecGuard
from shared.engine.stats import StatsMixin
from shared.engine.structured import Guides
from shared.engine.speculation import SpeculationMixin
from shared.errors import InvalidRequest
from shared.kv.block_codec import BlockLayout, model_fingerprint
from shared.kv.block_manager import BlockManager
from shared.model.loader import load_config
from shared.model.registry import build_model, check_architecture
from shared.model_files import resolve_model_path
from shared.tokenizer import Tokenizer
from shared.quant.model_quant import set_act_quant
from shared.sampling_params import SamplingParams

__all__ = ["Delta", "LLMEngine"]

log = logging.getLogger(__name__)


class LLMEngine(SpeculationMixin, KVTransferMixin, BeamStepsMixin, LongRopeMixin, OfflineMixin, StatsMixin):
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
                                            cfg.hf_overrides, packed=not cfg.dequantise_gguf,
                                            int8_activations=cfg.int8_activations)
        if cfg.nvfp4_act_quant and not set_act_quant(model, True):
            raise ValueError(f"W4A4 was asked for but {self.model_path} has no NVFP4 layers (quantize it first)")
        per_block = ModelRunner.kv_bytes_per_block(self.model_cfg, cfg.block_size, dtype, model)
        num_blocks = cfg.num_kv_blocks or max(1, int(cfg.kv_cache_gb * 2**30) // per_block)
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        pacer = PrefillPacer(cfg.prefill_itl_stretch, cfg.max_num_batched_tokens) if cfg.prefill_itl_stretch else None
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.prefill_chunk_tokens, pacer)
        self.runner = ModelRunner(model, self.model_cfg, num_blocks, cfg.block_size, dtype, device)
        self.long_rope_after: int | None = getattr(model, "long_rope_after", None)   # LongRoPE's original window
        kvh, dh, shared = kv_cache_layout(model, self.model_cfg)
        # what a block's bytes mean, for the block store and for blocks sent to or received from another target
        self.block_layout = BlockLayout(model_fingerprint(model, repr(self.model_cfg), dtype), dtype,
                                        self.model_cfg.num_layers, cfg.block_size, kvh, dh, shared,
                                        self.model_cfg.hidden_size)
        self.kv_store = self._open_kv_store(cfg)
        # Every layer attends a sliding window (Mistral v0.1, Phi-3): blocks behind it go back to the pool.
        windows = [getattr(getattr(layer, "self_attn", None), "window", None) for layer in getattr(model, "layers", [])]
        self.window = min(windows) if windows and all(windows) else None
        self.eos_token_ids = set(self.model_cfg.eos_token_ids)
        if cfg.speculative and make_proposer is None:
            raise ValueError(f"speculative={cfg.speculative!r} needs a proposer factory: build the engine with "
                             "shared.spec.factory.build_engine")
        self.guides = Guides(lambda: Tokenizer(self.model_path).hf, self.model_cfg.vocab_size)
        self.proposer = make_proposer(cfg, model, self.max_model_len) if cfg.speculative and make_proposer else None
        self.requests: dict[str, list[Sequence]] = {}
        self.pending_forks: dict[int, list[Sequence]] = {}      # choice 0's seq_id -> choices 1..n-1
        self.beam_groups: dict[str, BeamGroup] = {}              # request id -> its beam search
        self.stats_draft = self.stats_accepted = 0               # speculative tokens proposed / accepted
        self.spec_guard = SpecGuard()                            # speculative or plain steps, by measured cost
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
        for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids),
                          ("bad_words", [t for w in params.bad_words for t in w])):
            if ids and max(ids) >= vocab:
                raise InvalidRequest(f"{name} names token {max(ids)}, outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens but the context window is "
                                 f"{self.max_model_len}; shorten it by at least {len(prompt) - self.max_model_len + 1}")
        need = self.block_manager.blocks_for(len(prompt) + 1)
        if need > self.block_manager.num_blocks:
            raise InvalidRequest(f"the prompt needs {need} KV blocks but the cache has only "
                                 f"{self.block_manager.num_blocks} in all (block size {self.cfg.block_size})")
        long_rope = self._past_window(len(prompt))
        # the prompt's log-probabilities need every prompt row computed: a salt of its own, so no cached block
        salt = params.cache_salt if params.prompt_logprobs is None else f"{params.cache_salt}\0{uuid.uuid4().hex}"
        seqs = [Sequence(request_id, i, prompt, params, self._cache_extra(prompt, salt)) for i in range(params.n)]
        for s in seqs:
            s.long_rope, s.trace_ctx = long_rope, trace_ctx
            if params.guide_kind:
                s.guide = self.guides.guide(params.guide_kind, params.guide)
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
        t_start = time.perf_counter()
        # not measured: a sequence's first proposal (it also reads its whole prompt into the draft: paid once), and
        # steps with a sequence whose request set its own K (it drafts, or not, whatever the guard says)
        unmeasured = self.cfg.speculation_guard and any(s.num_output_tokens <= 1 or s.params.num_speculative_tokens
                                                         is not None for s in self.scheduler.running)
        guarded, drafting, looked = self._propose_step()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        split = batch.prompt_split()
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
        self._keep_prompt_logprobs(batch)
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
        self._fork_pending(sampled, rows)
        deltas += self._sample_rows(sampled, rows, logits)
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
        if self.scheduler.pacer is not None:
            self.scheduler.pacer.observe(*split, self.last_step_s)
        if guarded and not unmeasured:
            emitted = sum(len(d.token_ids) for d in deltas)
            self.spec_guard.observe(guarded, drafting, time.perf_counter() - t_start, emitted,
                                    None if drafting else looked)
        if self.kv_store is not None:
            self._store_commits()
            self.kv_store.cost.observe_prefill(sum(batch.num_tokens), self.last_step_s)
        return deltas

    def _sample_rows(self, sampled: list[Sequence], rows: list[int], logits: torch.Tensor) -> list[Delta]:
        """One token for each sequence in `sampled` from its row of `logits` [N, V]: processed, sampled, appended."""
        if not sampled:
            return []
        # one row per sequence, in order: no copy of the logits
        raw = logits if rows == list(range(logits.shape[0])) else logits[rows]
        tokens = sample(process_batch(raw, sampled, self.eos_token_ids), sampled)
        deltas = []
        for seq, tok, lp in zip(sampled, tokens, rows_logprobs(raw, tokens, [s.params.logprobs for s in sampled])):
            seq.token_ids.append(tok)
            if seq.guide is not None:
                seq.guide.accept(tok)
            reason = self._finish_reason(seq, tok)
            if reason:
                self.scheduler.finish(seq, reason)
            deltas.append(self._delta(seq, [tok], None if lp is None else [lp]))
        return deltas

    def _fork_pending(self, sampled: list[Sequence], rows: list[int]) -> None:
        """Choices 1 .. n-1 of requests whose choice 0 just computed its prompt: they share its blocks (copy-on-write
        later) and sample from its row, each with its own generator; appended to `sampled` and `rows`."""
        for row, parent in zip(list(rows), list(sampled)):
            for child in self.pending_forks.pop(parent.seq_id, []):
                if child.is_finished:
                    continue
                self.block_manager.fork(parent, child)
                if parent.prompt_logprobs is not None:
                    child.prompt_logprobs = list(parent.prompt_logprobs)
                self.scheduler.start(child)
                sampled.append(child)
                rows.append(row)

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

    def _finish_reason(self, seq: Sequence, tok: int, grammar_ended: bool = True) -> str | None:
        """Why the sequence ends at its token `tok`, or None. grammar_ended: whether the grammar's state is the one
        after `tok` (false for a verification's tokens before its last: the grammar has already taken them all)."""
        p = seq.params
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids or \
                (grammar_ended and seq.guide is not None and seq.guide.done):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _delta(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> Delta:
        first = seq.prompt_logprobs is not None and seq.num_output_tokens == len(tokens)
        return Delta(seq.request_id, seq.index, tokens, seq.finish_reason, seq.num_prompt_tokens,
                     seq.num_cached_tokens, seq.num_draft_tokens, seq.num_accepted_tokens, logprobs,
                     seq.prompt_logprobs if first else None)

    def _keep_prompt_logprobs(self, batch) -> None:
        """Log-probabilities of the prompt rows the runner computed, for the sequences that asked (a recomputed
        prompt, after preemption, adds nothing twice)."""
        for b, first, logits in self.runner.prompt_logits or ():
            seq = batch.seqs[b]
            skip = len(seq.prompt_logprobs) - first
            if skip < len(logits):
                toks = seq.token_ids[first + 1 + skip:first + 1 + len(logits)]
                seq.prompt_logprobs += token_logprobs(logits[skip:], toks, seq.params.prompt_logprobs)

    def _forget_finished(self, request_id: str) -> None:
        seqs = self.requests.get(request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self.requests[request_id]
            if self.proposer is not None:
                for seq in seqs:
                    self.proposer.release(seq.seq_id)
            self.pending_forks.pop(seqs[0].seq_id, None)



