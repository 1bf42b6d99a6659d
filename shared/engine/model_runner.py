"""Owns the model and its paged KV cache; turns a scheduled batch into one forward pass.

Shapes: T = new tokens in the step, B = sequences, MB = max blocks per sequence, V = vocab.
"""
from __future__ import annotations

import torch

from shared.engine.scheduler import ScheduledBatch
from shared.model.config import ModelConfig
from shared.ops.paged_attention import AttentionMetadata
from shared.tree import ancestor_mask, depths


def kv_cache_layout(model: torch.nn.Module | None, cfg: ModelConfig) -> tuple[int, int, bool]:
    """(kv heads, head dim, K and V are one tensor) of each layer's cache. A model whose cache is not per-head K/V
    (MLA's compressed latent) declares it with kv_cache_spec() -> (heads, dim) and `kv_cache_shared`."""
    spec = getattr(model, "kv_cache_spec", None)
    if spec is None:
        return cfg.num_kv_heads, cfg.head_dim, False
    kvh, dh = spec()
    return kvh, dh, bool(getattr(model, "kv_cache_shared", False))


class ModelRunner:
    prompt_logits: list[tuple[int, int, torch.Tensor]] | None = None     # of the last run (_prompt_logits)

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.cfg, self.block_size, self.device = model, cfg, block_size, device
        self.num_blocks, self.dtype = num_blocks, dtype
        kvh, dh, shared = kv_cache_layout(model, cfg)
        shape = (num_blocks, block_size, kvh, dh)
        self.kv_caches = []
        for _ in range(cfg.num_layers):
            k = torch.zeros(shape, dtype=dtype, device=device)
            self.kv_caches.append((k, k if shared else torch.zeros(shape, dtype=dtype, device=device)))
        self.last_hidden: torch.Tensor | None = None     # [T, D] of the last run, when capture is on
        self._capture = None
        # When capture is on, the hidden states of every position in the cache, beside its KV (slot by slot), so that
        # a prefix-cache hit can give an EAGLE head the prompt's features without recomputing them.
        self.hidden_cache: torch.Tensor | None = None   # [NB * BS, D]
        self.hidden_ok: torch.Tensor | None = None      # [NB] bool: the block's rows were all written while capturing

    def capture_hidden(self) -> None:
        """From now on keep a reference (no copy) to each step's last hidden states before the final norm, which
        is what EAGLE-style heads read; off by default, so other paths do no extra work."""
        if self._capture is not None:
            return
        norm = getattr(self.model, "norm", None)
        if norm is None:
            raise ValueError(f"{type(self.model).__name__} has no final norm to take hidden states from")

        def keep(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            self.last_hidden = args[0]                                             # [T, D]
        self._capture = norm.register_forward_pre_hook(keep)
        self.hidden_cache = torch.zeros(self.num_blocks * self.block_size, self.cfg.hidden_size, dtype=self.dtype,
                                        device=self.device)
        self.hidden_ok = torch.zeros(self.num_blocks, dtype=torch.bool, device=self.device)

    def cached_hidden(self, table: list[int], length: int) -> torch.Tensor | None:
        """The hidden states [length, D] of a sequence's first `length` positions from the hidden cache, or None
        where capture is off or one of their blocks was (partly) computed before it was on."""
        if self.hidden_cache is None or length < 1:
            return None
        bs = self.block_size
        blocks = torch.tensor(table[:(length + bs - 1) // bs], device=self.device)
        if not bool(self.hidden_ok[blocks].all()):
            return None
        slots = (blocks[:, None] * bs + torch.arange(bs, device=self.device)[None, :]).flatten()[:length]
        return self.hidden_cache[slots]

    @staticmethod
    def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                           model: torch.nn.Module | None = None) -> int:
        kvh, dh, shared = kv_cache_layout(model, cfg)
        return (1 if shared else 2) * cfg.num_layers * block_size * kvh * dh * dtype.itemsize

    def prepare(self, batch: ScheduledBatch
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[tuple[int, int, int]]]:
        """Builds input ids, positions and attention metadata, plus the rows whose logits are needed and, per
        sequence that needs logits, (batch index, first of its rows among them, row count)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[tuple[int, int, int]] = []
        trees: dict[int, torch.Tensor] = {}
        for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            c = seq.num_computed_tokens
            ids.extend(seq.token_ids[c:c + n])
            if seq.spec_parents is not None:         # a draft tree: the root at c, node i at c + its depth
                pos.append(c)
                pos.extend(c + d for d in depths(seq.spec_parents))
                trees[b] = ancestor_mask(seq.spec_parents, self.device)              # [n, n]
            else:
                pos.extend(range(c, c + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + n))
            starts.append(starts[-1] + n)
            seq_lens.append(c + n)
            if c + n == len(seq):                    # caught up: the last row predicts the next token,
                k = len(seq.spec_tokens)             # and K draft tokens need the K rows before it too
                sample_seqs.append((b, len(sample_rows), k + 1))
                sample_rows.extend(range(starts[-1] - 1 - k, starts[-1]))
        max_blocks = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in batch.seqs]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int64, device=dev),        # [B, MB]
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),          # [B]
            query_start_loc=torch.tensor(starts, dtype=torch.int64, device=dev),     # [B + 1]
            num_decodes=batch.num_decodes,
            query_lens=list(batch.num_tokens),
            seq_lens_host=seq_lens,
            max_query_len=max(batch.num_tokens),
            tree_masks=trees,
            long_rope=[s.long_rope for s in batch.seqs],
            prompt_chunks=[s.in_prompt for s in batch.seqs],
        )
        return (torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev),
                meta, sample_rows, sample_seqs)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicates whole blocks (every layer, K and V) before the step writes into them."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for k, v in self.kv_caches:
            k[dst] = k[src]
            v[dst] = v[src]
        if self.hidden_cache is not None:
            bs = self.block_size
            rows = self.hidden_cache.view(self.num_blocks, bs, -1)
            rows[dst] = rows[src]
            self.hidden_ok[dst] = self.hidden_ok[src]

    @torch.inference_mode()
    def read_blocks(self, blocks: list[int]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Copies of whole blocks, every layer: per block (kv [L, S, BS, KVH, Dh], hidden [BS, D] or None), S = 2
        (K, V) or 1 where they are one tensor; hidden where the hidden cache holds every row of the block."""
        ids = torch.tensor(blocks, device=self.device)
        kv = torch.stack([torch.stack((k[ids],) if v is k else (k[ids], v[ids]), 1) for k, v in self.kv_caches],
                         1).cpu()                                                 # [n, L, S, BS, KVH, Dh]
        hidden: list[torch.Tensor | None] = [None] * len(blocks)
        if self.hidden_cache is not None:
            ok = self.hidden_ok[ids].tolist()
            rows = self.hidden_cache.view(self.num_blocks, self.block_size, -1)[ids].cpu()    # [n, BS, D]
            hidden = [rows[i] if ok[i] else None for i in range(len(blocks))]
        return [(kv[i], hidden[i]) for i in range(len(blocks))]

    @torch.inference_mode()
    def write_blocks(self, blocks: list[int], contents: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """The inverse of read_blocks: fills whole blocks, every layer (hidden rows where given)."""
        if not blocks:
            return
        ids = torch.tensor(blocks, device=self.device)
        kv = torch.stack([c[0] for c in contents]).to(self.device, self.dtype)         # [n, L, S, BS, KVH, Dh]
        for layer, (k, v) in enumerate(self.kv_caches):
            k[ids] = kv[:, layer, 0]
            if v is not k:
                v[ids] = kv[:, layer, 1]
        if self.hidden_cache is not None:
            rows = self.hidden_cache.view(self.num_blocks, self.block_size, -1)
            for block, (_, hidden) in zip(blocks, contents):
                if hidden is not None:
                    rows[block] = hidden.to(self.device, self.dtype)
                self.hidden_ok[block] = hidden is not None

    @torch.inference_mode()
    def move_kv(self, table: list[int], moves: list[tuple[int, int]]) -> None:
        """Moves KV between token indices of one sequence (its block table), every layer: (from, to) pairs, all
        read before any is written (a draft tree's accepted path closing up, shared.tree.compaction)."""
        if not moves:
            return
        bs = self.block_size
        src = torch.tensor([table[f // bs] * bs + f % bs for f, _ in moves], device=self.device)
        dst = torch.tensor([table[t // bs] * bs + t % bs for _, t in moves], device=self.device)
        for k, v in self.kv_caches:
            for cache in (k, v) if v is not k else (k,):
                flat = cache.view(-1, *cache.shape[2:])                               # [NB * BS, KVH, Dh]
                flat[dst] = flat[src]
        if self.hidden_cache is not None:
            self.hidden_cache[dst] = self.hidden_cache[src]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """One forward pass -> logits [N, V] of the rows that predict tokens, and (batch index, first row, rows)
        per sequence (one row, or K + 1 for a sequence verifying K draft tokens)."""
        input_ids, positions, meta, rows, which = self.prepare(batch)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)           # [T, D]
        if self.hidden_cache is not None and self.last_hidden is not None:
            self.hidden_cache.index_copy_(0, meta.slot_mapping, self.last_hidden.to(self.dtype))
            firsts = meta.slot_mapping[meta.slot_mapping % self.block_size == 0]    # a block (re)written from its start
            self.hidden_ok[firsts // self.block_size] = True
        logits = self.model.compute_logits(hidden[rows]) if rows else hidden.new_empty(0, 0)   # [N, V]
        self.prompt_logits = self._prompt_logits(batch, hidden)
        return logits, which

    def _prompt_logits(self, batch: ScheduledBatch, hidden: torch.Tensor
                       ) -> list[tuple[int, int, torch.Tensor]] | None:
        """(batch index, first position, logits [n, V]) of the prompt rows of sequences that asked for the prompt's
        log-probabilities: row i predicts prompt token first + i + 1."""
        out, start = [], 0
        for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            c, last = seq.num_computed_tokens, seq.num_prompt_tokens - 1
            if seq.params.prompt_logprobs is not None and c < last:
                k = min(c + n, last) - c
                out.append((b, c, self.model.compute_logits(hidden[start:start + k])))
            start += n
        return out or None
